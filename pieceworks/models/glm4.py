"""Glm4ForCausalLM (THUDM / Zhipu GLM-4-0414, GLM-Z1): Llama's projections with q/k/v biases, an interleaved rope
over half of each head (`partial_rotary_factor`), gate and up fused in the checkpoint's `gate_up_proj`
(`llama_families.FusedNames`), in a sandwich block as transformers' Glm4 runs it: a norm before and after the
attention and before and after the MLP, each output normalized before its residual add. The blocks run on the
unfused path.
"""

from __future__ import annotations

from typing import Callable

import torch

from pieceworks.models.base import RMSNorm, WeightSource
from pieceworks.models.llama import Llama, LlamaArgs, LlamaBlock
from pieceworks.parallel.layout import TPLayout


class Glm4Block(LlamaBlock):
    def __init__(self, a: LlamaArgs, layer_id: int, fp4: Callable[[str], bool], tp: TPLayout = TPLayout()) -> None:
        super().__init__(a, layer_id, fp4, tp)
        self.post_self_attn_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (self.input_layernorm(h), h) if residual is None else self.input_layernorm(h, residual)
        a = self.post_self_attn_layernorm(self.self_attn(x, cos, sin))
        x, residual = self.post_attention_layernorm(a, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual

    def norms_fused(self) -> bool:
        return False

    def load(self, src: WeightSource, prefix: str) -> None:
        super().load(src, prefix)
        n = self.post_mlp_layernorm.weight.shape[0]
        for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
            getattr(self, name).weight.copy_(src.tensor(f"{prefix}.{name}.weight", (n,)))


class Glm4(Llama):
    block = Glm4Block
