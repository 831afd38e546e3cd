"""Olmo2ForCausalLM (AllenAI OLMo 2): Llama's projections, rope and SwiGLU MLP in a post-norm block, as
transformers' Olmo2 runs it: s = s + RMSNorm(attention(s)), then s = s + RMSNorm(mlp(s)) (no norm before either),
with q and k each normalized over the whole projection, all heads at once, before the rope (`LlamaArgs.qk_norm`
"full"). The blocks run on the unfused path; tensor parallel is refused (those norms span every head).

Olmo3ForCausalLM (OLMo 3): OLMo 2's blocks with sliding-window attention in most layers (`layer_types`; without
them every layer but each fourth), which rotate with a default rope of their own (`olmo3_form`; the full layers'
rope may be scaled, yarn in the long-context checkpoints).

Exaone4ForCausalLM (EXAONE 4): the same post-norm blocks with q and k normalized per head (as Qwen3's), so tensor
parallel splits it, sliding-window attention in most layers, and where the config has a window, full layers that
rotate nothing (`exaone4_form`).

The norms round as Llama's (`RMSNorm`: the weight times the normalized values rounded to the activation dtype);
transformers' Olmo2RMSNorm multiplies in float32 and rounds once: equal in float32 (the parity tests), a last-bit
difference per norm in bf16.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from pieceworks.backends.base import ModelFacts
from pieceworks.errors import ConfigError
from pieceworks.models.base import RMSNorm, WeightSource
from pieceworks.models.config_forms import exaone4_form, exaone4_rope_layers, olmo3_form
from pieceworks.models.families import with_defaults
from pieceworks.models.llama import Llama, LlamaArgs, LlamaBlock
from pieceworks.models.sliding import SlidingLayers
from pieceworks.parallel.layout import TPLayout


class Olmo2Block(LlamaBlock):
    def __init__(self, a: LlamaArgs, layer_id: int, fp4: Callable[[str], bool], tp: TPLayout = TPLayout()) -> None:
        super().__init__(a, layer_id, fp4, tp)
        self.input_layernorm = None  # OLMo 2 normalizes outputs, not inputs
        self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = h if residual is None else h + residual
        s = s + self.post_attention_layernorm(self.self_attn(s, cos, sin))
        return self.post_feedforward_layernorm(self.mlp(s)), s

    def norms_fused(self) -> bool:
        return False

    def load(self, src: WeightSource, prefix: str) -> None:
        n = self.post_attention_layernorm.weight.shape[0]
        for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
            getattr(self, name).weight.copy_(src.tensor(f"{prefix}.{name}.weight", (n,)))
        self.self_attn.load(src, f"{prefix}.self_attn")
        self.mlp.load(src, f"{prefix}.mlp")


class Olmo2(Llama):
    block = Olmo2Block
    # why tensor parallel is refused ("": it is not)
    no_tensor_parallel = "OLMo 2's and 3's q and k norms span every head, which tensor parallel splits"

    def __init__(self, hf_config: dict, dtype: torch.dtype, fp4: Callable[[str], bool] = lambda name: False,
                 tp: TPLayout = TPLayout()):
        if tp.sharded and self.no_tensor_parallel:
            raise ConfigError(f"parallel.tensor_parallel_size: {tp.size}: {self.no_tensor_parallel}; use 1")
        super().__init__(hf_config, dtype, fp4, tp)


class Olmo3(SlidingLayers, Olmo2):
    """Olmo3ForCausalLM: OLMo 2 with sliding-window layers (`config_forms.olmo3_form`)."""

    @staticmethod
    def args_from_hf(hf_config: dict) -> LlamaArgs:
        return LlamaArgs.from_hf(olmo3_form(with_defaults(hf_config))[0])

    def __init__(self, hf_config: dict, dtype: torch.dtype, fp4: Callable[[str], bool] = lambda name: False,
                 tp: TPLayout = TPLayout()):
        super().__init__(hf_config, dtype, fp4, tp)
        hf = with_defaults(hf_config)
        _, local, sliding = olmo3_form(hf)
        self.set_sliding(local, sliding, int(hf.get("sliding_window") or 0))  # checked where a layer slides


class Exaone4(Olmo2):
    """Exaone4ForCausalLM: OLMo 2's blocks with per-head q/k norms, windows and NoPE full layers (`exaone4_form`)."""

    no_tensor_parallel = ""  # its q / k norms are per head: a rank normalizes its own heads

    @staticmethod
    def args_from_hf(hf_config: dict) -> LlamaArgs:
        hf = with_defaults(hf_config)
        olmo2, _, sliding = exaone4_form(hf)
        return dataclasses.replace(LlamaArgs.from_hf(olmo2), qk_norm="heads",
                                   rope_layers=exaone4_rope_layers(hf, sliding))

    def __init__(self, hf_config: dict, dtype: torch.dtype, fp4: Callable[[str], bool] = lambda name: False,
                 tp: TPLayout = TPLayout()):
        super().__init__(hf_config, dtype, fp4, tp)
        hf = with_defaults(hf_config)
        _, _, sliding = exaone4_form(hf)
        self.windows = tuple(int(hf["sliding_window"]) if s else 0 for s in sliding)

    def facts(self, page_size: int) -> ModelFacts:
        return dataclasses.replace(super().facts(page_size), sliding_windows=self.windows)
