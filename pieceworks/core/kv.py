"""The per-token shape of a model's KV cache, which a model declares and the executor's pool is built
from (here, below both, so models need not import the executor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Per-token KV shape: GQA (num_kv_heads, head_dim) for K and V, or MLA (latent_dim,) once."""

    kind: str  # "gqa" or "mla"
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0  # kv_lora_rank + qk_rope_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * self.num_kv_heads * self.head_dim if self.kind == "gqa" else self.latent_dim
        return per_layer * self.num_layers * size
