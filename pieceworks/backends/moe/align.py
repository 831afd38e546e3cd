"""The sort of (token, slot) pairs into expert blocks that the Triton and CUDA MoE kernels read: block b holds
`block_m` flat pair indices of one expert, padded with the sentinel T * top_k. `num_aligned_blocks` sizes
the buffers for the worst case (so nothing is read back to the host); `moe_align` is the torch twin of the
Triton sort kernel (`triton_kernels.align_gpu`). Imports torch only.
"""

from __future__ import annotations

import torch


def num_aligned_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows that hold every expert's rows, each expert padded to a whole block.

    At most min(P * BM, P + E * (BM - 1)) rows for P = T * top_k pairs: an expert with c rows needs
    ceil(c / BM) * BM <= c + BM - 1 <= c * BM of them, and only experts with rows need any.
    """
    rows = min(num_pairs * block_m, num_pairs + num_experts * (block_m - 1))
    return -(-rows // block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort (token, slot) pairs by expert into blocks of block_m rows; capturable torch.

    Args:
        topk_ids: [T, top_k] expert of each pair (any integer dtype).

    Returns:
        sorted_ids: int32 [num_blocks * block_m], flat pair indices (t * top_k + slot) grouped by
            expert, each expert's run padded to a multiple of block_m with the sentinel T * top_k;
            pairs of one expert in their flat order.
        expert_ids: int32 [num_blocks], the expert of each block (blocks past the end: clamped, unused).
        num_post: int32 [1], rows in use (a multiple of block_m).
    """
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    num_blocks = num_aligned_blocks(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    sorted_ids = torch.full((num_blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, (ends - padded)[by_expert] + rank, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)
