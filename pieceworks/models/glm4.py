"""Glm4ForCausalLM (THUDM / Zhipu GLM-4-0414, GLM-Z1): Llama's projections with q/k/v biases, an interleaved rope
over half of each head (`partial_rotary_factor`), gate and up fused in the checkpoint's `gate_up_proj`
(`families.FusedNames`), in a sandwich block as transformers' Glm4 runs it: a norm before and after the
attention and before and after the MLP, each output normalized before its residual add (`SandwichBlock`, Gemma 3's
too). The blocks run on the unfused path.
"""

from __future__ import annotations

from typing import Callable

import torch

from pieceworks.models.base import RMSNorm, WeightSource
from pieceworks.models.llama import Llama, LlamaArgs, LlamaBlock
from pieceworks.parallel.layout import TPLayout


class SandwichBlock(LlamaBlock):
    """A block with four norms, named by `norms`: before the attention, after it, before the MLP, after it (GLM-4's,
    Gemma 3's); each output is normalized before its residual add, which runs fused with the next norm."""

    norms: tuple[str, str, str, str] = ("input_layernorm", "", "post_attention_layernorm", "")

    def __init__(self, a: LlamaArgs, layer_id: int, fp4: Callable[[str], bool], tp: TPLayout = TPLayout()) -> None:
        super().__init__(a, layer_id, fp4, tp)
        for name in self.norms:
            if not hasattr(self, name):
                setattr(self, name, RMSNorm(a.hidden_size, a.rms_norm_eps))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre_attn, post_attn, pre_mlp, post_mlp = (getattr(self, n) for n in self.norms)
        x, residual = (pre_attn(h), h) if residual is None else pre_attn(h, residual)
        x, residual = pre_mlp(post_attn(self.self_attn(x, cos, sin)), residual)
        return post_mlp(self.mlp(x)), residual

    def norms_fused(self) -> bool:
        return False


class Glm4Block(SandwichBlock):
    norms = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")

    def load(self, src: WeightSource, prefix: str) -> None:
        super().load(src, prefix)
        n = self.post_mlp_layernorm.weight.shape[0]
        for name in ("post_self_attn_layernorm", "post_mlp_layernorm"):
            getattr(self, name).weight.copy_(src.tensor(f"{prefix}.{name}.weight", (n,)))


class Glm4(Llama):
    block = Glm4Block
