"""The expert part of the CUDA MoE, shared by `moe.cuda` (r16c64 experts) and the decode path of `moe.triton`
(its k32 experts, `backends.options.triton.cuda_moe_max_t`): the sort of the routed (token, slot) pairs into
blocks of BLOCK_M pairs of one expert (skipped at one token: a block per pair), the gate/up GEMM with SwiGLU,
the down GEMM with the routing weights, and the top-k combine (`cuda_kernels` launches the GEMMs; the sort and
the combine are the Triton MoE's kernels). Imports torch only; the kernels' modules are imported at the first
call.
"""

from __future__ import annotations

import torch

from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors, plan
from pieceworks.backends.moe.align import num_aligned_blocks
from pieceworks.backends.moe.base import MoEWeights

BLOCK_M = 8  # pairs per block: one n-tile of the kernel's mma

_ONE_TOKEN: dict = {}  # (top_k, device) -> (sorted_ids, num_post) of a one-token step


def one_token_blocks(top_k: int, device: torch.device):
    """(sorted_ids, num_post) of one token's top_k pairs, a block each: block b = [b, then the padding id
    top_k]; built once per (top_k, device) and kept, at fixed addresses (graph-safe; read only). A token's
    top-k experts are distinct, so no expert is read twice."""
    key = (top_k, str(device))
    if key not in _ONE_TOKEN:
        ids = torch.full((top_k, BLOCK_M), top_k, dtype=torch.int32)
        ids[:, 0] = torch.arange(top_k, dtype=torch.int32)
        _ONE_TOKEN[key] = (ids.reshape(-1).to(device),
                           torch.tensor([top_k * BLOCK_M], dtype=torch.int32, device=device))
    return _ONE_TOKEN[key]


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: MoEWeights,
                    layout: str) -> torch.Tensor:
    """The expert part of the CUDA MoE for routed pairs (topk_weights float32 [T, top_k], topk_ids [T, top_k]):
    the sort (skipped at one token), the gate/up GEMM with SwiGLU, the down GEMM with the routing weights and
    the combine (one token: the down GEMM and the combine in one launch). `layout`: "r16c64" (`moe.cuda`'s
    prepared experts: gate/up rows interleaved) or "k32" (`moe.triton`'s: gate and up halves, K padded to
    512 and rows to 64 by `repack_k32`)."""
    if x.shape[0] == 0:  # no launch: a grid with no blocks is a launch error
        return torch.empty_like(x)
    from pieceworks.backends import pdl
    from pieceworks.backends.moe import cuda_kernels, triton_kernels

    tokens, hidden = x.shape
    num_experts = w.w13.shape[0]
    rg13, _, kp13 = cuda_kernels.expert_geometry(w.w13, layout)
    rg2, _, kp2 = cuda_kernels.expert_geometry(w.w2, layout)
    inter = rg13 * 8  # SwiGLU outputs per pair: gate rows (r16c64: I; k32: I padded to 64)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the CUDA MoE kernels take bf16 activations, got {x.dtype}: use backends.moe: triton")
    if hidden > kp13 or (layout == "r16c64" and hidden != kp13) or hidden > rg2 * 16:
        raise ValueError(f"x [T, {hidden}] does not match the experts' hidden size ({kp13} columns of gate/up, "
                         f"{rg2 * 16} rows of down)")
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if tokens == 1:  # a block per pair, the routing's ids as the blocks' experts: no sort launch
        sorted_ids, num_post = one_token_blocks(top_k, x.device)
        expert_ids, blocks = topk_ids.reshape(-1).contiguous(), top_k
    else:
        blocks = num_aligned_blocks(pairs, num_experts, BLOCK_M)
        sorted_ids, expert_ids, num_post = triton_kernels.align_gpu(topk_ids, num_experts, BLOCK_M, blocks)
    if hidden != kp13:  # the kernel reads x in whole chunks (k32: K padded to 512)
        x = torch.nn.functional.pad(x, (0, kp13 - hidden))
    elif x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    on = pdl.enabled(x.device)
    sms = multiprocessors(x.device)
    # the down GEMM reads h in whole chunks: columns past the SwiGLU outputs must be zero
    h = (torch.zeros if kp2 > inter else torch.empty)(pairs, kp2, dtype=torch.bfloat16, device=x.device)
    warps, depth = plan(rg13 * 16 * min(blocks, num_experts), sms)
    cuda_kernels.moe_gemm(x, w.w13, w.w13_scale, w.w13_scale_2, 2 * inter, sorted_ids, expert_ids, num_post,
                          pairs, top_k, h, None, warps, depth, on, layout)
    gs2 = w.w2_scale_2.reshape(num_experts)
    if tokens == 1 and top_k <= 32:  # the down GEMM and the combine in one launch
        warps = top_k * max(1, min(32 // top_k, plan(rg2 * 16, sms)[0] // top_k))
        out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
        return cuda_kernels.moe_down_one_token(h, w.w2, w.w2_scale, gs2, hidden, expert_ids,
                                               topk_weights.reshape(-1).float().contiguous(), out, warps, pdl=on,
                                               layout=layout)
    y = torch.empty(pairs, hidden, dtype=torch.bfloat16, device=x.device)
    warps, depth = plan(rg2 * 16 * min(blocks, num_experts), sms)
    cuda_kernels.moe_gemm(h, w.w2, w.w2_scale, gs2, hidden, sorted_ids, expert_ids, num_post, pairs, 1, y,
                          topk_weights.reshape(-1).float().contiguous(), warps, depth, on, layout)
    return triton_kernels.combine(y, tokens, top_k, x.dtype)
