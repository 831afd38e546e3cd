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
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from pieceworks.backends.base import ModelFacts
from pieceworks.models.base import CausalLM
from pieceworks.models.deepseek_v3 import DeepseekV3
from pieceworks.models.llama import Llama
from pieceworks.parallel.layout import TPLayout

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": Llama,
    "DeepseekV3ForCausalLM": DeepseekV3,
}
ARCHS: dict[str, type[CausalLM]] = {"llama": Llama, "deepseek_v3": DeepseekV3}

def load_model(model_cfg: Any, quant_cfg: Any, device: torch.device | str, dtype: torch.dtype,
               progress: bool = True, seed: int = 0, tp: TPLayout = TPLayout()) -> CausalLM:
    """Build the model `model_cfg` describes.

    Args:
        model_cfg: `pieceworks.config.ModelConfig`: `path` (a Hugging Face-format directory) or `arch`
            + `preset` + `sizes` (random weights).
        quant_cfg: `pieceworks.config.QuantizationConfig`: `format` auto (follow the checkpoint), none,
            or nvfp4 (a checkpoint must be NVFP4; random models get random NVFP4 weights).
        device: target device; dtype: bfloat16, float16 or float32 (checkpoint floats are cast to it).
        progress: show a progress bar while loading. seed: for random weights.
        tp: the rank's shard: its slices are all that is read (or kept, for random weights).

    Raises:
        ValueError: missing config.json, unsupported architecture, missing tensor, shape mismatch,
            a quantization format the checkpoint doesn't have; the message names what and where.
    """
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"model dtype {dtype}: use bfloat16, float16 or float32")
    cls, hf, fp4 = _describe(model_cfg, quant_cfg)
    if model_cfg.path is not None:
        from pieceworks.models.checkpoint import CheckpointReader
        from pieceworks.models.weights import CheckpointSource

        source: Any = CheckpointSource(CheckpointReader(Path(model_cfg.path)), device, dtype)
    else:
        from pieceworks.models.weights import RandomSource

        source = RandomSource(device, dtype, seed=seed)
    model = build(cls, hf, dtype, fp4, tp)
    materialize(model, source, device, progress)
    return model


def model_facts(model_cfg: Any, quant_cfg: Any, page_size: int,
                dtype: torch.dtype = torch.bfloat16, tp: TPLayout = TPLayout()) -> tuple[ModelFacts, set[str]]:
    """(ModelFacts, required ops) of the configured model (of one rank's shard with `tp`) without
    loading weights (built on the meta device from config.json or the preset). `model_cfg.path` must
    be a directory.

    Raises:
        ConfigError: `tp` can't split the model (also how a launch checks the parallel layout before it
            allocates anything or starts a process).
    """
    cls, hf, fp4 = _describe(model_cfg, quant_cfg)
    model = build(cls, hf, dtype, fp4, tp)
    return model.facts(page_size), model.required_ops()


def _describe(model_cfg: Any, quant_cfg: Any) -> tuple[type[CausalLM], dict, Callable[[str], bool]]:
    """Model class, config.json dict and which linears are NVFP4, from a checkpoint or a preset."""
    fmt = getattr(quant_cfg, "format", "auto")
    if model_cfg.path is not None:
        from pieceworks.quant.modelopt import detect_quantization

        path = Path(model_cfg.path)
        hf = read_config(path)
        cls = architecture(hf, path / "config.json")
        quant = detect_quantization(path)
        if fmt == "none" and quant is not None:
            raise ValueError(f"quantization.format=none, but {path} is a ModelOpt NVFP4 checkpoint "
                             f"({quant.source}); use quantization.format=auto")
        if fmt == "nvfp4" and quant is None:
            raise ValueError(f"quantization.format=nvfp4, but {path} is not an NVFP4 checkpoint; quantize it "
                             "first (`pieceworks quantize`) or use quantization.format=auto")
        if quant is None:
            return cls, hf, lambda name: False
        return cls, hf, lambda name: not quant.is_excluded(name)
    from pieceworks.models.presets import preset_config

    if model_cfg.arch not in ARCHS:
        raise ValueError(f"model.arch={model_cfg.arch!r}: unknown; known: {', '.join(ARCHS)}")
    hf = preset_config(model_cfg.arch, model_cfg.preset, model_cfg.sizes)
    # Random NVFP4: every projection; the head and the router are never built as NVFP4 (as ModelOpt).
    random_fp4 = fmt == "nvfp4"
    return ARCHS[model_cfg.arch], hf, lambda name: random_fp4


def read_config(path: Path) -> dict:
    """config.json of a model directory, with the errors a user can act on."""
    if not path.is_dir():
        raise ValueError(f"model.path={str(path)!r} is not a directory; give a Hugging Face-format model "
                         "directory (config.json + *.safetensors)")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{cfg}: missing; a Hugging Face-format model directory needs its config.json")
    try:
        hf = json.loads(cfg.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{cfg}: expected a JSON object")
    return hf


def architecture(hf: dict, where: Any) -> type[CausalLM]:
    """The model class for a config.json's `architectures` (or `model_type` when that is absent)."""
    archs = hf.get("architectures") or []
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not archs and hf.get("model_type") in ARCHS:
        return ARCHS[hf["model_type"]]
    raise ValueError(f"{where}: architectures={archs!r} (model_type={hf.get('model_type')!r}) is not "
                     f"supported; pieceworks supports {', '.join(ARCHITECTURES)}")


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
            module.to_empty(device=device)
            for t in _floats(module):
                t.fill_(float("nan"))  # poison: a tensor that `fill` misses shows up below
            fill(source)
            bad = [n for n, t in _floats(module, named=True) if t.isnan().any()]
            if bad:
                raise ValueError(f"{label}: {', '.join(bad[:4])} hold NaN after loading (NaN in the checkpoint, "
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
