"""Launch wrappers of the CUDA decode kernel's MoE modes (`cuda_decode_kernel.SOURCE`,
`nvfp4_decode_gemm<..., MOE>`) for `moe.cuda`: MOE 1, the grouped GEMM over expert-sorted blocks of 8
pairs; MOE 2, one token's down GEMM and top-k combine in one launch. Imports torch only; NVRTC compiles an
instance on its first launch.
"""

from __future__ import annotations

import torch

from pieceworks.backends.fp4_gemm.cuda_decode_kernel import SOURCE
from pieceworks.backends.fp4_gemm.r16c64 import CHUNK
from pieceworks.backends.nvrtc import kernel


def moe_gemm(x, codes, scales, gscale, n: int, sorted_ids, expert_ids, num_post, num_pairs: int, a_div: int,
             out, topk_weights=None, warps: int = 2, depth: int = 2, pdl: bool = False):
    """The grouped decode GEMM of the fused MoE over expert-sorted blocks of 8 pairs (`moe_align`'s
    sorted_ids / expert_ids / num_post, block_m 8; expert_ids int32 or int64): for every pair id
    p < num_pairs in block b (expert e = expert_ids[b]), out[p] = x[p // a_div] @ dequant(W_e).T, times
    topk_weights[p] when given (the down GEMM), else (gate/up rows interleaved) silu(gate) * up with gate /
    up global scales gscale[e, 0 / 1].

    x bf16 [rows, K] (unit stride in K, 16-byte aligned rows, K a multiple of 64); codes [E, R, C, 512],
    scales [E, R, C, 64] (r16c64 per expert); gscale float32 [E] or [E, 2]; out bf16 [num_pairs, n or
    n / 2]. Blocks at or past num_post[0] exit at once: the grid is sized for the worst case."""
    e, rg, ch, _ = codes.shape
    k = x.shape[1]
    if k != ch * CHUNK or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError(f"moe_gemm: x must be bf16 [rows, {ch * CHUNK}] with unit stride in K and aligned rows")
    swiglu = topk_weights is None
    if gscale.shape[0] != e or (swiglu and (gscale.dim() != 2 or gscale.shape[1] != 2)):
        raise ValueError(f"moe_gemm: gscale must be float32 [{e}]{' x 2' if swiglu else ''}, got "
                         f"{tuple(gscale.shape)}")
    gscale = gscale.contiguous()
    blocks = expert_ids.shape[0]
    if sorted_ids.shape[0] != blocks * 8:
        raise ValueError("moe_gemm: sorted_ids must hold 8 pair ids per block")
    if expert_ids.dtype not in (torch.int32, torch.int64) or not expert_ids.is_contiguous():
        raise ValueError(f"moe_gemm: expert_ids must be contiguous int32 or int64, got {expert_ids.dtype}")
    e_stride = 1
    if expert_ids.dtype == torch.int64:  # read as the low int32 word of each id (little-endian, ids < 2^31)
        expert_ids, e_stride = expert_ids.view(torch.int32), 2
    name = f"nvfp4_decode_gemm<{warps}, {depth}, 1, {int(swiglu)}, 0, 1>"
    tw = gscale if swiglu else topk_weights
    kernel(SOURCE, name, x.device)(
        (rg, blocks, 1), (warps * 32, 1, 1),
        [codes, scales, x, out, gscale, num_pairs, n, ch, x.stride(0), out.stride(0), gscale, gscale,
         e_stride, 0, 0, 1,  # ldc = the expert ids' stride (MOE has no rope)
         gscale, 0, 0.0, k, gscale, 0, gscale, gscale, 0, gscale, sorted_ids, expert_ids, num_post, tw, a_div,
         gscale.stride(0)], pdl)
    return out


def moe_down_one_token(h, codes, scales, gscale, n: int, topk_ids, topk_weights, out, warps: int,
                       depth: int = 2, pdl: bool = False):
    """One token's down GEMM and top-k combine in one launch (the kernel's MOE 2 mode): out[0] = sum over
    slots p of topk_weights[p] * h[p] @ dequant(W_{topk_ids[p]}).T, float32 sums rounded once to bf16.

    h bf16 [top_k, I] (the slots' SwiGLU outputs; I a multiple of 64, unit stride, aligned rows); codes /
    scales r16c64 per expert [E, R, C, 512] / [E, R, C, 64]; gscale float32 [E]; topk_ids int32 or int64
    [top_k] contiguous; topk_weights float32 [top_k]; out bf16 [1, n]. warps: a multiple of top_k (each
    slot's expert gets warps / top_k of them), 32 at most."""
    e, rg, ch, _ = codes.shape
    top_k, k = h.shape
    if k != ch * CHUNK or h.stride(1) != 1 or h.stride(0) % 8 or h.data_ptr() % 16:
        raise ValueError(f"moe_down_one_token: h must be bf16 [top_k, {ch * CHUNK}] with aligned rows")
    if warps % top_k or not top_k <= warps <= 32:
        raise ValueError(f"moe_down_one_token: warps ({warps}) must be a multiple of top_k ({top_k}), at most 32")
    if topk_ids.shape != (top_k,) or not topk_ids.is_contiguous() or topk_ids.dtype not in (torch.int32,
                                                                                           torch.int64):
        raise ValueError("moe_down_one_token: topk_ids must be contiguous int32 / int64 [top_k]")
    if topk_weights.shape != (top_k,) or topk_weights.dtype != torch.float32 or gscale.shape != (e,):
        raise ValueError("moe_down_one_token: topk_weights float32 [top_k] and gscale float32 [E] expected")
    e_stride = 1
    if topk_ids.dtype == torch.int64:  # the low int32 word of each id
        topk_ids, e_stride = topk_ids.view(torch.int32), 2
    gscale = gscale.contiguous()
    kernel(SOURCE, f"nvfp4_decode_gemm<{warps}, {depth}, 1, 0, 0, 2>", h.device)(
        (rg, 1, 1), (warps * 32, 1, 1),
        [codes, scales, h, out, gscale, top_k, n, ch, h.stride(0), out.stride(0), gscale, gscale,
         e_stride, 0, 0, 1,  # ldc = the expert ids' stride
         gscale, 0, 0.0, k, gscale, 0, gscale, gscale, 0, gscale, topk_ids, topk_ids, topk_ids, topk_weights, 1,
         gscale.stride(0)], pdl)
    return out
