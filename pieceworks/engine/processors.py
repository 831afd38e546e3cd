"""The logits transforms of the sampler, as pure functions of [B, V] float32 tensors with per-row
parameters (vLLM's formulas). Each returns a new tensor. A row whose parameter is neutral keeps its
softmax bit for bit (its logits too, except that top_p = 1 sets tokens of probability exactly 0 to
-inf), so one batched call serves rows that don't use the transform.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    output_counts: torch.Tensor,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's penalties. logits [B, V] float32; prompt_mask [B, V] bool (token in the prompt);
    output_counts [B, V] int (times generated); presence, frequency, repetition [B] float32. A penalty
    no row uses may be None (and prompt_mask with repetition).

    A token seen in the prompt or output has its logit divided by the repetition penalty when positive
    and multiplied by it otherwise; then frequency * count and presence * (count > 0) are subtracted.
    Rows with neutral penalties (1, 0, 0) come back bit-identical.
    """
    generated = output_counts > 0
    if repetition is not None:
        assert prompt_mask is not None
        rep = torch.where(prompt_mask | generated, repetition.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * output_counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * generated
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p [B] times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Keep each row's k [B] (int64, 1..V; V = off) largest logits, the rest -inf, with a top-k_max
    selection instead of a sort (k_max: the largest k below V). Ties at the k-th value all stay."""
    top = logits.topk(k_max, dim=-1).values  # [B, k_max], descending
    kth = top.gather(1, (k - 1).clamp(max=k_max - 1).unsqueeze(1))
    kth = kth.masked_fill((k >= logits.shape[1]).unsqueeze(1), float("-inf"))  # rows without top_k
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k [B] (int64, 1..V; V = off) largest logits, then the smallest set of top
    tokens whose renormalized probability reaches p [B] (float32, (0, 1]; 1 = off); the rest -inf.
    Ties at the k-th value are all kept (as vLLM). One sort of [B, V]."""
    x, order = logits.sort(dim=-1)  # ascending, as vLLM's: the kept tokens are a suffix
    if k is not None:
        kth = x.gather(1, (x.shape[1] - k).unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    if p is not None:
        below = x.softmax(dim=-1).cumsum(dim=-1) <= (1 - p).unsqueeze(1)
        below[:, -1] = False  # the top token always stays
        x = x.masked_fill(below, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, x)


__all__ = ["apply_penalties", "apply_min_p", "apply_top_k", "apply_top_k_top_p"]
