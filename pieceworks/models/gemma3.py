"""Gemma3ForCausalLM (Gemma 3 1B, and Gemma 3's text models) and Gemma2ForCausalLM: Llama's projections in a
sandwich block as transformers' Gemma runs it, with

- sliding-window attention in most layers (`layer_types`, or every `sliding_window_pattern`-th layer full, Gemma 2's
  every other one): each query sees itself and the `sliding_window` - 1 keys before it (`ModelFacts.sliding_windows`;
  attention backends that declare `windows` serve it), and Gemma 3's rotate with their own rope
  (`rope_local_base_freq`);
- Gemma 3's q and k normalized per head before the rope; the attention scaled by `query_pre_attn_scalar` ** -0.5;
  Gemma 2's attention scores soft-capped (cap * tanh(x / cap): `attn_logit_softcapping`; a Gemma 3 config's is
  ignored, as transformers' Gemma3Attention ignores it) and both models' logits (`final_logit_softcapping`);
- RMSNorms that multiply by 1 + weight (the loader adds the 1: the model's norms multiply by their weight; in bf16
  the sum is rounded to bf16 where transformers keeps it float32), the embeddings times sqrt(hidden_size) rounded to
  the model dtype, and GeGLU (gelu with the tanh approximation) in the MLP, on the unfused path.

Bidirectional attention is refused (`config_forms.gemma_form`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from pieceworks.backends.base import ModelFacts
from pieceworks.models.config_forms import gemma_form
from pieceworks.models.base import GatedMLP, WeightSource
from pieceworks.models.glm4 import SandwichBlock
from pieceworks.models.llama import Llama, LlamaArgs
from pieceworks.models.families import family, with_defaults
from pieceworks.models.sliding import SlidingLayers
from pieceworks.parallel.comm import reduce
from pieceworks.parallel.layout import TPLayout

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GegluMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)): gate and up one projection with two outputs (no SwiGLU epilogue)."""

    def _mark_gate_up(self) -> None:
        self._swiglu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up), self.tp)


class Gemma3Block(SandwichBlock):
    norms = NORMS

    def __init__(self, a: LlamaArgs, layer_id: int, fp4: Callable[[str], bool], tp: TPLayout = TPLayout()) -> None:
        super().__init__(a, layer_id, fp4, tp)
        self.mlp = GegluMLP(a.hidden_size, a.intermediate_size, f"model.layers.{layer_id}.mlp", fp4, tp)
        self.sliding = False  # set by the model: this layer's attention slides (and takes the local rope)

    def load(self, src: WeightSource, prefix: str) -> None:
        a = self.self_attn
        n = self.input_layernorm.weight.shape[0]
        for name in NORMS:
            getattr(self, name).weight.copy_(src.tensor(f"{prefix}.{name}.weight", (n,)) + 1)
        a.load(src, f"{prefix}.self_attn")
        if a.q_norm is not None:  # Gemma 3's
            for norm in (a.q_norm, a.k_norm):
                norm.weight.add_(1)
        self.mlp.load(src, f"{prefix}.mlp")


class Gemma3(SlidingLayers, Llama):
    """Gemma3ForCausalLM and Gemma2ForCausalLM; `windows` holds each layer's sliding window (0: full attention)."""

    block = Gemma3Block

    @staticmethod
    def args_from_hf(hf_config: dict) -> LlamaArgs:
        """Llama's arguments of the config's Llama form (`config_forms.gemma_form`), with Qwen3's per-head q/k norms
        (Gemma 3's; Gemma 2 has none)."""
        hf = with_defaults(hf_config)
        llama, _, _ = gemma_form(hf)
        args = LlamaArgs.from_hf({**llama, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        return dataclasses.replace(args, qk_norm=None if family(hf) == "gemma2" else "heads")

    def __init__(self, hf_config: dict, dtype: torch.dtype, fp4: Callable[[str], bool] = lambda name: False,
                 tp: TPLayout = TPLayout()):
        super().__init__(hf_config, dtype, fp4, tp)
        hf = with_defaults(hf_config)
        _, local, sliding = gemma_form(hf)
        self.set_sliding(local, sliding, int(hf.get("sliding_window") or 0))  # checked where a layer slides
        scale = float(hf["query_pre_attn_scalar"]) ** -0.5
        for block in self.layers:
            block.self_attn.scale = scale
        a = self.args
        # sqrt(hidden_size) rounded to the model dtype, as transformers scales the embeddings
        self.normalizer = float(torch.tensor(a.hidden_size**0.5, dtype=dtype, device="cpu"))
        # Gemma 2's soft-capping of the attention scores and of the logits (0: none). Gemma 3's configs may carry an
        # attn_logit_softcapping that transformers' Gemma3Attention never applies: it is not applied here either.
        self.attn_softcap = float(hf.get("attn_logit_softcapping") or 0.0) if family(hf) == "gemma2" else 0.0
        self.logit_softcap = float(hf.get("final_logit_softcapping") or 0.0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    def facts(self, page_size: int) -> ModelFacts:
        return dataclasses.replace(super().facts(page_size), attn_logit_softcap=self.attn_softcap)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.logit_softcap:
            return torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def load_plan(self):
        """SlidingLayers', with the final norm's weight plus 1."""
        plan = super().load_plan()
        i = next(k for k, (label, _, _) in enumerate(plan) if label == "norm")
        plan[i] = ("norm", self.norm, lambda src: self.norm.weight.copy_(
            src.tensor("model.norm.weight", tuple(self.norm.weight.shape)) + 1))
        return plan
