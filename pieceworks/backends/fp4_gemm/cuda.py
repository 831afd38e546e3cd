"""Weight-only NVFP4 GEMM with a hand-written CUDA decode kernel (w4a16), compiled at run time by NVRTC.

Up to 16 rows of x run the decode kernel (`cuda_decode.decode_gemm`) in one launch: one CTA per 16 weight rows over
all of K, the weights loaded straight into registers in MMA fragment order (a ring of 2 64-element
chunks per lane), decoded with integer ops and bf16 multiplies, bf16 mma.sync with the weights as the A
operand, the warps' sums added in shared memory (r16c64.py describes the layout); 17 up to
`decode_max_m` (64) rows run it once per 16-row slice (the weights read once per slice); more rows
dequantize the weight to a transient bf16 copy and call torch.matmul (the Triton backend runs M = 17..1024
on its wgmma kernel on sm_90 and dequantizes above 1024). SwiGLU and the q/k/v rope are fused into the
decode kernel's epilogue (rounded as the unfused ops round). Faster than the Triton backend's own kernels
up to 16 rows on the H200, slower beyond (docs/benchmarks.md), so it has the lower priority:
`backends.fp4_gemm: cuda` selects it. (The Triton backend runs this kernel too, on its k32 weights, for
M <= 16: at M = 1 and 8 within 0.4 us of it here, at M = 16 1-13% slower on five of the six shapes: docs/benchmarks.md.)

Option `fuse_norm` (off by default; `fuses_norm`) also fuses a Llama block's RMSNorms and residual adds:
the o and down kernels add their output to the residual stream s and write the next norm's inputs
(t = s * norm weight, per-CTA sums of s^2), and the q/k/v and gate/up kernels after them read t as x and
scale by 1 / rms(s) in the epilogue, their main loop unchanged.

The layout ("r16c64") differs from the Triton backend's k32, so one executor uses one of them for
every mode (the registry refuses a mix). This module imports torch only; NVRTC compiles a kernel on
its first launch (0.2-0.4 s each on the H200 machine) or loads it from nvrtc's disk cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from pieceworks.backends import pdl
from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.fp4_gemm.base import Fp4GemmBackend, Fp4Weight, norm_parts, rope_qk_columns
from pieceworks.backends.fp4_gemm.cuda_launch import kernel_reasons, multiprocessors, plan
from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up, interleave_rope_rows


SLICE = 16  # rows of x per decode-kernel launch


@dataclass
class CudaDecodeOptions:
    """decode_max_m: largest M served by the decode kernel (0 = never); above 16 rows it runs once per
    16-row slice of x, reading the weights again each time; above decode_max_m, dequantize + matmul.
    fuse_norm: fuse decoder blocks' RMSNorms and residual adds into the decode kernel (`fuses_norm`).
    Off by default: on the H200 it removes 62 of a Llama-3.1-8B-shaped decode step's 65 norm kernels and
    57 us of kernel time, but the graph replay with PDL was slower with it (1.96-1.98 ms against
    1.85 at batch 1; docs/benchmarks.md)."""

    decode_max_m: int = 64
    fuse_norm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.fuse_norm, bool):
            raise ValueError(f"fuse_norm={self.fuse_norm!r}: use true or false")
        if not 0 <= self.decode_max_m <= 256:
            raise ValueError(f"decode_max_m={self.decode_max_m}: use 0 (never) to 256")


class CudaFp4GemmBackend(Fp4GemmBackend):
    name = "cuda"
    priority = 40
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), min_capability=(9, 0))  # mul.bf16x2, griddepcontrol
    numerics = ("w4a16",)
    weight_layout = "r16c64"
    fuses_qkv_rope = True
    Options = CudaDecodeOptions
    description = "CUDA w4a16 decode GEMM (NVRTC): NVFP4 decoded in registers, bf16 mma.sync"

    @classmethod
    def check(cls, spec):
        return kernel_reasons(super().check(spec), spec.model.fp4, spec.model.dtype)

    @property
    def fuses_norm(self) -> bool:
        return self.options.fuse_norm

    def prepare(self, w: Fp4Weight) -> Fp4Weight:
        from pieceworks.backends.fp4_gemm.r16c64 import repack_decode

        codes, scales = repack_decode(w.weight, w.weight_scale)
        return Fp4Weight(codes, scales, w.weight_scale_2.float().reshape(()), w.input_scale)

    def prepare_gate_up(self, w: Fp4Weight) -> Fp4Weight:
        """`prepare` with gate row j and up row j side by side (`interleave_gate_up`) for `forward_swiglu`."""
        return self._prepare_rows(w, interleave_gate_up(w.weight.shape[0]))

    def qkv_rope_supported(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return head_dim % 2 == 0

    def prepare_qkv_rope(self, w: Fp4Weight, num_heads: int, num_kv_heads: int, head_dim: int) -> Fp4Weight:
        """`prepare` with each q/k head's rope pairs side by side (`interleave_rope_rows`) for
        `forward_qkv_rope`."""
        return self._prepare_rows(w, interleave_rope_rows(num_heads, num_kv_heads, head_dim))

    def forward_qkv_rope(self, x, weight, weight_scale, weight_scale_2, input_scale, cos, sin, num_heads,
                         num_kv_heads, head_dim, prenormed=None):
        """The rope in the decode kernel's epilogue (same bits as the GEMM followed by the rope_qk op);
        larger M: dequantize, matmul, columns back in checkpoint order, then the rope_qk op."""
        from pieceworks.backends.fp4_gemm import cuda_dequant

        n = (num_heads + 2 * num_kv_heads) * head_dim
        m = x.shape[0]
        self._check_x(x, weight, n)
        if m <= self.options.decode_max_m:
            rope = (cos, sin, (num_heads + num_kv_heads) * head_dim, head_dim)
            return self._decode(x, weight, weight_scale, weight_scale_2, n, False, rope, prenormed=prenormed)
        w = cuda_dequant.dequant(weight, weight_scale, weight_scale_2, n, x.shape[1])
        order = _checkpoint_order(num_heads, num_kv_heads, head_dim, x.device)
        return rope_qk_columns((x @ w.t())[:, order], cos, sin, num_heads, num_kv_heads, head_dim)

    @staticmethod
    def _check_x(x, weight, n: int) -> None:
        """Refuse activations and sizes that don't fit the prepared weight (the kernels would read or
        write past it without a fault)."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the cuda fp4_gemm backend takes bf16 activations, got {x.dtype}: cast them, or "
                             "use another fp4_gemm backend (backends.fp4_gemm: triton)")
        if x.dim() != 2:
            raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
        rows, chunks = weight.shape[0] * 16, weight.shape[1] * 64
        if not rows - 16 < n <= rows or not chunks - 64 < x.shape[1] <= chunks:
            raise ValueError(f"x [M, {x.shape[1]}] and N = {n} do not match the prepared weight (about {rows} "
                             f"rows x {chunks} columns, padded to 16 x 64): was it prepared for another layer?")

    def _decode(self, x, weight, weight_scale, weight_scale_2, n: int, swiglu: bool, rope=None, prenormed=None,
                residual=None, norm_out=None):
        """The decode kernel, once per 16-row slice of x (`cuda_decode.decode_gemm`'s arguments)."""
        from pieceworks.backends.fp4_gemm import cuda_decode

        m = x.shape[0]
        on = pdl.enabled(x.device)
        warps, depth = plan(weight.shape[0] * 16, multiprocessors(x.device))
        if m <= SLICE:
            return cuda_decode.decode_gemm(x, weight, weight_scale, weight_scale_2, n, warps, depth, swiglu, on,
                                           rope=rope, prenormed=prenormed, residual=residual, norm_out=norm_out)
        out = torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16, device=x.device)
        for r0 in range(0, m, SLICE):
            r1 = min(m, r0 + SLICE)
            part_rope = None if rope is None else (rope[0][r0:r1], rope[1][r0:r1], *rope[2:])
            rows = slice(r0, r1)
            cuda_decode.decode_gemm(
                x[rows], weight, weight_scale, weight_scale_2, n, warps, depth, swiglu, on, out=out[rows],
                rope=part_rope, prenormed=None if prenormed is None else (prenormed[0][rows], prenormed[1]),
                residual=None if residual is None else residual[rows],
                norm_out=None if norm_out is None else (norm_out[0], norm_out[1][rows], norm_out[2][rows]))
        return out

    def forward(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features):
        return self._gemm(x, weight, weight_scale, weight_scale_2, out_features, swiglu=False)

    def _fusable(self, s, norm_weight=None, residual=None) -> bool:
        """Whether the decode kernel takes this norm / residual (else the unfused default runs)."""
        if not self.options.fuse_norm or s.dim() != 2 or s.shape[0] > self.options.decode_max_m:
            return False
        if norm_weight is not None and (norm_weight.dtype != torch.bfloat16 or norm_weight.dim() != 1):
            return False
        return residual is None or (residual.dtype == torch.bfloat16 and residual.dim() == 2
                                    and residual.stride(1) == 1)

    def forward_add(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual):
        """The residual add in the decode kernel's epilogue (same bits as the GEMM followed by the add)."""
        if not self._fusable(x, residual=residual):
            return super().forward_add(x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual)
        self._check_residual(x, weight, out_features, residual)
        return self._decode(x, weight, weight_scale, weight_scale_2, out_features, False, residual=residual)

    def forward_add_norm(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual,
                         norm_weight):
        """`forward_add` whose epilogue also writes the next norm's inputs (t = s * norm_weight, and the sums
        of s^2 over each CTA's 16 columns: the partials of `norm_inputs`, summed in a fixed order)."""
        if not self._fusable(x, norm_weight, residual) or norm_weight.shape != (out_features,):
            return super().forward_add_norm(x, weight, weight_scale, weight_scale_2, input_scale, out_features,
                                            residual, norm_weight)
        self._check_residual(x, weight, out_features, residual)
        m = x.shape[0]
        t = torch.empty(m, out_features, dtype=torch.bfloat16, device=x.device)
        partials = torch.empty(m, norm_parts(out_features), dtype=torch.float32, device=x.device)
        s = self._decode(x, weight, weight_scale, weight_scale_2, out_features, False, residual=residual,
                         norm_out=(norm_weight.contiguous(), t, partials))
        return s, t, partials

    def _check_residual(self, x, weight, n: int, residual) -> None:
        self._check_x(x, weight, n)
        if residual.shape != (x.shape[0], n):
            raise ValueError(f"residual {tuple(residual.shape)} does not match the output [{x.shape[0]}, {n}]")

    def _prenormed(self, s, t, partials, norm_weight, eps):
        """(partials, eps) for the decode kernel's NORM input, or None where the unfused default runs."""
        if not self._fusable(s, norm_weight) or t.shape != s.shape or t.dtype != torch.bfloat16:
            return None
        if partials.dim() != 2 or partials.shape[0] != s.shape[0] or partials.dtype != torch.float32:
            return None
        return partials.contiguous(), float(eps)

    def forward_norm_swiglu(self, s, t, partials, norm_weight, eps, weight, weight_scale, weight_scale_2,
                            input_scale, intermediate):
        """The decode kernel on t = s * norm weight, scaled by 1 / rms(s) (from the partials) in the epilogue;
        larger M or other dtypes: the rms_norm op, then `forward_swiglu`."""
        prenormed = self._prenormed(s, t, partials, norm_weight, eps)
        if prenormed is None:
            return super().forward_norm_swiglu(s, t, partials, norm_weight, eps, weight, weight_scale,
                                               weight_scale_2, input_scale, intermediate)
        self._check_x(t, weight, 2 * intermediate)
        return self._decode(t, weight, weight_scale, weight_scale_2, 2 * intermediate, True, prenormed=prenormed)

    def forward_norm_qkv_rope(self, s, t, partials, norm_weight, eps, weight, weight_scale, weight_scale_2,
                              input_scale, cos, sin, num_heads, num_kv_heads, head_dim):
        """As `forward_norm_swiglu`, with the rope epilogue of `forward_qkv_rope`."""
        prenormed = self._prenormed(s, t, partials, norm_weight, eps)
        if prenormed is None:
            return super().forward_norm_qkv_rope(s, t, partials, norm_weight, eps, weight, weight_scale,
                                                 weight_scale_2, input_scale, cos, sin, num_heads, num_kv_heads,
                                                 head_dim)
        return self.forward_qkv_rope(t, weight, weight_scale, weight_scale_2, input_scale, cos, sin, num_heads,
                                     num_kv_heads, head_dim, prenormed=prenormed)

    def forward_swiglu(self, x, weight, weight_scale, weight_scale_2, input_scale, intermediate):
        """silu(gate) * up in the decode kernel's epilogue (rounded as the silu_mul op rounds); larger M:
        dequantize in checkpoint row order, matmul, then the silu_mul op."""
        return self._gemm(x, weight, weight_scale, weight_scale_2, 2 * intermediate, swiglu=True)

    def _gemm(self, x, weight, weight_scale, weight_scale_2, n: int, swiglu: bool):
        from pieceworks.backends.fp4_gemm import cuda_dequant
        from pieceworks.backends import fused

        self._check_x(x, weight, n)
        m, k = x.shape
        if m <= self.options.decode_max_m:
            return self._decode(x, weight, weight_scale, weight_scale_2, n, swiglu)
        w = cuda_dequant.dequant(weight, weight_scale, weight_scale_2, n, k, swiglu)
        y = x @ w.t()
        if swiglu:
            return fused.silu_mul(y[:, : n // 2], y[:, n // 2 :])
        return y


@lru_cache(maxsize=None)
def _checkpoint_order(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Column j of the checkpoint order sits at this column of an `interleave_rope_rows` GEMM output."""
    return torch.argsort(interleave_rope_rows(num_heads, num_kv_heads, head_dim)).to(device)

