"""Row orders of the fused epilogues, shared by the Triton and CUDA backends' `prepare_gate_up` and
`prepare_qkv_rope` (and moe.cuda's experts): each output column's partner rows sit side by side, so every
even-width tile holds both halves of what its epilogue combines. Imports torch only.
"""

from __future__ import annotations

import torch


def interleave_gate_up(n: int) -> torch.Tensor:
    """Row order of a gate/up weight [gate; up] (n rows) for the fused SwiGLU epilogue: gate row j
    and up row j next to each other (rows 2j, 2j + 1), so every even-width tile holds both halves of
    its output columns."""
    if n % 2:
        raise ValueError(f"a gate/up weight has an even row count, not {n}")
    return torch.arange(n).view(2, n // 2).t().reshape(-1)


def interleave_rope_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Row order of a q/k/v weight [q; k; v] for the fused rope epilogue: in every q and k head, dims j
    and j + head_dim/2 (a rotate-half pair) next to each other (rows 2j, 2j + 1 of the head); the v
    rows keep their order. Every even-width tile then holds both halves of its pairs."""
    if head_dim % 2:
        raise ValueError(f"the rotate-half rope needs an even head_dim, not {head_dim}")
    half = head_dim // 2
    within = torch.arange(head_dim).view(2, half).t().reshape(-1)  # 0, half, 1, half + 1, ...
    heads = num_heads + num_kv_heads
    roped = (torch.arange(heads)[:, None] * head_dim + within[None, :]).reshape(-1)
    return torch.cat([roped, heads * head_dim + torch.arange(num_kv_heads * head_dim)])
