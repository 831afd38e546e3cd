"""GraniteForCausalLM (IBM Granite 3.x dense): Llama's layers and checkpoint names with four scalars from its
config.json, as transformers' Granite applies them: the embeddings times `embedding_multiplier`, each attention
and MLP output times `residual_multiplier` before its residual add, `attention_multiplier` as the attention's
softmax scale (in place of 1 / sqrt(head_dim)) and the logits divided by `logits_scaling`.

The scaled outputs keep the block on the unfused path (`block_forward`'s order, the add fused with the next norm):
the fp4_gemm backends that fuse the residual add into the o / down projections add the output unscaled.
"""

from __future__ import annotations

from typing import Callable

import torch

from pieceworks.models.llama import Llama, LlamaBlock
from pieceworks.parallel.layout import TPLayout

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
"""Granite's config.json scalars (each a finite float > 0; transformers' default 1.0)."""


class GraniteBlock(LlamaBlock):
    residual_multiplier = 1.0

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.residual_multiplier
        x, residual = (self.input_layernorm(h), h) if residual is None else self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin) * m, residual)
        return self.mlp(x) * m, residual

    def norms_fused(self) -> bool:
        return False


class Granite(Llama):
    block = GraniteBlock

    def __init__(self, hf_config: dict, dtype: torch.dtype, fp4: Callable[[str], bool] = lambda name: False,
                 tp: TPLayout = TPLayout()):
        super().__init__(hf_config, dtype, fp4, tp)
        scalars = {k: float(hf_config.get(k) or 1.0) for k in MULTIPLIERS}
        self.embedding_multiplier, self.logits_scaling = scalars["embedding_multiplier"], scalars["logits_scaling"]
        for block in self.layers:
            block.residual_multiplier = scalars["residual_multiplier"]
            block.self_attn.scale = scalars["attention_multiplier"]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
