"""Launch wrappers of the CUDA decode kernel's MoE modes (`cuda_decode_kernel.SOURCE`,
`nvfp4_decode_gemm<..., MOE>`) for `moe.cuda` (r16c64 experts) and the decode path of `moe.triton` (its k32
experts): MOE 1, the grouped GEMM over expert-sorted blocks of 8 pairs; MOE 2, one token's down GEMM and
top-k combine in one launch. Imports torch only; NVRTC compiles an instance on its first launch.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pieceworks.backends.fp4_gemm.cuda_decode import resident_cap
from pieceworks.backends.fp4_gemm.cuda_decode_kernel import SOURCE, instance
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
from pieceworks.backends.fp4_gemm.r16c64 import CHUNK
from pieceworks.backends.nvrtc import kernel

LAYOUTS = {"r16c64": 0, "k32": 1}  # the kernel's template argument L


def expert_geometry(codes: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(16-row groups, chunks along K, padded K) of stacked experts in `layout`: r16c64 codes [E, R, C, 512]
    (chunks of 64 elements) or k32 codes [E, Np, Kp / 2] (`repack_k32`; chunks of 128, one tile's K)."""
    if layout == "r16c64":
        if codes.dim() != 4 or codes.shape[-1] != 512:
            raise ValueError(f"r16c64 experts are uint8 [E, R, C, 512], got {tuple(codes.shape)}")
        return codes.shape[1], codes.shape[2], codes.shape[2] * CHUNK
    if layout == "k32":
        if codes.dim() != 3 or codes.shape[1] % 64 or codes.shape[2] % 256:
            raise ValueError(f"k32 experts are uint8 [E, Np, Kp / 2] with Np a multiple of 64 and Kp of 512 "
                             f"(repack_k32), got {tuple(codes.shape)}")
        return codes.shape[1] // 16, codes.shape[2] // 64, codes.shape[2] * 2
    raise ValueError(f"layout={layout!r}: use one of {sorted(LAYOUTS)}")


@lru_cache(maxsize=None)
def resident_cap_moe(run, warps: int, ctas: int, sms: int) -> int:
    """`cuda_decode.resident_cap`'s MINB (`__launch_bounds__`' CTAs per SM) for a grouped GEMM of `ctas` CTAs,
    but 0 (none) also where the registers ptxas picks already let an SM hold that many CTAs (a large grid
    is never all resident; a cap there would only recompile it). On the H200 the k32 gate/up instance takes
    72 registers (14 two-warp CTAs per SM); capped at 64 (16 per SM, no spills) a one-token step's 2048 CTAs
    are all resident, and the whole one-token MoE layer takes 58.8-60.2 us instead of 70.8 (docs/benchmarks.md). The r16c64 and k32 down instances (55-63 registers) are left as compiled."""
    cap = resident_cap(run, warps, ctas, sms)
    return 0 if run.resident_blocks(warps * 32) >= cap else cap


def _ids_as_int32(ids: torch.Tensor, what: str, shape=None) -> tuple[torch.Tensor, int]:
    """(int32 view, stride in int32 words) of contiguous int32 / int64 ids (int64: the low word of each,
    little-endian, ids < 2^31)."""
    if ids.dtype not in (torch.int32, torch.int64) or not ids.is_contiguous() or (shape and ids.shape != shape):
        want = f" {list(shape)}" if shape else ""
        raise ValueError(f"{what} must be contiguous int32 or int64{want}, got {ids.dtype} {tuple(ids.shape)}")
    return (ids.view(torch.int32), 2) if ids.dtype == torch.int64 else (ids, 1)


def moe_gemm(x, codes, scales, gscale, n: int, sorted_ids, expert_ids, num_post, num_pairs: int, a_div: int,
             out, topk_weights=None, warps: int = 2, depth: int = 2, pdl: bool = False, layout: str = "r16c64"):
    """The grouped decode GEMM of the fused MoE over expert-sorted blocks of 8 pairs (`moe_align`'s
    sorted_ids / expert_ids / num_post, block_m 8; expert_ids int32 or int64): for every pair id
    p < num_pairs in block b (expert e = expert_ids[b]), out[p] = x[p // a_div] @ dequant(W_e).T, times
    topk_weights[p] when given (the down GEMM), else silu(gate) * up with gate / up global scales
    gscale[e, 0 / 1] (r16c64: gate/up rows interleaved, `interleave_gate_up`; k32: the Triton MoE's halves,
    gate rows [0, Np / 2), up rows [Np / 2, Np), n = Np).

    x bf16 [rows, Kp] (unit stride in K, 16-byte aligned rows; Kp the experts' padded K, `expert_geometry`);
    codes / scales: r16c64 per expert [E, R, C, 512] / [E, R, C, 64] or k32 [E, Np, Kp / 2] / [E, Np, Kp / 16];
    gscale float32 [E] or [E, 2]; out bf16 [num_pairs, n or n / 2]. Blocks at or past num_post[0] exit at
    once: the grid is sized for the worst case."""
    rg, ch, kp = expert_geometry(codes, layout)
    e, k = codes.shape[0], x.shape[1]
    if k != kp or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError(f"moe_gemm: x must be bf16 [rows, {kp}] with unit stride in K and aligned rows, got "
                         f"{tuple(x.shape)}")
    swiglu = topk_weights is None
    if gscale.shape[0] != e or (swiglu and (gscale.dim() != 2 or gscale.shape[1] != 2)):
        raise ValueError(f"moe_gemm: gscale must be float32 [{e}]{' x 2' if swiglu else ''}, got "
                         f"{tuple(gscale.shape)}")
    if swiglu and layout == "k32" and (rg % 8 or n != 16 * rg):
        raise ValueError(f"moe_gemm: k32 gate/up experts need both halves in whole 64-row tiles (Np a multiple "
                         f"of 128, n = Np), got Np = {16 * rg}, n = {n}")
    gscale = gscale.contiguous()
    blocks = expert_ids.shape[0]
    if sorted_ids.shape[0] != blocks * 8:
        raise ValueError("moe_gemm: sorted_ids must hold 8 pair ids per block")
    expert_ids, e_stride = _ids_as_int32(expert_ids, "moe_gemm: expert_ids")
    args = (warps, depth, 1, int(swiglu), 0, 1)
    run = kernel(SOURCE, instance(*args, layout=LAYOUTS[layout]), x.device)
    cap = resident_cap_moe(run, warps, rg * blocks, multiprocessors(x.device))
    if cap:
        run = kernel(SOURCE, instance(*args, minb=cap, layout=LAYOUTS[layout]), x.device)
    tw = gscale if swiglu else topk_weights
    run(
        (rg, blocks, 1), (warps * 32, 1, 1),
        [codes, scales, x, out, gscale, num_pairs, n, ch, x.stride(0), out.stride(0), gscale, gscale,
         e_stride, 0, 0, 1,  # ldc = the expert ids' stride (MOE has no rope)
         gscale, 0, 0.0, k, gscale, 0, gscale, gscale, 0, gscale, sorted_ids, expert_ids, num_post, tw, a_div,
         gscale.stride(0)], pdl)
    return out


def moe_down_one_token(h, codes, scales, gscale, n: int, topk_ids, topk_weights, out, warps: int,
                       depth: int = 2, pdl: bool = False, layout: str = "r16c64"):
    """One token's down GEMM and top-k combine in one launch (the kernel's MOE 2 mode): out[0] = sum over
    slots p of topk_weights[p] * h[p] @ dequant(W_{topk_ids[p]}).T, float32 sums rounded once to bf16.

    h bf16 [top_k, Kp] (the slots' SwiGLU outputs, zero past I; unit stride, aligned rows); codes / scales
    per expert in `layout` (`moe_gemm`); gscale float32 [E]; topk_ids int32 or int64 [top_k] contiguous;
    topk_weights float32 [top_k]; out bf16 [1, n]. warps: a multiple of top_k (each slot's expert gets
    warps / top_k of them), 32 at most."""
    rg, ch, kp = expert_geometry(codes, layout)
    e = codes.shape[0]
    top_k, k = h.shape
    if k != kp or h.stride(1) != 1 or h.stride(0) % 8 or h.data_ptr() % 16:
        raise ValueError(f"moe_down_one_token: h must be bf16 [top_k, {kp}] with aligned rows, got {tuple(h.shape)}")
    if warps % top_k or not top_k <= warps <= 32:
        raise ValueError(f"moe_down_one_token: warps ({warps}) must be a multiple of top_k ({top_k}), at most 32")
    topk_ids, e_stride = _ids_as_int32(topk_ids, "moe_down_one_token: topk_ids", (top_k,))
    if topk_weights.shape != (top_k,) or topk_weights.dtype != torch.float32 or gscale.shape != (e,):
        raise ValueError("moe_down_one_token: topk_weights float32 [top_k] and gscale float32 [E] expected")
    gscale = gscale.contiguous()
    kernel(SOURCE, instance(warps, depth, 1, 0, 0, 2, layout=LAYOUTS[layout]), h.device)(
        (rg, 1, 1), (warps * 32, 1, 1),
        [codes, scales, h, out, gscale, top_k, n, ch, h.stride(0), out.stride(0), gscale, gscale,
         e_stride, 0, 0, 1,  # ldc = the expert ids' stride
         gscale, 0, 0.0, k, gscale, 0, gscale, gscale, 0, gscale, topk_ids, topk_ids, topk_ids, topk_weights, 1,
         gscale.stride(0)], pdl)
    return out
