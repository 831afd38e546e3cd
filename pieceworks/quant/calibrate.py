"""Activation calibration for the quantizer: max |input| of every linear over some text.

This is ModelOpt's "max" calibration: the unquantized model runs forward and every linear's input
amax is the maximum of |x| over all calibration tokens. The quantizer turns it into
`input_scale = amax / (6 * 448)`.

Linears are `nn.Linear` modules (forward pre-hooks) plus the fused expert modules of
`transformers` >= 5 (3-D `gate_up_proj` / `down_proj` parameters, one `F.linear` per expert): their
per-expert linear calls are seen through a `TorchFunctionMode` while the experts module runs. As in
ModelOpt 0.47, all experts of a layer share one input amax per projection (gate/up, down): the
checkpoint keeps one input_scale per expert, all equal.

Needs `transformers` (the `demo` extra), imported only when calibrating.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from pieceworks.quant.modelopt import mixtral_name
from pieceworks.util import progress_bar, transformers_bars

_F_LINEAR = torch.nn.functional.linear


def _is_fused_experts(module: torch.nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


class _ExpertSpy(TorchFunctionMode):
    """Records input amax of F.linear calls whose weight is a slice of the experts' 3-D params."""

    def __init__(self, module: torch.nn.Module, record):
        super().__init__()
        self.ptrs = {
            module.gate_up_proj.untyped_storage().data_ptr(): "gate_up",
            module.down_proj.untyped_storage().data_ptr(): "down",
        }
        self.record = record
        self.calls = 0

    # Hooks return None: a forward pre-hook's return value would replace the module's arguments.
    def enter_hook(self, module, args) -> None:
        self.__enter__()

    def exit_hook(self, module, args, output) -> None:
        self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F_LINEAR:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            kind = self.ptrs.get(w.untyped_storage().data_ptr())
            if kind is not None and x.numel():
                self.record(kind, x)
                self.calls += 1
        return func(*args, **kwargs)


def calibrate_input_amax(model: torch.nn.Module, batches: Iterable[torch.Tensor],
                         kv_amax: dict[str, tuple[float, float]] | None = None,
                         advance: Callable[[], None] | None = None) -> dict[str, float]:
    """Run `model(input_ids=batch)` over `batches` and collect every linear's input amax.

    Args:
        model: a `transformers` causal LM (unquantized; eval mode is set here).
        batches: int64 token-id tensors [B, T].
        kv_amax: filled, where given, with {attention module's checkpoint name: (max |key|, max |value|)} over
            the keys and values its attention function is called with (roped, as a KV cache holds them), as
            ModelOpt's FP8 KV quantizers calibrate them.
        advance: called after each batch (a progress bar's).

    Returns:
        {checkpoint module name: amax} (e.g. `model.layers.0.self_attn.q_proj`; fused experts
        appear as `<experts>.{e}.gate_proj` / `.up_proj` / `.down_proj` for every expert e, Mixtral's as
        `...block_sparse_moe.experts.{e}.w1` / `w3` / `w2`). A linear that never ran is absent.

    Raises:
        ValueError: a fused experts module ran but none of its expert linears was seen (its
            implementation is not "eager"; load the model with `experts_implementation="eager"`).
    """
    amax: dict[str, torch.Tensor] = {}

    def note(name: str, x: torch.Tensor) -> None:
        m = x.detach().abs().amax().float().cpu()
        amax[name] = m if name not in amax else torch.maximum(amax[name], m)

    handles, spies = [], []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(lambda mod, args, n=name: note(n, args[0])))
        elif _is_fused_experts(module):
            spy = _ExpertSpy(module, lambda kind, x, n=name: note(f"{n}#{kind}", x))
            spies.append((name, module, spy))
            handles.append(module.register_forward_pre_hook(spy.enter_hook))
            handles.append(module.register_forward_hook(spy.exit_hook, always_call=True))
    if kv_amax is not None:
        names = {id(m): n for n, m in model.named_modules()}
        handles.append(_AttentionSpy(lambda module, k, v: (note(f"{names[id(module)]}#k", k),
                                                             note(f"{names[id(module)]}#v", v))))
    model.eval()
    device = next(model.parameters()).device
    # Logits for the last position only: lm_head is never quantized, and on a CPU the full-vocabulary
    # projection of every token is a large share of the forward (lm_head still sees one position).
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids.to(device), **kwargs)
                if advance is not None:
                    advance()
    finally:
        for h in handles:
            h.remove()
    out = {name: float(v) for name, v in amax.items() if "#" not in name}
    rename = _CHECKPOINT_NAMES.get(getattr(getattr(model, "config", None), "model_type", None), lambda n: n)
    if kv_amax is not None:
        kv_amax.update({rename(n[:-2]): (float(amax[n]), float(amax[n[:-2] + "#v"])) for n in amax if n.endswith("#k")})
    for name, module, spy in spies:
        if spy.calls == 0:
            raise ValueError(
                f"{name}: the experts ran but no per-expert linear was seen; load the model with "
                "experts_implementation=\"eager\" for calibration"
            )
        for e in range(module.gate_up_proj.shape[0]):
            for proj, kind in (("gate_proj", "gate_up"), ("up_proj", "gate_up"), ("down_proj", "down")):
                if f"{name}#{kind}" in amax:
                    out[f"{name}.{e}.{proj}"] = float(amax[f"{name}#{kind}"])
    return {rename(name): v for name, v in out.items()}


class _AttentionSpy:
    """While installed, every attention function transformers' attention modules look up
    (`ALL_ATTENTION_FUNCTIONS.get_interface`, the eager default included) first shows `seen(module, key, value)`
    the keys and values it is called with; `remove()` takes it away (a hook handle's interface)."""

    def __init__(self, seen) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.interfaces = ALL_ATTENTION_FUNCTIONS
        lookup = type(ALL_ATTENTION_FUNCTIONS).get_interface

        def get_interface(attn_implementation, default):
            fn = lookup(ALL_ATTENTION_FUNCTIONS, attn_implementation, default)

            def spied(module, query, key, value, *args, **kwargs):
                seen(module, key, value)
                return fn(module, query, key, value, *args, **kwargs)

            return spied

        ALL_ATTENTION_FUNCTIONS.get_interface = get_interface

    def remove(self) -> None:
        self.interfaces.__dict__.pop("get_interface", None)


def _released_multimodal_name(name: str) -> str:
    """transformers 5's `model.language_model.X` (`model.vision_tower.X`, ...) as the released multimodal checkpoints,
    and transformers' save_pretrained, name it: `language_model.model.X` (`vision_tower.X`)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name[len("model.language_model."):]
    return name[len("model."):] if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) else name


_CHECKPOINT_NAMES = {"mixtral": mixtral_name, "gemma3": _released_multimodal_name}
"""Per model_type, the checkpoint's name of a transformers module name where they differ (transformers 5 names
Mixtral's modules as pieceworks' Llama does, and Gemma 3's text model `model.language_model`)."""


def text_batches(tokenizer, text: str, seq_len: int) -> list[torch.Tensor]:
    """Split `text` into [1, <= seq_len] token batches, each starting with BOS when there is one."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    step = seq_len - (bos is not None)
    if step < 1:
        raise ValueError(f"calibration chunks of {seq_len} token(s) (the model's max_position_embeddings) hold no text "
                         "after the BOS token; pass a fixed --amax instead")
    chunks = [ids[i : i + step] for i in range(0, len(ids), step)]
    return [torch.tensor([([bos] if bos is not None else []) + c]) for c in chunks if c]


def calibrate_from_text(
    model_dir: str | Path, text_file: str | Path, *, seq_len: int = 512, device: str | None = None,
    check_weight: Callable[[str, torch.Tensor], None] | None = None,
    kv_amax: dict[str, tuple[float, float]] | None = None, progress: bool = False,
) -> dict[str, float]:
    """Load the bf16 model and its tokenizer from `model_dir` and calibrate over `text_file` (with a progress bar
    of the chunks where `progress`).

    The whole model is loaded (on `device`: CUDA when available, else CPU) and runs forward over
    the text in chunks of `seq_len` tokens (at most the model's max_position_embeddings).
    `check_weight(name, tensor)`, where given, sees every parameter before the first forward pass (the
    quantizer's checks, so that a bad weight is named before minutes of calibration, not after).

    Returns:
        as `calibrate_input_amax` (and `kv_amax` filled as it fills it).

    Raises:
        ValueError: transformers is missing (`pip install 'pieceworks[demo]'`), the text file is
            missing, empty or not UTF-8 text, or the model or its tokenizer cannot be loaded.
        What `check_weight` raises (the quantizer's: ValueError for a weight with NaN, inf or a value beyond
            the loader's bound).
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ValueError(
            "calibrating over text needs transformers: pip install 'pieceworks[demo]' (or pass a fixed "
            "--amax: no calibration)"
        ) from None
    if isinstance(text_file, str) and ("\n" in text_file or len(text_file) > 1024):
        raise ValueError(
            f"calib_text must be the path of a text file, got a str of {len(text_file)} characters that "
            "looks like the text itself; write it to a file and pass its path"
        )
    text_file = Path(text_file)
    try:
        text = text_file.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{text_file}: cannot read the calibration text ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{text_file}: the calibration text is not UTF-8 (byte {e.start}: {e.reason}); it must be "
                         "UTF-8 plain text: convert it (e.g. iconv -t UTF-8) or give another file") from None
    if "\x00" in text:  # valid UTF-8, yet a binary file (text files hold no NUL bytes)
        raise ValueError(f"{text_file}: the calibration text holds NUL bytes (byte {text.encode().index(0)}), so it "
                         "is a binary file; it must be UTF-8 plain text: give a text file")
    if not text.strip():
        raise ValueError(f"{text_file}: the calibration text is empty")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many kinds here
        raise ValueError(
            f"{model_dir}: cannot load a tokenizer for calibration ({type(e).__name__}: {e}); put the "
            "tokenizer files next to the model, or pass a fixed --amax"
        ) from None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        # On a CPU, bf16 matmuls run ~3x slower than float32: calibrate there in float32 (the amax
        # values then differ from a bf16 forward by bf16 rounding of the activations, well inside
        # what max calibration over a different text would change anyway).
        dtype = "auto" if str(device).startswith("cuda") else torch.float32
        with transformers_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=dtype, experts_implementation="eager"
            ).to(device)
    except Exception as e:
        raise ValueError(f"{model_dir}: transformers cannot load the model ({type(e).__name__}: {e})") from None
    with torch.no_grad():
        for name, p in model.named_parameters() if check_weight else ():
            check_weight(name, p)
    seq_len = min(seq_len, getattr(model.config, "max_position_embeddings", None) or seq_len)
    batches = text_batches(tokenizer, text, seq_len)
    with progress_bar(progress, "calibrating", total=len(batches)) as advance:
        return calibrate_input_amax(model, batches, kv_amax, advance)
