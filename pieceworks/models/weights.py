"""Weight sources for the models' `load` methods: a Hugging Face checkpoint, or random weights.

Both implement `pieceworks.models.base.WeightSource`: models ask for tensors by their Hugging Face
names and hand over the modules to fill; the source checks names, shapes and formats, casts to the
model dtype and moves to the target device one tensor at a time.

A checkpoint's values are checked as they stream in, on the target device: float weights must be finite
in the model dtype and below `MAX_ABS` (a larger weight overflows the first sum it enters), NVFP4 block
scales finite and non-negative (ModelOpt's are amax / 6, never negative). A bad tensor is a
`CheckpointError` naming it, so a broken export fails at load instead of generating from NaN logits.

Tensor parallel: a module's `tp_part` (`parallel.layout.Part`) names the slice of each checkpoint
tensor the rank holds. The checkpoint source reads only that slice from the file
(`CheckpointReader.get_part`) and checks the values it read; the random source draws the whole tensor
(one at a time, in the same order as a single process, so every rank's slices are exactly the
single-process weights) and keeps the slice; NVFP4 weights are quantized whole and sliced, so
per-tensor scales are the whole tensor's.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pieceworks.backends.fp4_gemm.base import Fp4Weight
from pieceworks.errors import CheckpointError
from pieceworks.models.base import MergedProj, SplitProj
from pieceworks.models.checkpoint import CheckpointReader
from pieceworks.models.moe import Experts
from pieceworks.parallel.layout import Part
from pieceworks.quant import nvfp4
from pieceworks.quant.linear import Fp4Linear
from pieceworks.quant.modelopt import fuse_fp4, read_fp4_experts, read_fp4_linear

log = logging.getLogger("pieceworks.loader")

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
MAX_ABS = nvfp4.MAX_ABS


def check_values(name: str, t: torch.Tensor, where: object) -> torch.Tensor:
    """`t` (a float weight in the model dtype) if every value is finite and |value| <= MAX_ABS.

    One reduction without a temporary of t's size (the max |value|, NaN if any is NaN) and one sync per
    tensor; the details of a bad tensor are computed only when it is bad.
    """
    if t.numel() == 0 or float(torch.linalg.vector_norm(t, float("inf"))) <= MAX_ABS:
        return t
    bad = ~torch.isfinite(t) | (t.abs() > MAX_ABS)
    if bool(bad.any()):
        vals = t[bad]
        n_nan, n_inf = int(vals.isnan().sum()), int(vals.isinf().sum())
        what = ", ".join(f"{n} {k}" for n, k in ((n_nan, "NaN"), (n_inf, "inf")) if n)
        big = len(vals) - n_nan - n_inf
        if big:
            what = ", ".join(filter(None, [what, f"{big} beyond +-{MAX_ABS:.1e} (max |value| "
                                                 f"{float(vals[vals.isfinite()].abs().max()):.3g})"]))
        dtype_name = str(t.dtype).removeprefix("torch.")
        raise CheckpointError(f"{name}: {what} of {t.numel()} values in {dtype_name} (in the checkpoint at {where}, "
                              "or out of range after casting to the model dtype); the checkpoint is broken: "
                              "re-export or re-download it")
    return t


def check_scales(name: str, scale: torch.Tensor) -> None:
    """NVFP4 block scales (float8_e4m3fn, any shape) must be finite and >= 0."""
    s = scale.float()
    bad = ~torch.isfinite(s) | (s < 0)
    if bool(bad.any()):
        first = s[bad][0].item()
        raise CheckpointError(f"{name}: {int(bad.sum())} of {s.numel()} NVFP4 block scales are negative or "
                              f"NaN (e.g. {first}); block scales are amax / 6 >= 0: the export is broken, "
                              "re-export it")


def _take(t: torch.Tensor, part: Part | None) -> torch.Tensor:
    return t if part is None else part.take(t).contiguous()


def _fp4_part(w: Fp4Weight, part: Part | None) -> Fp4Weight:
    """A slice of a whole NVFP4 weight: codes and block scales along the part's dimension (both hold
    whole 16-element blocks of K there), the per-tensor scales as they are."""
    if part is None:
        return w
    return Fp4Weight(_take(w.weight, part), _take(w.weight_scale, part), w.weight_scale_2, w.input_scale)


class _PartReader:
    """A checkpoint reader whose tensors named by `part_of` appear as this rank's slices (shape, get)."""

    def __init__(self, reader: CheckpointReader, part_of) -> None:
        self.reader, self.part_of = reader, part_of

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.reader.dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        full, part = tuple(self.reader.shape(name)), self.part_of(name)
        if part is None or part.dim >= len(full) or full[part.dim] % part.count:
            return full  # the caller's shape check reports it
        shape = list(full)
        shape[part.dim] //= part.count
        return tuple(shape)

    def get(self, name: str) -> torch.Tensor:
        part = self.part_of(name)
        if part is None:
            return self.reader.get(name)
        return self.reader.get_part(name, part.dim, *part.bounds(self.reader.shape(name)[part.dim]))


def _expert_part(part: Part | None):
    """Which slice of each expert tensor a rank holds: gate/up rows and down columns of `part`."""
    if part is None:
        return lambda name: None
    cols = Part(1, part.index, part.count)

    def part_of(name: str) -> Part | None:
        if name.endswith((".weight", ".weight_scale")):
            return cols if ".down_proj." in name else part
        return None

    return part_of


class CheckpointSource:
    """Tensors from a safetensors checkpoint (bf16/fp16/fp32, or ModelOpt NVFP4 linears)."""

    def __init__(self, reader: CheckpointReader, device: torch.device, dtype: torch.dtype) -> None:
        self.reader, self.device, self.dtype = reader, device, dtype
        self.dequantized: list[str] = []  # NVFP4 modules the model holds as plain weights (kv_b_proj aside)

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
               part: Part | None = None) -> torch.Tensor:
        r = self.reader
        if not r.has(name):
            raise CheckpointError(f"{name}: missing from the checkpoint at {r.model_dir}; the checkpoint does not "
                             "match its config.json (re-export or re-download it)")
        want = part.full_shape(tuple(shape)) if part else tuple(shape)
        got_shape, got_dtype = tuple(r.shape(name)), r.dtype(name)
        if got_shape != want:
            raise CheckpointError(f"{name}: shape mismatch: expected {list(want)} from config.json, got "
                             f"{list(got_shape)} in the checkpoint at {r.model_dir}")
        if got_dtype not in _FLOAT:
            raise CheckpointError(f"{name}: stored as {got_dtype}; expected bf16, fp16 or fp32 (an NVFP4 weight "
                             "where the model expects an unquantized one?)")
        t = r.get(name) if part is None else r.get_part(name, part.dim, *part.bounds(want[part.dim]))
        return check_values(name, t.to(device=self.device, dtype=dtype or self.dtype), r.model_dir)

    def _is_fp4(self, prefix: str) -> bool:
        return self.reader.has(f"{prefix}.weight_scale")

    def _fp4(self, prefix: str, in_features: int, out_features: int, part: Part | None = None) -> Fp4Weight:
        reader = self.reader
        if part is not None:
            sliced = {f"{prefix}.weight", f"{prefix}.weight_scale"}
            reader = _PartReader(reader, lambda name: part if name in sliced else None)
        w = Fp4Weight(*(t.to(self.device) for t in read_fp4_linear(reader, prefix, in_features, out_features)))
        check_scales(f"{prefix}.weight_scale", w.weight_scale)
        return w

    def dense(self, prefix: str, in_features: int, out_features: int,
              dtype: torch.dtype | None = None, part: Part | None = None) -> torch.Tensor:
        if self._is_fp4(prefix):  # e.g. kv_b_proj, which MLA absorption needs as plain weights
            if not prefix.endswith(".kv_b_proj"):
                self.dequantized.append(prefix)
            w = self._fp4(prefix, in_features, out_features, part)
            deq = nvfp4.dequantize(w.weight, w.weight_scale, w.weight_scale_2, dtype=dtype or self.dtype)
            return check_values(f"{prefix}.weight", deq, self.reader.model_dir)
        return self.tensor(f"{prefix}.weight", (out_features, in_features), dtype, part)

    def linear(self, module: nn.Module, prefix: str) -> nn.Module:
        part = getattr(module, "tp_part", None)
        if isinstance(module, Fp4Linear):
            module.load(self._fp4(prefix, module.in_features, module.out_features, part))
        else:
            module.weight.copy_(self.dense(prefix, module.in_features, module.out_features, part=part))
        return module

    def merged(self, module: nn.Module, prefixes: list[str]) -> nn.Module:
        if isinstance(module, SplitProj):
            for part, prefix in zip(module.parts, prefixes):
                self.linear(part, prefix)
            return module
        assert isinstance(module, MergedProj) and len(prefixes) == len(module.sizes)
        proj, k = module.proj, module.proj.in_features
        if not isinstance(proj, Fp4Linear):
            offset = 0
            for prefix, n, part in zip(prefixes, module.sizes, module.tp_parts):
                proj.weight[offset:offset + n].copy_(self.dense(prefix, k, n, part=part))
                offset += n
            return module
        parts = [self._fp4(p, k, n, part) for p, n, part in zip(prefixes, module.sizes, module.tp_parts)]
        fused = fuse_fp4(parts)
        if fused is not None:
            proj.load(fused)
            return module
        log.info("%s: NVFP4 global scales differ, kept as %d linears (exact, unfused)", ", ".join(prefixes), len(parts))
        split = SplitProj([Fp4Linear(k, n, device=self.device) for n in module.sizes])
        for layer, w, part in zip(split.parts, parts, module.tp_parts):
            layer.load(w)
            layer.tp_part = part
        return split

    def experts(self, module: Experts, prefix: str) -> None:
        e, h, i, first = module.num_experts, module.hidden, module.intermediate, module.first_expert
        part = module.inter_part
        if module.fp4:
            reader = self.reader if part is None else _PartReader(self.reader, _expert_part(part))
            w = read_fp4_experts(reader, f"{prefix}.{{e}}", e, h, i, first=first)
            for field, proj in (("w13_scale", "gate_proj or up_proj"), ("w2_scale", "down_proj")):
                stacked = getattr(w, field).float()
                if not bool((torch.isfinite(stacked) & (stacked >= 0)).all()):  # one check; then find the expert
                    for j in range(e):
                        check_scales(f"{prefix}.{first + j}.{proj}.weight_scale", stacked[j])
            module.load(w, prefix)
            return
        cols = None if part is None else Part(1, part.index, part.count)
        for j in range(e):
            p = f"{prefix}.{first + j}"
            module.w13[j, :i].copy_(self.dense(f"{p}.gate_proj", h, i, part=part))
            module.w13[j, i:].copy_(self.dense(f"{p}.up_proj", h, i, part=part))
            module.w2[j].copy_(self.dense(f"{p}.down_proj", i, h, part=cols))


class RandomSource:
    """Random weights of the right shapes (benchmarks, tests): N(0, std) linears and embeddings, unit
    norms, zero correction bias. NVFP4 modules get random float weights quantized on the device as
    ModelOpt would, one linear (or one expert) at a time, so peak memory stays near the model size.

    input_scale, which a real export calibrates on activations, is set for an activation amax of
    `INPUT_AMAX` (activations after RMSNorm are O(1)); it only matters under w4a4 numerics.
    """

    INPUT_AMAX = 8.0

    def __init__(self, device: torch.device, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> None:
        self.device, self.dtype, self.std = device, dtype, std
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.input_scale = torch.tensor(self.INPUT_AMAX / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX), device=device)

    def has(self, name: str) -> bool:
        return True

    def _randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # Drawn in the target dtype: no float32 staging copy of a 128k-row embedding.
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype).mul_(self.std)

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
               part: Part | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=dtype)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, device=self.device, dtype=dtype)
        full = part.full_shape(tuple(shape)) if part else tuple(shape)
        return _take(self._randn(*full, dtype=dtype), part)

    def dense(self, prefix: str, in_features: int, out_features: int,
              dtype: torch.dtype | None = None, part: Part | None = None) -> torch.Tensor:
        full = part.full_shape((out_features, in_features)) if part else (out_features, in_features)
        return _take(self._randn(*full, dtype=dtype or self.dtype), part)

    def _quantized(self, w: torch.Tensor) -> Fp4Weight:
        packed, scale, scale_2 = nvfp4.quantize_weight(w)
        return Fp4Weight(packed, scale, scale_2.float(), self.input_scale.clone())

    def linear(self, module: nn.Module, prefix: str) -> nn.Module:
        fp4, part = isinstance(module, Fp4Linear), getattr(module, "tp_part", None)
        shape = (module.out_features, module.in_features)
        w = self._randn(*(part.full_shape(shape) if part else shape), dtype=torch.float32 if fp4 else self.dtype)
        if fp4:
            module.load(_fp4_part(self._quantized(w), part))
        else:
            module.weight.copy_(_take(w, part))
        return module

    def merged(self, module: nn.Module, prefixes: list[str]) -> nn.Module:
        if isinstance(module, SplitProj):
            for part, prefix in zip(module.parts, prefixes):
                self.linear(part, prefix)
        elif all(p is None for p in module.tp_parts):
            self.linear(module.proj, prefixes[0])
        else:  # the whole merged weight, as one process draws it; this rank's rows of every projection
            fp4, k = isinstance(module.proj, Fp4Linear), module.proj.in_features
            full = [p.full_shape((n,))[0] if p else n for n, p in zip(module.sizes, module.tp_parts)]
            w = self._randn(sum(full), k, dtype=torch.float32 if fp4 else self.dtype)

            def rows(t: torch.Tensor) -> torch.Tensor:
                return torch.cat([_take(b, p) for b, p in zip(t.split(full), module.tp_parts)])

            if fp4:
                q = self._quantized(w)
                module.proj.load(Fp4Weight(rows(q.weight), rows(q.weight_scale), q.weight_scale_2, q.input_scale))
            else:
                module.proj.weight.copy_(rows(w))
        return module

    def experts(self, module: Experts, prefix: str) -> None:
        e, h, i = module.total_experts, module.hidden, module.total_intermediate
        first, part = module.first_expert, module.inter_part
        cols = None if part is None else Part(1, part.index, part.count)

        def w13_rows(t: torch.Tensor) -> torch.Tensor:  # this rank's gate rows, then its up rows
            return t if part is None else torch.cat([_take(t[:i], part), _take(t[i:], part)])

        for g in range(e):  # every expert is drawn (the single-process order); the rank keeps its own
            dt = torch.float32 if module.fp4 else self.dtype
            w13, w2 = self._randn(2 * i, h, dtype=dt), self._randn(h, i, dtype=dt)
            j = g - first
            if not 0 <= j < module.num_experts:
                continue
            if not module.fp4:
                module.w13[j].copy_(w13_rows(w13))
                module.w2[j].copy_(_take(w2, cols))
                continue
            q13, q2 = self._quantized(w13), self._quantized(w2)
            q13 = Fp4Weight(w13_rows(q13.weight), w13_rows(q13.weight_scale), q13.weight_scale_2, q13.input_scale)
            q2 = _fp4_part(q2, cols)
            module.w13[j], module.w13_scale[j] = q13.weight, q13.weight_scale
            module.w13_scale_2[j] = q13.weight_scale_2  # gate and up share one global scale here
            module.w13_input_scale[j] = q13.input_scale
            module.w2[j], module.w2_scale[j] = q2.weight, q2.weight_scale
            module.w2_scale_2[j], module.w2_input_scale[j] = q2.weight_scale_2, q2.input_scale
