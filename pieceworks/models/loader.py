"""Build a model from a Hugging Face checkpoint or from a preset with random weights.

The model is built on the meta device, then materialized one piece at a time (embeddings, each
layer, the head): `to_empty` on the target device, then filled from the weight source. Peak memory
stays near the model size plus one layer's worth of staging. Any error propagates and the partly
built model is dropped: nothing half-loaded is returned.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import re
import stat
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pieceworks.backends.base import ModelFacts
from pieceworks.errors import CheckpointError, ConfigError
from pieceworks.models import config_forms, hf_config as hf_fields
from pieceworks.models.base import CausalLM
from pieceworks.models.architectures import ARCHS, architecture, checkpoint_names, random_class
from pieceworks.models.families import OTHER_PARTS, text_model, with_defaults
from pieceworks.models.sizing import check_fits, size_rope_tables
from pieceworks.parallel.layout import TPLayout
from pieceworks.util import checked_stat, unreadable

log = logging.getLogger("pieceworks.loader")


def load_model(model_cfg: Any, quant_cfg: Any, device: torch.device | str, dtype: torch.dtype,
               progress: bool = True, seed: int = 0, tp: TPLayout = TPLayout()) -> CausalLM:
    """Build the model `model_cfg` describes.

    Args:
        model_cfg: `pieceworks.config.ModelConfig`: `path` (a Hugging Face-format directory) or `arch`
            + `preset` + `sizes` (random weights); `allow_extra_tensors` to load a checkpoint that holds
            tensors the model does not use.
        quant_cfg: `pieceworks.config.QuantizationConfig`: `format` auto (follow the checkpoint), none,
            or nvfp4 (a checkpoint must be NVFP4; random models get random NVFP4 weights).
        device: target device; dtype: bfloat16, float16 or float32 (checkpoint floats are cast to it).
        progress: show a progress bar while loading. seed: for random weights.
        tp: the rank's shard: its slices are all that is read (or kept, for random weights).

    Raises:
        CheckpointError: no or unreadable config.json; a missing, mistyped or inconsistent field in it;
            an unsupported architecture; a missing, misshapen, non-finite or unexpected tensor; a
            quantization format the checkpoint doesn't have. The message names the file, field or tensor.
        ConfigError: `model.sizes` names an unknown key or a value that makes no model.
    """
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"model dtype {dtype}: use bfloat16, float16 or float32")
    cls, hf, fp4, reader, quant = _describe(model_cfg, quant_cfg)
    allow_extra = bool(getattr(model_cfg, "allow_extra_tensors", False))
    if model_cfg.path is not None:
        from pieceworks.models.checkpoint import CheckpointReader, RenamingReader
        from pieceworks.models.weights import CheckpointSource

        reader = reader or CheckpointReader(Path(model_cfg.path))
        _check_tied_head(reader, hf, allow_extra)
        _check_layer_count(reader, hf)
        named = checkpoint_names(cls, hf, reader)
        source: Any = CheckpointSource(reader if named is None else RenamingReader(reader, named), device, dtype)
    else:
        from pieceworks.models.weights import RandomSource

        source, named = RandomSource(device, dtype, seed=seed), None
    model = build(cls, hf, dtype, fp4, tp)
    size_rope_tables(model, model_cfg)
    check_fits(model, device, dtype, model_cfg.path is None)
    try:
        materialize(model, source, device, progress)
    except CheckpointError as e:  # name the tensors as the checkpoint does (Mixtral's, Phi-3's), not as the model
        if named is None:
            raise
        raise CheckpointError(re.sub(r"model\.layers\.\d+\.[\w.*]+", lambda m: named(m[0]), str(e))) from None
    dequantized = [named(p) if named else p for p in getattr(source, "dequantized", [])]
    if dequantized:  # e.g. modules exclude_modules lists that the export quantized all the same
        log.warning("%d module(s) stored in NVFP4 are loaded dequantized, at 4x their NVFP4 size, where the model "
                    "holds plain weights (the quantization config excludes them): %s%s", len(dequantized),
                    ", ".join(dequantized[:3]), ", ..." if len(dequantized) > 3 else "")
    if quant is not None and quant.kv_cache_quant_algo == "FP8":
        from pieceworks.quant.modelopt import kv_cache_scales

        model.kv_cache_quant = "fp8"
        model.kv_scales = kv_cache_scales(reader, len(model.layers), named, quant)
    if reader is not None and not allow_extra:
        check_unused(reader, model)
    return model


QUANT_SCALES = (".weight_scale", ".weight_scale_2", ".input_scale")
"""Name endings of the scales ModelOpt writes next to each quantized linear's weight."""


def _check_quantization_config(path: Path) -> Any:
    """Refuse a checkpoint without a quantization config whose tensors are quantized (ModelOpt's scales,
    or NVFP4's packed uint8 weights): read as dense, every NVFP4 linear would load dequantized (as the
    dense loader does for the layers a config excludes), silently a bf16 model of the same numbers at four
    times the memory, or fail as a shape mismatch where scales are missing. A directory without weight
    files passes (config.json alone describes a model for `model_facts`; loading it fails by name).
    Returns the CheckpointReader it opened (None without weight files)."""
    from pieceworks.models.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointReader

    if checked_stat(path / SINGLE_FILE) is None and checked_stat(path / INDEX_FILE) is None:
        return None
    reader = CheckpointReader(path)
    names = reader.names()
    found = next((n for suffix in QUANT_SCALES for n in names if n.endswith(suffix)), None)
    if found is None:
        found = next((n for n in names if n.endswith(".weight") and reader.dtype(n) == torch.uint8), None)
    if found is None:
        return reader
    weight = found if found.endswith(".weight") else found.rsplit(".", 1)[0] + ".weight"
    kind = "NVFP4" if reader.has(weight) and reader.dtype(weight) == torch.uint8 else "quantized"
    raise CheckpointError(
        f"{path}: holds {kind} tensors ({found}, ...) but no quantization config: looked for "
        f"{path / 'hf_quant_config.json'} and a quantization_config in {path / 'config.json'}; restore the one "
        "ModelOpt exported with these weights")


def model_facts(model_cfg: Any, quant_cfg: Any, page_size: int,
                dtype: torch.dtype = torch.bfloat16, tp: TPLayout = TPLayout()) -> tuple[ModelFacts, set[str]]:
    """(ModelFacts, required ops) of the configured model (of one rank's shard with `tp`) without
    loading weights (built on the meta device from config.json or the preset). `model_cfg.path` must
    be a directory.

    Raises:
        ConfigError: `tp` can't split the model (also how a launch checks the parallel layout before it
            allocates anything or starts a process).
    """
    cls, hf, fp4, _, _ = _describe(model_cfg, quant_cfg)
    model = build(cls, hf, dtype, fp4, tp)
    return model.facts(page_size), model.required_ops()


def checked_config(path: Path) -> tuple[type[CausalLM], dict]:
    """The model class and config.json dict of the checkpoint directory `path` (a multimodal checkpoint's text
    model), its architecture supported and its fields checked (`config_forms.check`).

    Raises:
        CheckpointError: naming config.json and the field.
    """
    hf = read_config(path)
    hf = text_model(hf) or hf  # Gemma 3 4B-27B: the text model of a multimodal checkpoint
    cls = architecture(hf, path / "config.json")
    try:
        config_forms.check(hf, cls.arch)
    except hf_fields.FieldError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}; fix the file or re-download the model") from None
    return cls, hf


def _describe(model_cfg: Any, quant_cfg: Any) -> tuple[type[CausalLM], dict, Callable[[str], bool], Any, Any]:
    """Model class, config.json dict (checked: `config_forms.check`), which linears are NVFP4, from a
    checkpoint or a preset, the CheckpointReader opened to look for quantized tensors without a
    quantization config (None where none was opened), for the load to reuse, and the checkpoint's
    `Fp4QuantConfig` (None: unquantized, or random weights)."""
    fmt = getattr(quant_cfg, "format", "auto")
    if model_cfg.path is not None:
        from pieceworks.quant.modelopt import detect_quantization

        path = Path(model_cfg.path)
        cls, hf = checked_config(path)
        quant = detect_quantization(path)
        reader = _check_quantization_config(path) if quant is None else None
        if fmt == "none" and quant is not None:
            raise CheckpointError(f"quantization.format=none, but {path} is a ModelOpt NVFP4 checkpoint "
                                  f"({quant.source}); use quantization.format=auto")
        if fmt == "nvfp4" and quant is None:
            raise CheckpointError(f"quantization.format=nvfp4, but {path} is not an NVFP4 checkpoint; quantize "
                                  "it first (`pieceworks quantize`) or use quantization.format=auto")
        if quant is None:
            return cls, hf, lambda name: False, reader, None
        if hf.get("text_of"):  # its names' prefix is read off the checkpoint
            from pieceworks.models.checkpoint import CheckpointReader

            reader = CheckpointReader(path)
        named = checkpoint_names(cls, hf, reader) or (lambda name: name)  # the exclusions name checkpoint modules
        return cls, hf, lambda name: not quant.is_excluded(named(name)), reader, quant
    from pieceworks.models.presets import preset_config

    if model_cfg.arch not in ARCHS:
        raise ConfigError(f"model.arch={model_cfg.arch!r}: unknown; known: {', '.join(ARCHS)}")
    sizes = dict(model_cfg.sizes or {})
    known = hf_fields.known_keys(model_cfg.arch)
    unknown = sorted(set(sizes) - set(known))
    if unknown:
        raise ConfigError(f"model.sizes.{unknown[0]}: unknown key for model.arch={model_cfg.arch}; known: "
                          f"{', '.join(known)}")
    try:
        hf = preset_config(model_cfg.arch, model_cfg.preset, sizes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        config_forms.check(hf, model_cfg.arch)
    except hf_fields.FieldError as e:
        where = f"model.sizes.{e.key}" if e.key.split(".")[0] in sizes else f"model.sizes: {e.key}"
        raise ConfigError(f"{where}: {e.detail} (model.arch={model_cfg.arch}, preset "
                          f"{model_cfg.preset or 'tiny'})") from None
    # Random NVFP4: every projection; the head and the router are never built as NVFP4 (as ModelOpt).
    random_fp4 = fmt == "nvfp4"
    return random_class(model_cfg.arch, hf), hf, lambda name: random_fp4, None, None


def read_config(path: Path) -> dict:
    """config.json of a model directory, with the errors a user can act on (`CheckpointError`)."""
    st = checked_stat(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"model.path={str(path)!r} is not a directory; give a Hugging Face-format model "
                              "directory (config.json + *.safetensors)")
    cfg = path / "config.json"
    st = checked_stat(cfg, where=path)  # permission denied here: the directory can't be searched
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{cfg}: is a directory; a model directory needs config.json as a file")
    if st is None or not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{cfg}: missing; a Hugging Face-format model directory needs its config.json")
    try:
        hf = json.loads(cfg.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{cfg}: not UTF-8 text (byte {e.start}: {e.reason}); fix or re-download it") from None
    except ValueError as e:
        raise CheckpointError(f"{cfg}: not valid JSON ({e})") from None
    except OSError as e:
        raise unreadable(cfg, e) from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg}: expected a JSON object")
    return hf


def _check_tied_head(reader: Any, hf: dict, allow_extra: bool) -> None:
    """A tied model reads no lm_head: a checkpoint that has one contradicts its config.json."""
    if with_defaults(hf).get("tie_word_embeddings") and reader.has("lm_head.weight") and not allow_extra:
        raise CheckpointError(
            f"{reader.model_dir}: config.json has tie_word_embeddings=true (the head reuses the embedding) "
            "but the checkpoint holds its own lm_head.weight; set tie_word_embeddings to false to use it, "
            "or model.allow_extra_tensors=true to ignore it"
        )


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_layer_count(reader: Any, hf: dict) -> None:
    """A checkpoint whose layers stop short of config.json's num_hidden_layers fails here, before the skeleton
    is built (for a config of 200,000 layers that takes minutes, then fails at the first absent layer)."""
    n = hf["num_hidden_layers"]
    other = OTHER_PARTS if hf.get("text_of") else ()
    found = [int(m[1]) for name in reader.names() if not name.startswith(other) and (m := _LAYER.search(name))]
    if found and max(found) + 1 < n:
        raise CheckpointError(
            f"{reader.model_dir}: config.json says num_hidden_layers={n}, but the checkpoint holds layers "
            f"0..{max(found)} ({max(found) + 1} layers); set num_hidden_layers to the checkpoint's count, or use "
            "the complete checkpoint")


def check_unused(reader: Any, model: CausalLM) -> None:
    """Refuse a checkpoint holding tensors the model did not read: a bias the config says is absent,
    layers beyond num_hidden_layers, tensors of another model. Rope tables some exports save
    (`rotary_emb.inv_freq`) and the multi-token-prediction layers pieceworks does not run (DeepSeek-V3's and
    GLM-4.5's after the last layer, ERNIE 4.5's `model.mtp*`; with num_nextn_predict_layers > 0) are expected and
    skipped, and so are other ranks' experts under expert parallel, a multimodal checkpoint's vision model and
    tensors of no elements.

    Raises:
        CheckpointError: naming the unused tensors (the first few, grouped by layer).
    """
    num_layers = len(model.layers)
    mtp = int(model.hf_config.get("num_nextn_predict_layers") or 0)
    other = OTHER_PARTS if model.hf_config.get("text_of") else ()  # a multimodal checkpoint's vision model
    # an expert-parallel rank reads its own routed experts only; the others' are another rank's
    held = {(m.first_expert, m.num_experts) for m in model.modules() if hasattr(m, "first_expert")}
    first, count = next(iter(held)) if held else (0, 0)
    others = model.tp.sharded and model.tp.expert_parallel
    extra = []
    for name in reader.names():
        if name in reader.read or name.endswith("rotary_emb.inv_freq") or name.startswith(other):
            continue
        if 0 in reader.shape(name):  # holds nothing: DeepSeek's shared experts of n_shared_experts 0 in transformers
            continue
        parts = name.split(".")
        if others and len(parts) > 5 and parts[4] == "experts" and parts[5].isdigit() and \
                not first <= int(parts[5]) < first + count:
            continue
        if name.startswith("model.layers.") and parts[2].isdigit() and \
                num_layers <= int(parts[2]) < num_layers + mtp:
            continue
        if mtp and len(parts) > 1 and parts[0] == "model" and parts[1].startswith("mtp"):  # ERNIE 4.5's MTP
            continue
        extra.append(name)
    if not extra:
        return
    layers = sorted({int(n.split(".")[2]) for n in extra if n.startswith("model.layers.") and
                     n.split(".")[2].isdigit() and int(n.split(".")[2]) >= num_layers})
    hint = (f" (layers {layers[0]}..{layers[-1]}: config.json says num_hidden_layers={num_layers})"
            if layers else "")
    raise CheckpointError(
        f"{reader.model_dir}: {len(extra)} tensor(s) the model does not use{hint}: {', '.join(extra[:4])}"
        f"{', ...' if len(extra) > 4 else ''}; the checkpoint does not match its config.json. Fix the config "
        "or re-export; model.allow_extra_tensors=true loads it anyway, ignoring them"
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(cls: type[CausalLM], hf: dict, dtype: torch.dtype, fp4: Callable[[str], bool],
          tp: TPLayout = TPLayout()) -> CausalLM:
    """The model skeleton (of one rank's shard with `tp`) on the meta device; float parameters default to
    `dtype` (modules that must stay float32, the MoE router and rope tables, say so themselves)."""
    with torch.device("meta"), _default_dtype(dtype):
        return cls(hf, dtype, fp4, tp)


def materialize(model: CausalLM, source: Any, device: torch.device, progress: bool) -> None:
    """Allocate and fill the model piece by piece (see `CausalLM.load_plan`)."""
    plan = model.load_plan()
    with torch.no_grad(), _progress_bar(progress, len(plan)) as advance:
        for label, module, fill in plan:
            # Module.to_empty's own step with torch.empty for empty_like: empty_like of a meta tensor
            # imports sympy (about 0.3 s) through torch's Python decompositions
            module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
            for t in _floats(module):
                t.fill_(float("nan"))  # poison: a tensor that `fill` misses shows up below
            fill(source)
            bad = [n for n, t in _floats(module, named=True) if t.isnan().any()]
            if bad:
                raise CheckpointError(f"{label}: {', '.join(bad[:4])} hold NaN after loading (NaN in the checkpoint, "
                                 "or a tensor the model's load_plan does not fill)")
            advance(label)
    missing = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    assert not missing, f"load_plan left tensors unloaded: {missing[:5]}"
    model.requires_grad_(False)
    model.eval()


def _floats(module: torch.nn.Module, named: bool = False):
    items = itertools.chain(module.named_parameters(), module.named_buffers())
    out = [(n, t) for n, t in items if t.dtype in (torch.bfloat16, torch.float16, torch.float32)]
    return out if named else [t for _, t in out]


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int) -> Iterator[Callable[[str], None]]:
    if not enabled:
        yield lambda label: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("loading weights"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("", total=total)
        yield lambda label: bar.update(task, advance=1, description=label)
