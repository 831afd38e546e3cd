"""DeepSeek-V3 routing (capturable: no host syncs, fixed shapes).

`deepseek_route` is the plain torch definition, used by the torch reference MoE backend. `route` is
what the fast backends call: the same routing as one Triton kernel on CUDA where the shapes allow it
(`routing_kernel.py`), else `deepseek_route`.
"""

from __future__ import annotations

import functools

import torch


def softmax_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, num_expert_group: int = 1,
                  topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax scores over every expert, top_k of them, renormalized over the chosen when `renormalize` (Qwen2-MoE's,
    Qwen3-MoE's, Mixtral's and DeepSeek-V2's routing): (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64).
    With groups (DeepSeek-V2's group_limited_greedy) only the `topk_group` groups of the highest best score compete,
    the others' scores set to 0, as DeepSeek's code does."""
    scores = torch.softmax(router_logits.float(), dim=-1)
    if num_expert_group > 1 and topk_group < num_expert_group:
        grouped = scores.view(scores.shape[0], num_expert_group, -1)
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device)
        keep.scatter_(1, grouped.amax(dim=-1).topk(topk_group, dim=-1).indices, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view_as(scores)
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def deepseek_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores, bias-corrected grouped top-k, renormalization, scaling.

    Groups are ranked by the sum of their two best bias-corrected scores; experts outside the best
    `topk_group` groups are excluded (masked to -inf, as DeepSeek's reference inference code does).

    Args:
        router_logits: [T, E] float32.
        correction_bias: [E] float32 (e_score_correction_bias) or empty (no bias).
        top_k: experts per token.
        num_expert_group: groups E is split into (1 = no grouping).
        topk_group: groups kept per token.
        renormalize: divide the chosen weights by their sum (norm_topk_prob).
        routed_scaling_factor: multiplies the final weights.

    Returns:
        (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)
    """
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    scores = logits.sigmoid()
    choice = scores + correction_bias.float() if correction_bias.numel() else scores
    if num_expert_group > 1 and topk_group < num_expert_group:
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_expert_group: int,
          topk_group: int, renormalize: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`deepseek_route`, as one Triton launch on CUDA when triton is importable and the shapes are
    supported (`route_supported`); experts then come in descending order of score."""
    kernel = _kernel() if router_logits.is_cuda else None
    if kernel is not None and route_supported(router_logits, correction_bias, top_k, num_expert_group, topk_group):
        return kernel.deepseek_route_triton(router_logits, correction_bias, top_k, num_expert_group,
                                            topk_group, renormalize, routed_scaling_factor)
    return deepseek_route(router_logits, correction_bias, top_k, num_expert_group, topk_group, renormalize,
                          routed_scaling_factor)


def route_supported(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                    num_expert_group: int, topk_group: int) -> bool:
    """Shapes the kernel handles: E a power of two up to 1024, groups a power of two dividing E,
    enough kept experts for top_k, float32/bf16/fp16 logits with unit column stride (any device: the
    caller checks that the logits are on CUDA)."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        return False
    num_experts = router_logits.shape[1]
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    grouped = num_expert_group > 1 and topk_group < num_expert_group
    return (router_logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and pow2(num_experts)
            and num_experts <= 1024 and 1 <= top_k <= num_experts
            and (correction_bias.numel() == 0 or (correction_bias.shape == (num_experts,)
                                                  and correction_bias.is_contiguous()))
            and (not grouped or (pow2(num_expert_group) and num_experts % num_expert_group == 0
                                 and num_experts // num_expert_group >= 2
                                 and topk_group * (num_experts // num_expert_group) >= top_k)))


@functools.cache
def _kernel():
    try:
        from pieceworks.backends.moe import routing_kernel
    except ImportError:
        return None
    return routing_kernel
