"""Llama 3.x family (Llama 3/3.1/3.2, SmolLM2): GQA, rope (default or llama3 scaling), SwiGLU.

Weights keep Hugging Face names; q/k/v and gate/up are fused into one linear each at load (bf16:
concatenated; NVFP4: fused when the parts share their global scales, else kept as separate linears).

Shape legend: T tokens, H hidden, Hq query heads, Hkv KV heads, D head size, V vocabulary.
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
from pieceworks.models.base import (CausalLM, GatedMLP, Prenormed, RMSNorm, WeightSource, block_forward, linear,
                                    merged)
from pieceworks.models.moe import MoE
from pieceworks.models.rope import apply_rope_qk, rope_parameters
from pieceworks.parallel.comm import reduce
from pieceworks.parallel.layout import (TPLayout, require_divisible, require_fp4_block, require_kv_heads)
from pieceworks.quant.linear import Fp4Linear
from pieceworks.models.families import FusedNames, family, is_mixtral, layer_windows, with_defaults
from pieceworks.quant.modelopt import mixtral_name


@dataclass(frozen=True)
class LlamaMoE:
    """Qwen2-MoE's, Qwen3-MoE's, Mixtral's and GLM-4.5's routed experts, named as `models.moe.MoE` reads them
    (softmax routing without groups, Qwen2-MoE's gated shared expert; GLM-4.5's DeepSeek-V3 routing and shared
    experts)."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one shared expert behind a sigmoid gate
    correction_bias: str = ""  # ERNIE 4.5: the checkpoint's [1, E] bias added to the softmax scores to choose


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: dict
    qk_norm: str | None = None  # before the rope, RMSNorms of q and k over each head ("heads", Qwen3: weights [D])
    # or over the whole projection ("full", OLMo 2: [Hq D] and [Hkv D])
    qkv_bias: bool = False  # Qwen2 (2.5), Qwen2-MoE, Seed-OSS: biases on q, k and v (not o)
    moe: "LlamaMoE | None" = None  # Qwen2-MoE, Qwen3-MoE, Mixtral: routed experts in `sparse_layers`
    sparse_layers: tuple[int, ...] = ()
    context_cap: tuple[int, str] | None = None  # a sliding window or longrope's original context (`hf_config`)
    rotary_dim: int = 0  # the rotated dimensions of each head: head_dim, or fewer (partial_rotary_factor)
    rope_layers: tuple[bool, ...] = ()  # per layer, whether it rotates q and k (`hf_config.rope_layers`)
    rope_interleaved: bool = False  # GLM-4: the rope rotates pairs (x0, x1), (x2, x3), ...
    sliding_windows: tuple[int, ...] = ()  # per layer, the keys a query sees (`families.layer_windows`; () all)

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaArgs":
        """Read a LlamaForCausalLM (or MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
        Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM and the families of
        `families`) config.json dict (transformers' defaults for absent keys).

        Raises:
            CheckpointError: a missing, mistyped or inconsistent field (`hf_config.FieldError`, naming
                it), or a feature pieceworks' Llama does not implement (biases, another activation).
        """
        hf_fields.check(hf, "llama")
        # null is absent, as check() reads it; the family's defaults where they are not Llama's
        hf = {k: v for k, v in with_defaults(hf).items() if v is not None}
        if hf.get("use_bias", False):
            raise CheckpointError("config.json: use_bias=true (ERNIE 4.5's biases on every projection) is not "
                                  "supported by pieceworks' Llama; the released ERNIE 4.5 models set false")
        seed = family(hf) in ("seed_oss", "glm4", "glm4_moe")  # their attention_bias is q/k/v's
        for key in ("mlp_bias", "attention_out_bias") if seed else ("attention_bias", "mlp_bias"):
            if hf.get(key, False):  # (Seed-OSS's attention_bias is q/k/v's: `qkv_bias`)
                raise CheckpointError(f"config.json: {key}=true is not supported by pieceworks' Llama (bias-free "
                                 "projections only, but Qwen2's and Seed-OSS's q/k/v)")
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported; Llama uses silu")
        heads = hf["num_attention_heads"]
        archs = hf.get("architectures") or []
        moe, sparse = None, ()
        qwen2_moe = hf.get("model_type") == "qwen2_moe" or "Qwen2MoeForCausalLM" in archs
        if qwen2_moe or hf.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in archs:
            experts = hf.get("num_experts", hf.get("num_local_experts", 60 if qwen2_moe else 128))
            moe = LlamaMoE(experts, hf.get("num_experts_per_tok", 4 if qwen2_moe else 8),
                           hf.get("moe_intermediate_size", 1408 if qwen2_moe else 768), hf.get("norm_topk_prob", False),
                           shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 5632)
                           if qwen2_moe else 0)
            step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
            sparse = tuple(i for i in range(hf["num_hidden_layers"])
                           if i not in dense and moe.n_routed_experts > 0 and (i + 1) % step == 0)
        elif family(hf) == "ernie4_5_moe":  # softmax scores, chosen with a correction bias, renormalized
            moe = LlamaMoE(hf.get("moe_num_experts", 64), hf.get("moe_k", 6), hf.get("moe_intermediate_size", 1536),
                           True, n_shared_experts=hf.get("moe_num_shared_experts", 2),
                           correction_bias="moe_statics.e_score_correction_bias")
            n, every = hf["num_hidden_layers"], hf.get("moe_layer_interval", 1)
            first, last = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_end_index", -1)
            last = n - 1 if last == -1 else last
            sparse = tuple(i for i in range(n) if moe.n_routed_experts > 0 and (i + 1) % every == 0
                           and first <= i <= last)
        elif family(hf) == "glm4_moe":  # DeepSeek-V3's sigmoid routing and shared experts after dense layers
            moe = LlamaMoE(hf.get("n_routed_experts", 128), hf.get("num_experts_per_tok", 8),
                           hf.get("moe_intermediate_size", 1408), hf.get("norm_topk_prob", True), "sigmoid",
                           hf.get("n_group", 1), hf.get("topk_group", 1), hf.get("routed_scaling_factor", 1.0),
                           hf.get("n_shared_experts", 1))
            sparse = tuple(range(hf.get("first_k_dense_replace", 1), hf["num_hidden_layers"])
                           if moe.n_routed_experts > 0 else ())
        elif is_mixtral(hf):  # every layer's MLP is experts of intermediate_size, top-k renormalized
            moe = LlamaMoE(hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2), hf["intermediate_size"],
                           True)
            sparse = tuple(range(hf["num_hidden_layers"])) if moe.n_routed_experts > 0 else ()
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            rope=rope_parameters({"max_position_embeddings": 2048, **hf}),
            qk_norm=("heads" if hf.get("model_type") in ("qwen3", "qwen3_moe") or "Qwen3ForCausalLM" in archs
                     or "Qwen3MoeForCausalLM" in archs or hf.get("use_qk_norm", False)
                     else "full" if family(hf) == "olmo2" else None),
            qkv_bias=(hf.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in archs
                      or (qwen2_moe and hf.get("qkv_bias", True))
                      or (seed and hf.get("attention_bias", family(hf) != "glm4_moe"))),
            moe=moe, sparse_layers=sparse, context_cap=hf_fields.context_cap(hf), rotary_dim=hf_fields.rotary_dim(hf),
            rope_layers=hf_fields.rope_layers(hf),
            rope_interleaved=family(hf) in ("glm4", "ernie4_5", "ernie4_5_moe"),
            sliding_windows=layer_windows(hf, hf["num_hidden_layers"]),
        )

    def check_parallel(self, tp: TPLayout, fp4: Callable[[str], bool]) -> None:
        """ConfigError unless `tp.size` ranks split this model (heads, KV heads, MLP, vocabulary)."""
        n = tp.size
        require_divisible("num_attention_heads", self.num_heads, n, "query heads split over the ranks")
        require_kv_heads(self.num_kv_heads, n)
        if len(self.sparse_layers) < self.num_layers:
            require_divisible("intermediate_size", self.intermediate_size, n, "MLP columns split over the ranks")
        require_divisible("vocab_size", self.vocab_size, n, "vocab-parallel embedding and head")
        if self.moe and self.sparse_layers and tp.expert_parallel:
            require_divisible("num_experts", self.moe.n_routed_experts, n, "whole experts per rank")
        elif self.moe and self.sparse_layers:
            require_divisible("moe_intermediate_size", self.moe.moe_intermediate_size, n,
                              "each routed expert's columns split over the ranks")
        if self.moe and self.sparse_layers and self.moe.n_shared_experts:
            require_divisible("moe_intermediate_size", self.moe.moe_intermediate_size, n,
                              "the shared experts' columns split over the ranks")
        if self.moe and self.sparse_layers and self.moe.shared_expert_intermediate_size:
            require_divisible("shared_expert_intermediate_size", self.moe.shared_expert_intermediate_size, n,
                              "the shared expert's columns split over the ranks")
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            if fp4(f"{p}.self_attn.o_proj"):
                require_fp4_block(f"{p}.self_attn.o_proj", self.num_heads * self.head_dim // n, n)
            if i in self.sparse_layers:
                if fp4(f"{p}.mlp.experts.0.down_proj") and not tp.expert_parallel:
                    require_fp4_block(f"{p}.mlp.experts.*.down_proj", self.moe.moe_intermediate_size // n, n)
                if self.moe.n_shared_experts and fp4(f"{p}.mlp.shared_experts.down_proj"):
                    require_fp4_block(f"{p}.mlp.shared_experts.down_proj",
                                      self.moe.moe_intermediate_size * self.moe.n_shared_experts // n, n)
                if self.moe.shared_expert_intermediate_size and fp4(f"{p}.mlp.shared_expert.down_proj"):
                    require_fp4_block(f"{p}.mlp.shared_expert.down_proj",
                                      self.moe.shared_expert_intermediate_size // n, n)
            elif fp4(f"{p}.mlp.down_proj"):
                require_fp4_block(f"{p}.mlp.down_proj", self.intermediate_size // n, n)


class LlamaAttention(nn.Module):
    """GQA with rope; the attention itself is the `pieceworks::attention` op over the paged cache.

    Tensor parallel: this rank's Hq / N query heads and the KV heads they read (Hkv / N, or one shared
    head when Hkv < N) in q/k/v (column-parallel); o_proj row-parallel, its output summed over the ranks."""

    def __init__(self, a: LlamaArgs, layer_id: int, prefix: str, fp4: Callable[[str], bool],
                 tp: TPLayout = TPLayout()) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        self.num_heads, self.head_dim, self.rotary_dim = a.num_heads // tp.size, a.head_dim, a.rotary_dim
        self.rope, self.interleaved = a.rope_layers[layer_id], a.rope_interleaved  # SmolLM3's NoPE layers: False
        self.num_kv_heads = tp.local_kv_heads(a.num_kv_heads)
        self.scale = a.head_dim**-0.5
        q, kv = self.num_heads * a.head_dim, self.num_kv_heads * a.head_dim
        kv_part = tp.kv_split(a.num_kv_heads)
        self._qkv_parts = [tp.split(0), kv_part, kv_part]
        self.qkv_proj = merged(a.hidden_size, [q, kv, kv], [fp4(f"{prefix}.{n}_proj") for n in "qkv"],
                               self._qkv_parts)
        # Qwen2's q/k/v biases, this rank's rows (as the projection's)
        self.qkv_bias = nn.Parameter(torch.zeros(q + 2 * kv)) if a.qkv_bias else None
        self.o_proj = linear(q, a.hidden_size, fp4(f"{prefix}.o_proj"), tp.split(1))
        # Qwen3's per-head norms (shared by the heads, whole on every rank), OLMo 2's over the projections
        self._qk_norm_widths = (q, kv) if a.qk_norm == "full" else (a.head_dim, a.head_dim)
        self.q_norm, self.k_norm = ((RMSNorm(self._qk_norm_widths[0], a.rms_norm_eps),
                                     RMSNorm(self._qk_norm_widths[1], a.rms_norm_eps)) if a.qk_norm else (None, None))
        self._mark_qkv()

    def _mark_qkv(self) -> None:
        # One NVFP4 linear for q, k and v: its backend may fuse the rope (Fp4Linear.qkv_heads), unless q and k
        # take a bias or a norm between the projection and the rope.
        proj = getattr(self.qkv_proj, "proj", None)
        self._qkv_fp4 = isinstance(proj, Fp4Linear)  # decided here; `rope_fused` comes with prepare()
        if (self._qkv_fp4 and self.q_norm is None and self.qkv_bias is None and self.rotary_dim == self.head_dim
                and self.rope and not self.interleaved):
            proj.qkv_heads = (self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H], cos/sin [T, D/2] -> [T, H]."""
        if self._qkv_fp4 and self.qkv_proj.proj.rope_fused:  # the prepared weight is the fused op's
            out = self.attend_roped(self.qkv_proj.proj.forward_qkv_rope(x, cos, sin))
        else:
            q, k, v = self.qkv_proj(x)
            d = self.head_dim
            if self.qkv_bias is not None:
                bq, bk, bv = self.qkv_bias.split([q.shape[-1], k.shape[-1], v.shape[-1]])
                q, k, v = q + bq, k + bk, v + bv
            if self.q_norm is not None:  # over each head's D values (rows of [T * heads, D]) or each token's
                wq, wk = self._qk_norm_widths
                q, k = self.q_norm(q.reshape(-1, wq)), self.k_norm(k.reshape(-1, wk))
            q, k = q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d)
            if self.rope and self.rotary_dim == d:  # (SmolLM3's NoPE layers skip both)
                q, k = apply_rope_qk(q, k, cos, sin, self.interleaved)
            elif self.rope:  # Phi-4-mini: the first rotary_dim dimensions of each head rotate, the rest pass
                r = self.rotary_dim
                qr, kr = apply_rope_qk(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin, self.interleaved)
                q, k = torch.cat([qr, q[..., r:]], -1), torch.cat([kr, k[..., r:]], -1)
            out = self._attend(q, k, v)
        return reduce(self.o_proj(out), self.tp)

    def attend_roped(self, qkv: torch.Tensor) -> torch.Tensor:
        """The attention of roped q/k/v columns [T, (Hq + 2 Hkv) D] -> [T, Hq D] (before o_proj)."""
        q_cols, kv_cols = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_cols, kv_cols, kv_cols], dim=-1)
        return self._attend(q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim), v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)  # owned by the piece before the op: fixed address under graphs
        ops.attention(q, k, v, out, self.layer_id, self.scale)
        return out.view(-1, self.num_heads * self.head_dim)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.qkv_proj = src.merged(self.qkv_proj, [f"{prefix}.{n}_proj" for n in "qkv"])
        self.o_proj = src.linear(self.o_proj, f"{prefix}.o_proj")
        for name, norm in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            if norm is not None:
                norm.weight.copy_(src.tensor(f"{prefix}.{name}.weight", tuple(norm.weight.shape)))
        if self.qkv_bias is not None:
            sizes = [self.num_heads * self.head_dim] + 2 * [self.num_kv_heads * self.head_dim]
            for n, part, b in zip("qkv", self._qkv_parts, self.qkv_bias.data.split(sizes)):
                b.copy_(src.tensor(f"{prefix}.{n}_proj.bias", (b.numel(),), part=part))
        self._mark_qkv()


class LlamaBlock(nn.Module):
    def __init__(self, a: LlamaArgs, layer_id: int, fp4: Callable[[str], bool], tp: TPLayout = TPLayout()) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_id}"
        self.sharded = tp.sharded
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = LlamaAttention(a, layer_id, f"{prefix}.self_attn", fp4, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = (MoE(a.hidden_size, a.moe, f"{prefix}.mlp", fp4, tp) if layer_id in a.sparse_layers
                    else GatedMLP(a.hidden_size, a.intermediate_size, f"{prefix}.mlp", fp4, tp))
        # the next block's input_layernorm, set by the model (a tuple: not a submodule of this block); with
        # the norms fused, the down projection prepares that norm's inputs
        self.next_norm: tuple[RMSNorm] | None = None

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.norms_fused():
            return self._forward_fused_norms(h, residual, cos, sin)
        return block_forward(self, h, residual, cos, sin)

    def norms_fused(self) -> bool:
        """Whether this block's NVFP4 projections were prepared by an fp4_gemm backend that fuses the
        RMSNorms and residual adds into them (`Fp4GemmBackend.fuses_norm`; the q/k/v one with the rope
        fused, gate/up with the SwiGLU): the block then runs `_forward_fused_norms`. Never in a tensor-parallel
        shard: its o and down outputs are partial sums, to be all-reduced before the residual add."""
        a, m = self.self_attn, self.mlp
        return (not self.sharded and a._qkv_fp4 and a.qkv_proj.proj.rope_fused and a.qkv_proj.proj.fuses_norm
                and isinstance(m, GatedMLP) and m._swiglu and m.gate_up_proj.proj.fuses_norm
                and isinstance(a.o_proj, Fp4Linear) and a.o_proj.fuses_norm
                and isinstance(m.down_proj, Fp4Linear) and m.down_proj.fuses_norm)

    def _forward_fused_norms(self, h: torch.Tensor, residual: torch.Tensor | Prenormed | None, cos: torch.Tensor,
                             sin: torch.Tensor) -> tuple[torch.Tensor, Prenormed | None]:
        """The block on the residual stream s with no norm kernels (but in the first block): q/k/v of
        RMSNorm(s), s += o_proj(attention) with the post-attention norm's inputs prepared in the same GEMM,
        SwiGLU of RMSNorm(s), s += down(...) with the next block's input norm prepared (`fp4_gemm_add_norm`).
        Returns (s, `Prenormed`), or (s, None) from the last block: h is the whole stream
        (`CausalLM.forward` and the next block take it as such)."""
        a, m = self.self_attn, self.mlp
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        qkv = a.qkv_proj.proj
        if isinstance(residual, Prenormed):
            s = h
            y = qkv.forward_norm_qkv_rope(s, residual.t, residual.partials, n1.weight, n1.eps, cos, sin)
        else:  # first block (or after an unfused one): the norm op
            x, s = (n1(h), h) if residual is None else n1(h, residual)
            y = qkv.forward_qkv_rope(x, cos, sin)
        s, t, partials = a.o_proj.forward_add_norm(a.attend_roped(y), s, n2.weight)
        y = m.gate_up_proj.proj.forward_norm_swiglu(s, t, partials, n2.weight, n2.eps)
        if self.next_norm is None:
            return m.down_proj.forward_add(y, s), None
        s, t, partials = m.down_proj.forward_add_norm(y, s, self.next_norm[0].weight)
        return s, Prenormed(t, partials)

    def load(self, src: WeightSource, prefix: str) -> None:
        a, n = self.self_attn, self.input_layernorm.weight.shape[0]
        self.input_layernorm.weight.copy_(src.tensor(f"{prefix}.input_layernorm.weight", (n,)))
        self.post_attention_layernorm.weight.copy_(src.tensor(f"{prefix}.post_attention_layernorm.weight", (n,)))
        a.load(src, f"{prefix}.self_attn")
        self.mlp.load(src, f"{prefix}.mlp")


class Llama(CausalLM):
    """LlamaForCausalLM. Build on the meta device and fill through `load_plan` (see loader.py).

    Args:
        hf_config: config.json as a dict.
        dtype: activation and weight dtype.
        fp4: whether the linear with this HF module name (`model.layers.0.self_attn.q_proj`) is NVFP4.
        tp: the rank's shard (default: the whole model).

    Raises:
        ConfigError: `tp.size` ranks can't split the model (`LlamaArgs.check_parallel`).
    """

    arch = "llama"
    block: type[LlamaBlock] = LlamaBlock  # Granite's scales its outputs

    @staticmethod
    def checkpoint_names(hf_config: dict) -> Callable[[str], str] | None:
        """How the checkpoint names this model's tensors where not as the model does (Mixtral's, Phi-3's, GLM-4's),
        else None."""
        return mixtral_name if is_mixtral(hf_config) else FusedNames.of(hf_config)

    def __init__(self, hf_config: dict, dtype: torch.dtype, fp4: Callable[[str], bool] = lambda name: False,
                 tp: TPLayout = TPLayout()):
        super().__init__()
        a = self.args = self.args_from_hf(hf_config)
        self.context_cap = a.context_cap
        if tp.sharded:
            a.check_parallel(tp, fp4)
        self._build_trunk(hf_config, dtype, a, [self.block(a, i, fp4, tp) for i in range(a.num_layers)],
                          a.rotary_dim, tp)
        for block, nxt in zip(self.layers, list(self.layers)[1:]):
            block.next_norm = (nxt.input_layernorm,)

    @staticmethod
    def args_from_hf(hf_config: dict) -> LlamaArgs:
        return LlamaArgs.from_hf(hf_config)

    def kv_layout(self) -> KVLayout:
        """This rank's KV heads (all of them at tensor-parallel size 1)."""
        return KVLayout("gqa", self.args.num_layers, num_kv_heads=self.tp.local_kv_heads(self.args.num_kv_heads),
                        head_dim=self.args.head_dim)

    def facts(self, page_size: int) -> ModelFacts:
        """The rank's shard as the backends see it (its heads)."""
        a, tp = self.args, self.tp
        return ModelFacts(arch="llama", dtype=self.dtype, num_heads=a.num_heads // tp.size,
                          num_kv_heads=tp.local_kv_heads(a.num_kv_heads),
                          head_dim=a.head_dim, page_size=page_size, fp4=self.has_fp4(),
                          sliding_windows=a.sliding_windows, **self.moe_facts())

    def required_ops(self) -> set[str]:
        return ({"attention"} | ({"fp4_gemm"} if self.has_fp4() else set())
                | ({"moe"} if self.args.sparse_layers else set()))
