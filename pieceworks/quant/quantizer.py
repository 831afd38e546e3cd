"""`pieceworks quantize`: a bf16/fp16/fp32 Hugging Face checkpoint -> a ModelOpt-format NVFP4 one.

The output has ModelOpt 0.47's tensor names, dtypes and layout (see `modelopt.py`), its
`hf_quant_config.json` and config.json `quantization_config`, and bit-identical `weight`,
`weight_scale` and `weight_scale_2` tensors for the same source weights (tested against ModelOpt on
tiny Llama and DeepSeek-V3 models).

Which linears: every 2-D floating `*.weight` whose K is a multiple of 16 and whose module matches no
exclude pattern. `DEFAULT_EXCLUDE` mirrors ModelOpt's NVFP4 config (lm_head, embeddings, MoE routers,
DeepSeek MTP layers beyond num_hidden_layers); the caller's patterns are added to it. Unquantized
2-D weights are listed in exclude_modules (summarized as ModelOpt does; a tied lm_head is listed too,
as ModelOpt lists the module); norms and biases are 1-D and copied as they are.

Linears that read the same input share one `weight_scale_2` (max over the group, as ModelOpt's
export does) and one `input_scale`: q/k/v, gate/up (dense MLPs, shared experts, each routed
expert), and DeepSeek's q_a_proj (or q_proj) with kv_a_proj_with_mqa. ModelOpt finds these by tracing
shared inputs; here they are named, which covers the Llama and DeepSeek-V3 families.

`input_scale = amax / (6 * 448)`, with amax fixed (`amax=`), calibrated by max over a text
(`calib_text=`, runs the bf16 model with transformers), or given per module (`input_amax=`, e.g. from
`calibrate.calibrate_input_amax`); `scales.py` turns them into scales. A linear the calibration never reached gets
amax 6.0, ModelOpt's substitute for an empty calibration, and a warning. `kv_cache="fp8"` adds each attention layer's
`k_proj.k_scale` / `v_proj.v_scale` (the calibrated key / value amax / 448) and says so in both configs.

Streaming: a first pass reads only the weights of fused groups (for their shared amax), the second
reads, quantizes (in row chunks) and writes one tensor at a time, so memory stays near the largest
tensor.
"""

from __future__ import annotations

import errno
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pieceworks.models.checkpoint import CheckpointReader
from pieceworks.models.loader import checked_config
from pieceworks.quant import nvfp4
from pieceworks.quant.modelopt import covered
from pieceworks.quant.export_config import write_configs
from pieceworks.quant.output_dir import Staging, check_dirs, check_space, copied_files
from pieceworks.quant.scales import MIN_AMAX, input_amaxes, kv_layers, kv_scales, usable_amax
from pieceworks.quant.shard_writer import ShardedWriter, TensorSpec

DEFAULT_EXCLUDE = (
    "lm_head",
    "*.lm_head",  # a multimodal checkpoint's (language_model.lm_head)
    "*vision_tower*",  # and its vision model, which pieceworks does not run
    "*multi_modal_projector*",
    "*embed_tokens",
    "*.mlp.gate",
    "*router*",
    "*block_sparse_moe.gate",
    "*shared_expert_gate",
)
FUSED_SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("q_proj", "kv_a_proj_with_mqa"),
)
_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROW_CHUNK_ELEMS = 1 << 24


@dataclass(frozen=True)
class _Linear:
    module: str
    out_features: int
    in_features: int


def _plan(reader: CheckpointReader, patterns: list[str]) -> tuple[dict[str, _Linear], list[str]]:
    """Quantized linears by weight name, and the unquantized 2-D weights' module names."""
    quantized, unquantized = {}, []
    for name in reader.names():
        if not name.endswith(".weight") or len(reader.shape(name)) != 2:
            continue
        module = name[: -len(".weight")]
        n, k = reader.shape(name)
        excluded = covered(module, patterns)
        if excluded or k % nvfp4.BLOCK or reader.dtype(name) not in _SOURCE_DTYPES:
            unquantized.append(module)
        else:
            quantized[name] = _Linear(module, n, k)
    return quantized, unquantized


def _check_patterns(patterns: list[str], modules: list[str], src) -> None:
    """Every --exclude pattern matches a module with a 2-D weight (one that matches none is a typo, and the
    layers it meant would be quantized)."""
    for p in patterns:
        if not any(covered(m, [p]) for m in modules):
            hint = "; name the module, without .weight" if p.endswith(".weight") else ""
            raise ValueError(f"--exclude {p!r} matches no module of {src} (names look like {modules[0]}; a "
                             f"pattern is an fnmatch glob, e.g. model.layers.0.*){hint}")


def _groups(linears: list[_Linear]) -> list[tuple[str, ...]]:
    """Module-name groups that share global scales (siblings of one parent reading one input)."""
    by_parent: dict[str, set[str]] = {}
    for lin in linears:
        parent, _, leaf = lin.module.rpartition(".")
        by_parent.setdefault(parent, set()).add(leaf)
    groups = []
    for parent, leaves in by_parent.items():
        taken: set[str] = set()
        for siblings in FUSED_SIBLINGS:
            members = [s for s in siblings if s in leaves and s not in taken]
            if len(members) >= 2:
                taken.update(members)
                groups.append(tuple(f"{parent}.{m}" if parent else m for m in members))
    return groups


def _mtp_patterns(config: dict, reader: CheckpointReader) -> list[str]:
    """`model.layers.N*` for DeepSeek's and GLM's MTP layers (N >= num_hidden_layers) and `model.mtp*` for ERNIE
    4.5's, which ModelOpt excludes."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int):
        return []
    extra = set()
    for name in reader.names():
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            if int(parts[2]) >= n:
                extra.add(f"model.layers.{parts[2]}*")
        elif len(parts) > 2 and parts[0] == "model" and parts[1].startswith("mtp"):
            extra.add(f"model.{parts[1]}*")
    return sorted(extra)


def check_finite(src: Path, name: str, t: torch.Tensor) -> None:
    """A floating tensor holds no NaN or inf, nor a value beyond +-`nvfp4.MAX_ABS`: the loader holds weights,
    dense or dequantized, to that bound, so the output would be a checkpoint it refuses."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    if t.dtype.itemsize == 1:  # float8: torch has no norm or isfinite for it
        t = t.float()
    if float(torch.linalg.vector_norm(t, float("inf"))) <= nvfp4.MAX_ABS:  # NaN when any value is NaN
        return
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    if nan or inf:
        raise ValueError(f"{src}: {name} holds non-finite values ({nan} NaN, {inf} inf); quantize needs finite "
                         "weights (fix or re-download the checkpoint)")
    big = int((t.abs() > nvfp4.MAX_ABS).sum())
    raise ValueError(f"{src}: {name} holds {big} value(s) beyond +-{nvfp4.MAX_ABS:.1e} (max |value| "
                     f"{float(t.abs().max()):.3g}), which overflow the first sum they enter; quantize needs weights "
                     "within that bound (fix or re-download the checkpoint)")



def _quantize_rows(w: torch.Tensor, ws2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """nvfp4.quantize_weight in row chunks (rows are independent given ws2), to bound memory.

    Returns (weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 float32 []).
    """
    rows = max(1, _ROW_CHUNK_ELEMS // max(1, w.shape[1]))
    packed, scales = [], []
    for i in range(0, w.shape[0], rows):
        p, s, used = nvfp4.quantize_weight(w[i : i + rows], ws2)
        packed.append(p)
        scales.append(s)
    return torch.cat(packed), torch.cat(scales), used  # `used`: ws2, or its stand-in for all-zero w


def _progress(enabled: bool):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )


def quantize_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    calib_text: Path | None = None,
    amax: float | None = None,
    exclude: list[str] | None = None,
    progress: bool = True,
    input_amax: Mapping[str, float] | None = None,
    max_shard_bytes: int = 5 * 2**30,
    kv_cache: str | None = None,
    kv_amax: Mapping[str, tuple[float, float]] | None = None,
) -> Path:
    """Quantize the checkpoint in `src_dir` to NVFP4 and write it to `dst_dir` (ModelOpt format).

    Args:
        src_dir: a Hugging Face checkpoint (safetensors, bf16/fp16/fp32) of a Llama or DeepSeek-V3
            family model.
        dst_dir: a new or empty directory.
        calib_text: a text file; activation amax per linear = max |input| over it (needs
            transformers and the tokenizer files in src_dir).
        amax: a fixed activation amax for every linear instead.
        exclude: fnmatch patterns of modules to keep unquantized, added to DEFAULT_EXCLUDE.
        progress: show a progress bar.
        input_amax: per-module activation amax instead (as `calibrate_input_amax` returns).
        max_shard_bytes: shard size cap.
        kv_cache: "fp8": an FP8 KV cache as ModelOpt's FP8_KV_CFG exports it (`kv_cache_quant_algo: FP8`, each
            attention layer's `k_proj.k_scale` / `v_proj.v_scale` = the calibrated max |key| / 448 and
            max |value| / 448); needs calibration (calib_text, or kv_amax with input_amax). GQA attention only.
        kv_amax: {attention module: (max |key|, max |value|)} instead of calibrating (as `calibrate_input_amax`
            fills it).

    Returns:
        dst_dir as a Path.

    Raises:
        ValueError: not exactly one of calib_text / amax / input_amax; amax not positive; src is
            already quantized or unreadable, or holds a NaN or inf; dst not empty, the source or inside
            it, cannot be created, or on a disk without room for the output; dst created or filled by
            another run while this one wrote; calibration cannot run.
        OSError: the disk filled up while writing.

    The run writes into a hidden staging directory beside dst (`.DSTNAME.quantize-HOST-PID.tmp`) and
    renames it to dst when every file is complete, so dst never holds a partial checkpoint, even after a
    hard kill. A run that fails removes its staging directory and the directories it created; a killed
    run's staging directory is removed by the next run into the same dst on the same host.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if sum(x is not None for x in (calib_text, amax, input_amax)) != 1:
        raise ValueError("give exactly one activation source: --calib-text FILE or --amax X")
    if amax is not None and not usable_amax(amax):
        raise ValueError(f"--amax must be a number from {MIN_AMAX:.1e} (its input_scale, amax / 2688, a normal "
                         f"float32) to 3.4e38, got {amax}")
    if kv_cache not in (None, "fp8"):
        raise ValueError(f"--kv-cache {kv_cache!r}: use fp8 (or leave it out: the KV cache in the model dtype)")
    if kv_cache and calib_text is None and kv_amax is None:
        raise ValueError("--kv-cache fp8 needs calibration: each layer's K/V scale comes from the keys' and values' "
                         "amax over a text, which a fixed --amax does not give; leave out --amax (the bundled text, or "
                         "--calib-text FILE)")
    reader = CheckpointReader(src)
    config = check_dirs(src, dst, reader)
    checked_config(src)  # a model pieceworks can load: refused here, not after the run at its first load
    if kv_cache and config.get("kv_lora_rank"):
        raise ValueError(f"{src}: --kv-cache fp8: this model has MLA attention (kv_lora_rank), whose latent cache "
                         "pieceworks keeps in the model dtype; leave --kv-cache out")
    patterns = list(DEFAULT_EXCLUDE) + _mtp_patterns(config, reader) + list(exclude or [])
    linears, unquantized = _plan(reader, patterns)
    odd = [m for m in unquantized if reader.shape(f"{m}.weight")[1] % nvfp4.BLOCK
           and not covered(m, patterns)]
    if odd:  # NVFP4 scales blocks of 16 along K
        warnings.warn(f"{len(odd)} linear(s) stay in {reader.dtype(odd[0] + '.weight')} because their input size is "
                      f"not a multiple of 16 (e.g. {odd[0]}: K = {reader.shape(odd[0] + '.weight')[1]}); they are "
                      "listed in exclude_modules", stacklevel=2)
    _check_patterns(exclude or [], [lin.module for lin in linears.values()] + unquantized, src)
    if config.get("tie_word_embeddings", True) and not reader.has("lm_head.weight"):
        unquantized.append("lm_head")  # tied to the embeddings: a module without its own tensor
    if not linears:
        raise ValueError(f"{src}: no linear weight to quantize (all excluded, or K not a multiple of 16)")
    groups = _groups(list(linears.values()))
    specs = []
    for name in reader.names():
        lin = linears.get(name)
        if lin is None:
            specs.append(TensorSpec(name, reader.dtype(name), reader.shape(name)))
            continue
        n, k = lin.out_features, lin.in_features
        specs += [
            TensorSpec(name, torch.uint8, (n, k // 2)),
            TensorSpec(f"{lin.module}.weight_scale", torch.float8_e4m3fn, (n, k // nvfp4.BLOCK)),
            TensorSpec(f"{lin.module}.weight_scale_2", torch.float32, ()),
            TensorSpec(f"{lin.module}.input_scale", torch.float32, ()),
        ]
    modules = [lin.module for lin in linears.values()]
    kv_at = kv_layers(modules, unquantized) if kv_cache else []
    specs += [TensorSpec(f"{a}.{p}_proj.{p}_scale", torch.float32, ()) for a in kv_at for p in "kv"]
    copied = copied_files(src)
    staging = Staging(dst)  # written there, renamed to dst when complete
    others = staging.clear_stale()  # killed runs' staging directories: before counting free space
    check_space(dst, sum(spec.nbytes for spec in specs) + sum(f.stat().st_size for f in copied), others)
    if calib_text is not None:
        from pieceworks.quant.calibrate import calibrate_from_text

        kv_amax = {} if kv_cache else None
        input_amax = calibrate_from_text(src, calib_text, check_weight=lambda name, t: check_finite(src, name, t),
                                         kv_amax=kv_amax, progress=progress)
    in_amax = input_amaxes(modules, groups, amax, input_amax)
    kv = kv_scales(kv_at, kv_amax) if kv_cache else {}

    staging.create()
    writer = None
    try:
        writer = ShardedWriter(staging.path, specs, max_shard_bytes)
        with _progress(progress) as bar:
            ws2 = _group_scales(src, reader, groups, bar)
            checked = {f"{m}.weight" for g in groups for m in g}  # by `_group_scales`, as it read them
            task = bar.add_task("quantizing", total=sum(_nbytes(reader, n) for n in reader.names()))
            for name in reader.names():
                t = reader.get(name)
                if name not in checked:
                    check_finite(src, name, t)
                lin = linears.get(name)
                if lin is None:
                    writer.write(name, t)
                else:
                    scale2 = ws2[lin.module] if lin.module in ws2 else nvfp4.weight_global_scale(t)
                    packed, scale, scale2 = _quantize_rows(t, scale2)
                    writer.write(name, packed)
                    writer.write(f"{lin.module}.weight_scale", scale)
                    writer.write(f"{lin.module}.weight_scale_2", scale2)
                    amax_t = torch.tensor(in_amax[lin.module], dtype=torch.float32)
                    writer.write(f"{lin.module}.input_scale", amax_t / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX))
                bar.advance(task, t.numel() * t.element_size())
                del t
            for name, scale in kv.items():
                writer.write(name, scale)
        write_configs(staging.path, config, unquantized, [lin.module for lin in linears.values()], copied,
                       "FP8" if kv_cache else None)
        writer.close()  # renames the weight files from their partial names, once every tensor is written
        staging.publish()  # one rename: dst appears complete, or not at all
    except BaseException as e:
        if writer is not None:
            writer.abort()
        staging.discard()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(f"{dst}: the disk is full ({e.strerror}); the files this run wrote are removed: free some "
                          "space or choose a DST on another disk") from e
        raise
    return dst


def _nbytes(reader: CheckpointReader, name: str) -> int:
    """Bytes of one tensor, from the header."""
    n = reader.dtype(name).itemsize
    for d in reader.shape(name):
        n *= d
    return n


def _group_scales(src: Path, reader: CheckpointReader, groups, bar) -> dict[str, torch.Tensor]:
    """Shared weight_scale_2 per grouped module: max of the members' amax / (6 * 448)."""
    out: dict[str, torch.Tensor] = {}
    names = [m for g in groups for m in g]
    task = bar.add_task("measuring fused groups", total=sum(_nbytes(reader, f"{m}.weight") for m in names))
    for group in groups:
        scales = []
        for m in group:
            w = reader.get(f"{m}.weight")
            check_finite(src, f"{m}.weight", w)
            scales.append(nvfp4.weight_global_scale(w))
            bar.advance(task, w.numel() * w.element_size())
            del w
        shared = torch.stack(scales).amax()
        out.update({m: shared for m in group})
    return out
