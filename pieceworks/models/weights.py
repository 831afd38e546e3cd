"""Weight sources for the models' `load` methods: a Hugging Face checkpoint, or random weights.

Both implement `pieceworks.models.base.WeightSource`: models ask for tensors by their Hugging Face
names and hand over the modules to fill; the source checks names, shapes and formats, casts to the
model dtype and moves to the target device one tensor at a time.

A checkpoint's values are checked as they stream in, on the target device: float weights must be finite
in the model dtype and below `MAX_ABS` (a larger weight overflows the first sum it enters), NVFP4 block
scales finite and non-negative (ModelOpt's are amax / 6, never negative). A bad tensor is a
`CheckpointError` naming it, so a broken export fails at load instead of generating from NaN logits.
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
from pieceworks.quant import nvfp4
from pieceworks.quant.linear import Fp4Linear
from pieceworks.quant.modelopt import fuse_fp4, read_fp4_experts, read_fp4_linear

log = logging.getLogger("pieceworks.loader")

_FLOAT = (torch.bfloat16, torch.float16, torch.float32)
# float32/bfloat16's max / 2^20: a dot product of 2^20 unit activations with such weights stays finite;
# trained weights sit many orders of magnitude below it.
MAX_ABS = torch.finfo(torch.float32).max / 2**20


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


class CheckpointSource:
    """Tensors from a safetensors checkpoint (bf16/fp16/fp32, or ModelOpt NVFP4 linears)."""

    def __init__(self, reader: CheckpointReader, device: torch.device, dtype: torch.dtype) -> None:
        self.reader, self.device, self.dtype = reader, device, dtype

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        r = self.reader
        if not r.has(name):
            raise CheckpointError(f"{name}: missing from the checkpoint at {r.model_dir}; the checkpoint does not "
                             "match its config.json (re-export or re-download it)")
        got_shape, got_dtype = tuple(r.shape(name)), r.dtype(name)
        if got_shape != tuple(shape):
            raise CheckpointError(f"{name}: shape mismatch: expected {list(shape)} from config.json, got "
                             f"{list(got_shape)} in the checkpoint at {r.model_dir}")
        if got_dtype not in _FLOAT:
            raise CheckpointError(f"{name}: stored as {got_dtype}; expected bf16, fp16 or fp32 (an NVFP4 weight "
                             "where the model expects an unquantized one?)")
        return check_values(name, r.get(name).to(device=self.device, dtype=dtype or self.dtype), r.model_dir)

    def _is_fp4(self, prefix: str) -> bool:
        return self.reader.has(f"{prefix}.weight_scale")

    def _fp4(self, prefix: str, in_features: int, out_features: int) -> Fp4Weight:
        w = Fp4Weight(*(t.to(self.device) for t in read_fp4_linear(self.reader, prefix, in_features, out_features)))
        check_scales(f"{prefix}.weight_scale", w.weight_scale)
        return w

    def dense(self, prefix: str, in_features: int, out_features: int,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._is_fp4(prefix):  # e.g. kv_b_proj, which MLA absorption needs as plain weights
            w = self._fp4(prefix, in_features, out_features)
            deq = nvfp4.dequantize(w.weight, w.weight_scale, w.weight_scale_2, dtype=dtype or self.dtype)
            return check_values(f"{prefix}.weight", deq, self.reader.model_dir)
        return self.tensor(f"{prefix}.weight", (out_features, in_features), dtype)

    def linear(self, module: nn.Module, prefix: str) -> nn.Module:
        if isinstance(module, Fp4Linear):
            module.load(self._fp4(prefix, module.in_features, module.out_features))
        else:
            module.weight.copy_(self.dense(prefix, module.in_features, module.out_features))
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
            for prefix, n in zip(prefixes, module.sizes):
                proj.weight[offset:offset + n].copy_(self.dense(prefix, k, n))
                offset += n
            return module
        parts = [self._fp4(p, k, n) for p, n in zip(prefixes, module.sizes)]
        fused = fuse_fp4(parts)
        if fused is not None:
            proj.load(fused)
            return module
        log.info("%s: NVFP4 global scales differ, kept as %d linears (exact, unfused)", ", ".join(prefixes), len(parts))
        split = SplitProj([Fp4Linear(k, n, device=self.device) for n in module.sizes])
        for layer, w in zip(split.parts, parts):
            layer.load(w)
        return split

    def experts(self, module: Experts, prefix: str) -> None:
        e, h, i = module.num_experts, module.hidden, module.intermediate
        if module.fp4:
            w = read_fp4_experts(self.reader, f"{prefix}.{{e}}", e, h, i)
            for field, proj in (("w13_scale", "gate_proj or up_proj"), ("w2_scale", "down_proj")):
                stacked = getattr(w, field).float()
                if not bool((torch.isfinite(stacked) & (stacked >= 0)).all()):  # one check; then find the expert
                    for j in range(e):
                        check_scales(f"{prefix}.{j}.{proj}.weight_scale", stacked[j])
            module.load(w, prefix)
            return
        for j in range(e):
            p = f"{prefix}.{j}"
            module.w13[j, :i].copy_(self.dense(f"{p}.gate_proj", h, i))
            module.w13[j, i:].copy_(self.dense(f"{p}.up_proj", h, i))
            module.w2[j].copy_(self.dense(f"{p}.down_proj", i, h))


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

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if name.endswith("norm.weight"):
            return torch.ones(shape, device=self.device, dtype=dtype)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shape, device=self.device, dtype=dtype)
        return self._randn(*shape, dtype=dtype)

    def dense(self, prefix: str, in_features: int, out_features: int,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._randn(out_features, in_features, dtype=dtype or self.dtype)

    def _quantized(self, w: torch.Tensor) -> Fp4Weight:
        packed, scale, scale_2 = nvfp4.quantize_weight(w)
        return Fp4Weight(packed, scale, scale_2.float(), self.input_scale.clone())

    def linear(self, module: nn.Module, prefix: str) -> nn.Module:
        fp4 = isinstance(module, Fp4Linear)
        w = self._randn(module.out_features, module.in_features, dtype=torch.float32 if fp4 else self.dtype)
        if fp4:
            module.load(self._quantized(w))
        else:
            module.weight.copy_(w)
        return module

    def merged(self, module: nn.Module, prefixes: list[str]) -> nn.Module:
        if isinstance(module, SplitProj):
            for part, prefix in zip(module.parts, prefixes):
                self.linear(part, prefix)
        else:
            self.linear(module.proj, prefixes[0])
        return module

    def experts(self, module: Experts, prefix: str) -> None:
        e, h, i = module.num_experts, module.hidden, module.intermediate
        for j in range(e):
            dt = torch.float32 if module.fp4 else self.dtype
            w13, w2 = self._randn(2 * i, h, dtype=dt), self._randn(h, i, dtype=dt)
            if not module.fp4:
                module.w13[j].copy_(w13)
                module.w2[j].copy_(w2)
                continue
            q13, q2 = self._quantized(w13), self._quantized(w2)
            module.w13[j], module.w13_scale[j] = q13.weight, q13.weight_scale
            module.w13_scale_2[j] = q13.weight_scale_2  # gate and up share one global scale here
            module.w13_input_scale[j] = q13.input_scale
            module.w2[j], module.w2_scale[j] = q2.weight, q2.weight_scale
            module.w2_scale_2[j], module.w2_input_scale[j] = q2.weight_scale_2, q2.input_scale
