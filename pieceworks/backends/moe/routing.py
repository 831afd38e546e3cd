"""DeepSeek-V3 routing in plain torch (capturable: no host syncs, fixed shapes).

Used by the torch reference MoE backend and by any backend that does not fuse routing itself.
"""

from __future__ import annotations

import torch


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
