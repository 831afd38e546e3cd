"""DeepSeek-V3 family: multi-head latent attention (MLA) with yarn rope, and DeepSeek MoE.

MLA runs in the absorbed form in every mode: W_UK (the key half of kv_b_proj) is folded into the
query, the op attends over the latent cache [kv_lora_rank + qk_rope_head_dim] per token, and W_UV
(the value half) is applied to the latent output. kv_b_proj is therefore held as two float tensors;
an NVFP4 checkpoint's kv_b_proj is dequantized at load (the absorbed products need plain weights).

Shape legend: T tokens, H hidden, Nh heads, L kv_lora_rank, R qk_rope_head_dim, Dn qk_nope_head_dim,
Dv v_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pieceworks.backends import ops
from pieceworks.backends.base import ModelFacts
from pieceworks.errors import CheckpointError
from pieceworks.core.kv import KVLayout
from pieceworks.models import hf_config as hf_fields
from pieceworks.models.base import CausalLM, GatedMLP, RMSNorm, WeightSource, block_forward, linear, merged
from pieceworks.models.families import family, with_defaults
from pieceworks.models.moe import MoE
from pieceworks.models.rope import (
    apply_rope_qk,
    rope_parameters,
    yarn_softmax_scale,
)
from pieceworks.parallel.comm import reduce
from pieceworks.parallel.layout import TPLayout, require_divisible, require_fp4_block

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps


@dataclass(frozen=True)
class DeepseekV3Args:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_interleave: bool
    rope: dict
    scoring_func: str = "sigmoid"  # DeepSeek-V2's: softmax (greedy, or group_limited_greedy: groups by best score)
    mlp_layer_types: tuple[str, ...] = ()  # GLM-4.7-Flash's "dense" / "sparse" per layer, in place of DeepSeek's rule

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV3Args":
        """Read a DeepseekV3ForCausalLM (or DeepseekV2ForCausalLM: the same layers, softmax routing; or
        Glm4MoeLiteForCausalLM, GLM-4.7-Flash: DeepSeek-V3's layers, its MoE layers listed in `mlp_layer_types`)
        config.json dict (transformers' defaults for absent keys).

        Raises:
            CheckpointError: a missing, mistyped or inconsistent field (`hf_config.FieldError`, naming
                it), a null norm_topk_prob or rope_interleave (transformers reads it as false, pieceworks'
                default is true), or a variant pieceworks does not implement (biases, softmax routing, ...).
        """
        hf_fields.check(hf, "deepseek_v3")
        hf = with_defaults(hf)  # transformers' defaults of the family where they are not this class's
        v2 = hf.get("model_type") == "deepseek_v2" or "DeepseekV2ForCausalLM" in (hf.get("architectures") or [])
        for key in ("norm_topk_prob", "rope_interleave"):  # true when absent (V2 reads neither: see below)
            if not v2 and key in hf and hf[key] is None:
                raise CheckpointError(f"config.json: {key} is null; transformers reads null as false, pieceworks' "
                                      "default is true: write true or false")
        greedy = v2 and hf.get("topk_method", "greedy") == "greedy"  # routes without groups: n_group may be null
        for key in ("n_group", "num_experts_per_tok", "routed_scaling_factor", "first_k_dense_replace"):
            if key in hf and hf[key] is None and not (greedy and key == "n_group"):
                # absent is transformers' default; null is no number transformers takes
                raise CheckpointError(f"config.json: {key} is null, which transformers refuses too: write a number, "
                                      "or leave the key out for transformers' default")
        hf = {k: v for k, v in hf.items() if v is not None}  # null is absent, as check() reads it
        if hf.get("attention_bias", False):
            raise CheckpointError("config.json: attention_bias=true is not supported by pieceworks' DeepSeek-V3")
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported; DeepSeek-V3 uses silu")
        method = hf.get("topk_method", "greedy" if v2 else "noaux_tc")
        if v2 and method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"config.json: topk_method={method!r}: DeepSeek-V2 routes greedy or "
                                  "group_limited_greedy (softmax scores)")
        if not v2 and (hf.get("scoring_func", "sigmoid") != "sigmoid" or method != "noaux_tc"):
            raise CheckpointError(f"config.json: scoring_func={hf.get('scoring_func')!r}, topk_method="
                             f"{hf.get('topk_method')!r}: pieceworks implements DeepSeek-V3 routing (sigmoid scores, "
                             "noaux_tc grouped top-k) and DeepSeek-V2's (softmax, greedy or group_limited_greedy)")
        if v2 and hf.get("norm_topk_prob", False):  # no released V2 sets it
            raise CheckpointError("config.json: norm_topk_prob=true with DeepSeek-V2's routing is not supported "
                                  "(DeepSeek's code then renormalizes instead of scaling, transformers' port ignores "
                                  "it); the released DeepSeek-V2 models set false")
        experts, groups = hf.get("n_routed_experts") or 0, hf.get("n_group") or 1
        if v2 and method == "greedy":
            groups = 1  # greedy routing ignores the groups (hf_config.check lets them be any number)
        q_lora = hf.get("q_lora_rank")
        # GLM-4.7-Flash: transformers reads mlp_layer_types, else one dense layer first (its released config.json
        # writes first_k_dense_replace=1, which DeepSeek's rule reads the same)
        lite = family(hf) == "glm4_moe_lite"
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            moe_intermediate_size=hf.get("moe_intermediate_size", 0),
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            q_lora_rank=q_lora or None, kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"], n_routed_experts=experts,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 1, n_group=groups,
            topk_group=(hf.get("topk_group") or 1) if groups > 1 else 1,
            norm_topk_prob=bool(hf.get("norm_topk_prob", not v2)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=hf.get("first_k_dense_replace", 1 if lite else 0),
            moe_layer_freq=hf.get("moe_layer_freq") or 1,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            rope_interleave=True if v2 else hf.get("rope_interleave", True),  # transformers' V2 reads no such key
            rope=rope_parameters({"max_position_embeddings": 4096, **hf}),
            scoring_func="softmax" if v2 else "sigmoid",
            mlp_layer_types=tuple(hf.get("mlp_layer_types") or ()),
        )

    def check_parallel(self, tp: TPLayout, fp4: Callable[[str], bool]) -> None:
        """ConfigError unless `tp.size` ranks split this model: heads, vocabulary, dense and shared MLPs,
        and the routed experts (their intermediate columns, or whole experts under expert parallel)."""
        n = tp.size
        require_divisible("num_attention_heads", self.num_heads, n, "MLA heads split over the ranks")
        require_divisible("vocab_size", self.vocab_size, n, "vocab-parallel embedding and head")
        moe = [i for i in range(self.num_layers) if self.is_moe(i)]
        if len(moe) < self.num_layers:
            require_divisible("intermediate_size", self.intermediate_size, n, "dense MLP columns split over the ranks")
        if moe and self.n_shared_experts:
            require_divisible("moe_intermediate_size * n_shared_experts",
                              self.moe_intermediate_size * self.n_shared_experts, n, "shared experts' columns")
        if moe and tp.expert_parallel:
            require_divisible("n_routed_experts", self.n_routed_experts, n, "whole experts per rank")
        elif moe:
            require_divisible("moe_intermediate_size", self.moe_intermediate_size, n,
                              "each routed expert's columns split over the ranks")
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            if fp4(f"{p}.self_attn.o_proj"):
                require_fp4_block(f"{p}.self_attn.o_proj", self.num_heads * self.v_head_dim // n, n)
            if i in moe:
                if fp4(f"{p}.mlp.experts.0.down_proj") and not tp.expert_parallel:
                    require_fp4_block(f"{p}.mlp.experts.*.down_proj", self.moe_intermediate_size // n, n)
                if self.n_shared_experts and fp4(f"{p}.mlp.shared_experts.down_proj"):
                    require_fp4_block(f"{p}.mlp.shared_experts.down_proj",
                                      self.moe_intermediate_size * self.n_shared_experts // n, n)
            elif fp4(f"{p}.mlp.down_proj"):
                require_fp4_block(f"{p}.mlp.down_proj", self.intermediate_size // n, n)

    def is_moe(self, layer: int) -> bool:
        """The layer's kind in `mlp_layer_types` where the config lists them, else DeepSeek's rule: MoE from
        first_k_dense_replace on, every moe_layer_freq-th layer."""
        if self.mlp_layer_types:
            return bool(self.n_routed_experts) and self.mlp_layer_types[layer] == "sparse"
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed; attention is the `pieceworks::mla` op.

    Tensor parallel: this rank's Nh / N heads (q_b_proj or q_proj column-parallel, their slices of
    kv_b_proj, o_proj row-parallel with the output summed over the ranks); the low-rank q_a and kv_a
    projections and the latent KV cache are whole on every rank."""

    def __init__(self, a: DeepseekV3Args, layer_id: int, prefix: str, fp4: Callable[[str], bool],
                 tp: TPLayout = TPLayout()) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        self.num_heads, self.rank = a.num_heads // tp.size, a.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        self.scale = yarn_softmax_scale(a.rope, qk)
        self.q_lora = a.q_lora_rank is not None
        self.rope_interleave = bool(a.rope_interleave)
        # q_a_proj (or q_proj) and kv_a_proj_with_mqa both read x: one fused linear.
        nh = self.num_heads
        q_name, q_out, q_part = (("q_a_proj", a.q_lora_rank, None) if self.q_lora
                                 else ("q_proj", nh * qk, tp.split(0)))
        self.qkv_a_proj = merged(a.hidden_size, [q_out, a.kv_lora_rank + a.qk_rope_head_dim],
                                 [fp4(f"{prefix}.{q_name}"), fp4(f"{prefix}.kv_a_proj_with_mqa")], [q_part, None])
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linear(a.q_lora_rank, nh * qk, fp4(f"{prefix}.q_b_proj"), tp.split(0))
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, LATENT_NORM_EPS)
        self.register_buffer("w_uk", torch.empty(nh, a.qk_nope_head_dim, a.kv_lora_rank))
        self.register_buffer("w_uv_t", torch.empty(nh, a.kv_lora_rank, a.v_head_dim))
        self.o_proj = linear(nh * a.v_head_dim, a.hidden_size, fp4(f"{prefix}.o_proj"), tp.split(1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H], cos/sin [T, R/2] -> [T, H]."""
        q, kv = self.qkv_a_proj(x)
        if self.q_lora:  # model-wide: the same branch in every layer
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = kv.split([self.rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, L]
        # q_pe [T, Nh, R] and k_pe [T, R] roped in one launch
        q_pe, k_pe = apply_rope_qk(q_pe, k_pe.unsqueeze(1), cos, sin, self.rope_interleave)
        k_pe = k_pe.squeeze(1)
        # Absorb W_UK: q_nope [T, Nh, Dn] -> [T, Nh, L], made contiguous for the kernels (Dynamo
        # can't trace bmm into a transposed out=, which would save the copy).
        q_abs = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1).contiguous()
        out = torch.empty_like(q_abs)  # owned by the piece before the op: fixed address under graphs
        ops.mla(q_abs, q_pe, c_kv, k_pe, out, self.layer_id, self.scale)
        v = torch.bmm(out.transpose(0, 1), self.w_uv_t)  # [Nh, T, Dv]
        return reduce(self.o_proj(v.transpose(0, 1).reshape(-1, self.num_heads * self.v_dim)), self.tp)

    def load(self, src: WeightSource, prefix: str) -> None:
        q_name = "q_a_proj" if self.q_lora else "q_proj"
        self.qkv_a_proj = src.merged(self.qkv_a_proj, [f"{prefix}.{q_name}", f"{prefix}.kv_a_proj_with_mqa"])
        if self.q_lora:
            n = self.q_a_layernorm.weight.shape[0]
            self.q_a_layernorm.weight.copy_(src.tensor(f"{prefix}.q_a_layernorm.weight", (n,)))
            self.q_b_proj = src.linear(self.q_b_proj, f"{prefix}.q_b_proj")
        self.kv_a_layernorm.weight.copy_(src.tensor(f"{prefix}.kv_a_layernorm.weight", (self.rank,)))
        nh, dn, dv = self.num_heads, self.nope_dim, self.v_dim
        w = src.dense(f"{prefix}.kv_b_proj", self.rank, nh * (dn + dv), part=self.tp.split(0))
        w = w.view(nh, dn + dv, self.rank)
        self.w_uk.copy_(w[:, :dn])
        self.w_uv_t.copy_(w[:, dn:].transpose(1, 2))
        self.o_proj = src.linear(self.o_proj, f"{prefix}.o_proj")


class DeepseekV3Block(nn.Module):
    def __init__(self, a: DeepseekV3Args, layer_id: int, fp4: Callable[[str], bool], tp: TPLayout = TPLayout()) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_id}"
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MLAttention(a, layer_id, f"{prefix}.self_attn", fp4, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.is_moe(layer_id):
            self.mlp: nn.Module = MoE(a.hidden_size, a, f"{prefix}.mlp", fp4, tp)
        else:
            self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, f"{prefix}.mlp", fp4, tp)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return block_forward(self, h, residual, cos, sin)

    def load(self, src: WeightSource, prefix: str) -> None:
        n = self.input_layernorm.weight.shape[0]
        self.input_layernorm.weight.copy_(src.tensor(f"{prefix}.input_layernorm.weight", (n,)))
        self.post_attention_layernorm.weight.copy_(src.tensor(f"{prefix}.post_attention_layernorm.weight", (n,)))
        self.self_attn.load(src, f"{prefix}.self_attn")
        self.mlp.load(src, f"{prefix}.mlp")


class DeepseekV3(CausalLM):
    """DeepseekV3ForCausalLM and DeepseekV2ForCausalLM (MTP layers of the checkpoint are ignored). Build on the
    meta device and fill through `load_plan` (see loader.py).

    Args:
        hf_config: config.json as a dict.
        dtype: activation and weight dtype (the router stays float32).
        fp4: whether the linear with this HF module name is NVFP4.
        tp: the rank's shard (default: the whole model).

    Raises:
        ConfigError: `tp.size` ranks can't split the model (`DeepseekV3Args.check_parallel`).
    """

    arch = "deepseek_v3"

    def __init__(self, hf_config: dict, dtype: torch.dtype, fp4: Callable[[str], bool] = lambda name: False,
                 tp: TPLayout = TPLayout()):
        super().__init__()
        a = self.args = DeepseekV3Args.from_hf(hf_config)
        if tp.sharded:
            a.check_parallel(tp, fp4)
        self._build_trunk(hf_config, dtype, a, [DeepseekV3Block(a, i, fp4, tp) for i in range(a.num_layers)],
                          a.qk_rope_head_dim, tp)

    def kv_layout(self) -> KVLayout:
        return KVLayout("mla", self.args.num_layers, latent_dim=self.args.kv_lora_rank + self.args.qk_rope_head_dim)

    def facts(self, page_size: int) -> ModelFacts:
        a = self.args
        return ModelFacts(
            arch="deepseek_v3", dtype=self.dtype, num_heads=a.num_heads // self.tp.size, num_kv_heads=1,
            head_dim=a.qk_nope_head_dim + a.qk_rope_head_dim, kv_lora_rank=a.kv_lora_rank,
            qk_rope_head_dim=a.qk_rope_head_dim, page_size=page_size, fp4=self.has_fp4(), **self.moe_facts(),
        )

    def required_ops(self) -> set[str]:
        needed = {"mla"}
        if self.expert_blocks():
            needed.add("moe")
        if self.has_fp4():
            needed.add("fp4_gemm")
        return needed
