"""Launching the CUDA decode GEMM (the kernel source and its design: cuda_decode_kernel.py): `decode_gemm`
for M <= 16 rows of x on the r16c64 weights of `fp4_gemm.cuda` or the k32 weights of `fp4_gemm.triton`, and
`resident_cap`, the register cap that keeps a two-token-tile grid resident.
The MoE modes' launches are in backends/moe/cuda_kernels.py. Imports torch only (not triton).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pieceworks.backends.fp4_gemm.cuda_decode_kernel import SOURCE, instance
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
from pieceworks.backends.fp4_gemm.r16c64 import CHUNK
from pieceworks.backends.nvrtc import kernel


@lru_cache(maxsize=None)
def resident_cap(run, warps: int, ctas: int, sms: int) -> int:
    """0 where the whole grid of `ctas` CTAs of `warps` warps of kernel `run` (an nvrtc.Kernel) is resident on
    `sms` SMs at once, else the MINB to compile it with: the CTAs per SM that would hold the grid, at most
    32 / warps (a cap of 64 registers; below that ptxas spills)."""
    if run.resident_blocks(warps * 32) * sms >= ctas:
        return 0
    return min(-(-ctas // sms), max(1, 32 // warps))


def decode_gemm(x, codes, scales, gscale, n: int, warps: int = 8, depth: int = 2, swiglu: bool = False,
                pdl: bool = False, out=None, rope=None, prenormed=None, residual=None, norm_out=None,
                min_blocks: int | None = None, layout: str = "r16c64"):
    """y = x @ dequant(W).T for M <= 16 (bf16 x with unit stride in K, 16-byte aligned rows); with
    swiglu (rows interleaved gate / up) y = silu(gate) * up [M, n / 2]; with rope = (cos, sin,
    rope_cols, head_dim) (rows in the interleave_rope_rows order) the q/k columns below rope_cols
    rotated, every column in checkpoint order.

    prenormed = (partials [M, P] float32, eps) (any epilogue): x is s * norm weight and the partials sum
    to each row's sum of s^2 (as `norm_out` writes them); y is the GEMM of RMSNorm(s).
    residual [M, n] bf16 (plain epilogue only): y + residual, rounded as the add after the GEMM. With
    norm_out = (norm weight [n] bf16, t [M, n] bf16, partials [M, ceil(n / 16)] float32) as well, the
    kernel also writes the next RMSNorm's inputs: t = (y + residual) * weight and the partial sums of
    squares of y + residual.

    min_blocks (two token tiles, M 9..16): the register cap (`__launch_bounds__`' CTAs per SM; 0: none);
    None: `resident_cap`'s choice. The same bits either way.

    layout: "r16c64" (codes [R, C, 512] and scales [R, C, 64] from `r16c64.repack_decode`) or "k32" (the Triton
    backend's weights from `k32.repack_k32`: codes uint8 [Np, Kp / 2], scales [Np, Kp / 16], Np a multiple of
    64 and Kp of 512; x is zero-padded to Kp where K is shorter)."""
    m, k = x.shape
    if m > 16:
        raise ValueError(f"decode_gemm serves M <= 16, got {m}")
    if residual is not None and (swiglu or rope is not None):
        raise ValueError("decode_gemm: the residual add goes with the plain epilogue only")
    if norm_out is not None and residual is None:
        raise ValueError("decode_gemm: norm_out needs the residual add")
    lcode = {"r16c64": 0, "k32": 1}.get(layout)
    if lcode:
        if codes.dim() != 2 or codes.shape[0] % 64 or codes.shape[1] % 256:
            raise ValueError(f"decode_gemm: k32 codes must be uint8 [Np, Kp / 2] with Np a multiple of 64 and Kp of "
                             f"512 (k32.repack_k32), got {tuple(codes.shape)}")
        rg, ch, kp = codes.shape[0] // 16, codes.shape[1] // 64, codes.shape[1] * 2
        if k > kp or n > codes.shape[0]:
            raise ValueError(f"decode_gemm: x [M, {k}] and N = {n} do not fit the k32 weight ({codes.shape[0]} rows x "
                             f"{kp} columns)")
    elif lcode == 0:
        rg, ch, _ = codes.shape
        kp = -(-k // CHUNK) * CHUNK
    else:
        raise ValueError(f"decode_gemm: layout={layout!r}: use 'r16c64' or 'k32'")
    if k != kp:  # the kernel reads x in whole chunks
        x = torch.nn.functional.pad(x, (0, kp - k))
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
    if out is None:
        out = torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16, device=x.device)
    if m == 0:  # nothing to compute (the kernel would read row M - 1 = -1)
        return out
    nt = 1 if m <= 8 else 2
    if rope is None:
        epi, rope_args = int(swiglu), [gscale, gscale, 0, 0, 0, 1]
    else:
        cos, sin, rope_cols, head_dim = rope
        cos, sin = cos.float(), sin.float()
        if cos.stride(-1) != 1 or sin.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        epi, rope_args = 2, [cos, sin, cos.stride(0), sin.stride(0), rope_cols, head_dim // 2]
    norm_args = [gscale, 0, 0.0, k]
    if prenormed is not None:
        parts, eps = prenormed
        if parts.dim() != 2 or parts.shape[0] != m or parts.dtype != torch.float32 or not parts.is_contiguous():
            raise ValueError(f"decode_gemm: the partial sums must be contiguous float32 [{m}, P], got "
                             f"{parts.dtype} {tuple(parts.shape)}")
        norm_args = [parts, parts.shape[1], float(eps), k]
    res_args = [gscale, 0]
    if residual is not None:
        if residual.shape != (m, n) or residual.dtype != torch.bfloat16 or residual.stride(1) != 1:
            raise ValueError(f"decode_gemm: the residual must be bf16 [{m}, {n}] with unit column stride, got "
                             f"{residual.dtype} {tuple(residual.shape)}")
        epi, res_args = 3, [residual, residual.stride(0)]
    out_args = [gscale, gscale, 0, gscale]
    if norm_out is not None:
        nw, t, parts = norm_out
        if nw.shape != (n,) or nw.dtype != torch.bfloat16 or not nw.is_contiguous():
            raise ValueError(f"decode_gemm: the norm weight must be contiguous bf16 [{n}], got {nw.dtype} "
                             f"{tuple(nw.shape)}")
        if t.shape != (m, n) or t.dtype != torch.bfloat16 or t.stride(1) != 1:
            raise ValueError(f"decode_gemm: t must be bf16 [{m}, {n}] with unit column stride")
        if parts.shape != (m, rg) or parts.dtype != torch.float32 or not parts.is_contiguous():
            raise ValueError(f"decode_gemm: the partials must be contiguous float32 [{m}, {rg}]")
        epi, out_args = 4, [nw, t, t.stride(0), parts]
    args = (warps, depth, nt, epi, int(prenormed is not None), 0)
    run = kernel(SOURCE, instance(*args, layout=lcode), x.device)
    if nt == 2:  # two token tiles: cap the registers where the grid would not stay resident
        cap = resident_cap(run, warps, rg, multiprocessors(x.device)) if min_blocks is None else min_blocks
        if cap:
            run = kernel(SOURCE, instance(*args, minb=cap, layout=lcode), x.device)
    run(
        (rg, 1, 1), (warps * 32, 1, 1),
        [codes, scales, x, out, gscale, m, n, ch, x.stride(0), out.stride(0), *rope_args, *norm_args, *res_args,
         *out_args, gscale, gscale, gscale, gscale, 1, 0], pdl)
    return out
