"""Config forms with a kind per layer (transformers 5's `layer_types`): Gemma 2 / 3's, OLMo 3's and EXAONE 4's
config.json as the Llama (or OLMo 2) form their full-attention layers take, their sliding-window layers' rope, and
which layers slide; `check`, hf_config's checks of any config.json with these forms read first."""

from __future__ import annotations

from typing import Callable

from pieceworks.models import hf_config
from pieceworks.models.families import family, with_defaults
from pieceworks.models.hf_config import FieldError, _type_ok


def gemma_form(hf: dict) -> tuple[dict, dict, tuple[bool, ...]]:
    """A Gemma 2 or Gemma 3 config.json (its family's defaults filled in) as (the config in Llama's form: its
    full-attention layers' rope as the rope settings, no layer types or window; the sliding-window layers' rope
    settings, Gemma 2's the same; per layer, whether it slides). Reads transformers 5's form (Gemma 3's
    rope_parameters per layer kind, layer_types) and the released one (rope_theta, rope_scaling and Gemma 3's
    rope_local_base_freq; every sliding_window_pattern-th layer full, Gemma 2's every other one).

    Raises:
        FieldError: bidirectional attention (EmbeddingGemma's: not implemented), an activation other than
            gelu_pytorch_tanh, or layer types other than sliding_attention / full_attention.
    """
    gemma2 = family(hf) == "gemma2"
    if hf.get("use_bidirectional_attention"):
        raise FieldError("use_bidirectional_attention", "true: pieceworks runs causal attention")
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise FieldError("hidden_activation", f"{act!r}: pieceworks' Gemma runs gelu_pytorch_tanh")
    every = 2 if gemma2 else hf.get("sliding_window_pattern", 6)
    sliding, _ = sliding_layers(hf, lambda i: (i + 1) % every != 0)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5's Gemma 3: per layer kind
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    else:  # one set (Gemma 3's full layers; Gemma 2's every layer) and Gemma 3's rope_local_base_freq
        full = {**(hf.get("rope_scaling") or params or {"rope_type": "default"})}
        full.setdefault("rope_theta", hf.get("rope_theta", 10000.0 if gemma2 else 1e6))
        local = full if gemma2 else {"rope_type": "default"}
    full.setdefault("rope_theta", 1e6)
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    llama = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta", "layer_types", "sliding_window",
                                                      "hidden_activation")}
    # hidden_act: Llama's form takes silu; the activation is checked above and run by the Gemma model
    return {**llama, "rope_parameters": full, "hidden_act": "silu"}, local, sliding


def sliding_layers(hf: dict, default: Callable[[int], bool]) -> tuple[tuple[bool, ...], int]:
    """(per layer, whether config.json's layer_types make it slide, `default(i)` without them; the window, checked
    where a layer slides).

    Raises:
        FieldError: layer types other than sliding_attention / full_attention or fewer than the layers; a window
            that is no integer >= 1.
    """
    n, kinds, window = hf["num_hidden_layers"], hf.get("layer_types"), hf.get("sliding_window")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) < n or any(
            k not in ("sliding_attention", "full_attention") for k in kinds)):
        raise FieldError("layer_types", f"{kinds!r} must name sliding_attention or full_attention for each of the "
                         f"{n} layers")
    if kinds is None:
        sliding = tuple(default(i) for i in range(n))
    else:
        sliding = tuple(k == "sliding_attention" for k in kinds[:n])
    if any(sliding) and not (_type_ok("int", window) and window >= 1):
        raise FieldError("sliding_window", f"{window!r} must be an integer >= 1 (the keys a query sees)")
    return sliding, window or 0


def olmo3_slides(i: int) -> bool:
    """OLMo 3's layers without layer_types: every fourth is full."""
    return (i + 1) % 4 != 0


def olmo3_form(hf: dict) -> tuple[dict, dict, tuple[bool, ...]]:
    """An OLMo 3 config.json (its defaults filled in) as (OLMo 2's form of it: the full-attention layers' rope, no
    layer types or window; the sliding-window layers' rope; per layer, whether it slides). transformers 5's form
    gives each kind's rope (rope_parameters per layer kind); in the released one rope_theta and rope_scaling are the
    full layers' and the sliding layers rotate by default at 500000, as transformers reads it (the released
    checkpoints' rope_theta is 500000 too)."""
    sliding, _ = sliding_layers(hf, olmo3_slides)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    else:
        full = {**(hf.get("rope_scaling") or params or {"rope_type": "default"})}
        full.setdefault("rope_theta", hf.get("rope_theta", 5e5))
        local = {"rope_type": "default"}
    full.setdefault("rope_theta", 5e5)
    local.setdefault("rope_theta", 5e5)
    olmo2 = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta", "layer_types", "sliding_window")}
    return {**olmo2, "rope_parameters": full, "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]}, local, \
        sliding


def exaone4_form(hf: dict) -> tuple[dict, dict, tuple[bool, ...]]:
    """An EXAONE 4 config.json (its defaults filled in) as (OLMo 2's form of it, no layer types or window; {}: the
    sliding layers rotate as the others, no table of their own; per layer, whether it slides). Without layer_types, every
    `sliding_window_pattern`-th layer is full (none slides without a window), as transformers derives them; with a
    window the full layers rotate nothing (`exaone4_rope_layers`).

    Raises:
        FieldError: a sliding_window_pattern that is no integer >= 1 where layer_types are absent.
    """
    every = hf.get("sliding_window_pattern", 4)
    if hf.get("layer_types") is None and hf.get("sliding_window") is not None and not (
            _type_ok("int", every) and every >= 1):
        raise FieldError("sliding_window_pattern", f"{every!r}: give layer_types, or an integer >= 1 (every such "
                         "layer full)")
    if hf.get("sliding_window") is None and hf.get("layer_types") is None:
        sliding = (False,) * hf["num_hidden_layers"]
    else:
        sliding, _ = sliding_layers(hf, lambda i: (i + 1) % every != 0)
    params = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {"rope_type": "default"})}
    rope = {"rope_theta": hf.get("rope_theta", 10000.0), **params}
    olmo2 = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_theta", "layer_types", "sliding_window",
                                                      "sliding_window_pattern")}
    return {**olmo2, "rope_parameters": rope, "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]}, {}, \
        sliding


def exaone4_rope_layers(hf: dict, sliding: tuple[bool, ...]) -> tuple[bool, ...]:
    """Whether each EXAONE 4 layer rotates q and k: every layer without a window, else the sliding ones only."""
    return (True,) * len(sliding) if hf.get("sliding_window") is None else sliding


FORMS: dict[str, Callable[[dict], tuple[dict, dict, tuple[bool, ...]]]] = {
    "gemma2": gemma_form, "gemma3_text": gemma_form, "olmo3": olmo3_form, "exaone4": exaone4_form}


def check(hf: dict, arch: str) -> None:
    """`hf_config.check` of a config.json (`FieldError` for its first bad field); one with a kind per layer
    (`FORMS`) has its own fields checked (the sliding layers' rope among them) and the rest in its Llama form."""
    hf, local = with_defaults(hf), {}
    form = FORMS.get(family(hf))
    if form is not None:
        hf, local, _ = form(hf)
    if local:  # the sliding layers' own rope table
        if not _type_ok("float", local["rope_theta"]) or not local["rope_theta"] > 0:
            raise FieldError("rope_local_base_freq", f"{local['rope_theta']!r} must be a finite number > 0")
        if local.get("rope_type", "default") != "default":
            raise FieldError("rope_parameters.sliding_attention.rope_type", f"{local['rope_type']!r}: pieceworks "
                             "runs the default rope in the sliding-window layers")
    hf_config.check(hf, arch)
