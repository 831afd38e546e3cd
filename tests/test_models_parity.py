"""pieceworks' Llama-family and DeepSeek-V3-family models (each architecture models/architectures.ARCHITECTURES names)
against transformers, through the Executor, in float32.

Each case is a tiny random transformers model saved with save_pretrained. Per-position logits of
`score()` match within 1e-4 relative (max |diff| / max |ref|), also when the prompt is prefilled in
3 chunks; greedy `generate()` for two prompts of unequal lengths (so steps mix prefill and decode)
gives the tokens of a cache-free greedy loop over transformers. NVFP4: ModelOpt's exports of tiny
models match transformers holding the export's weights dequantized (w4a16 numerics).
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pieceworks import Executor
from pieceworks.executor.scheduler import score as score_chunked
from pieceworks.models.base import SplitProj
from pieceworks.models.checkpoint import CheckpointReader
from pieceworks.quant import nvfp4
from pieceworks.quant.modelopt import read_fp4_linear

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

RTOL = 1e-4
VOCAB = 256

LLAMA_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
DEEPSEEK_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                     num_experts_per_tok=2, routed_scaling_factor=2.5, max_position_embeddings=256)
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
MIXTRAL_PROJ = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
YARN = dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=64,
            rope_theta=10000.0)

CASES = {
    # llama3 rope scaling (original context short enough that every band is exercised), tied head, GQA
    "llama_llama3_rope_tied": ("llama", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32, rope_theta=500000.0))),
    # default rope, separate head, head_dim != hidden / heads
    "llama_default_rope_head_dim": ("llama", dict(tie_word_embeddings=False, head_dim=32)),
    # MistralForCausalLM without a sliding window (Mistral 7B v0.2 on, Mistral Small, Nemo's head_dim)
    "mistral_no_window": ("mistral", dict(sliding_window=None, head_dim=32, rope_theta=1e6)),
    # Glm4ForCausalLM: q/k/v biases, interleaved rope over half of each head, fused gate/up, sandwich norms
    "glm4": ("glm4", dict(head_dim=32, partial_rotary_factor=0.5, rope_theta=1e4)),
    # Glm4MoeForCausalLM (GLM-4.5's form): q/k/v biases, half-head rope, a dense first layer, sigmoid-routed experts
    # with a correction bias, scaled and renormalized top-k, one shared expert, a multi-token-prediction layer
    "glm4_moe": ("glm4_moe", dict(head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5,
                                  attention_bias=True, rope_theta=1e6)),
    # GLM-4.5 (355B)'s: q/k norms per head, 2 groups keep 1, raw top-k
    "glm4_moe_qk_norm": ("glm4_moe", dict(head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, n_group=2, topk_group=1, use_qk_norm=True,
                                          norm_topk_prob=False, attention_bias=True)),
    # Ernie4_5ForCausalLM: an interleaved rope, head_dim 128 by default (not hidden / heads), tied head by default
    "ernie4_5": ("ernie4_5", dict(head_dim=32)),
    # Ernie4_5_MoeForCausalLM: softmax scores chosen with a correction bias, renormalized, two shared experts, MoE
    # layers 1..2 of 4 (start and end indices)
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                                          moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=2,
                                          num_hidden_layers=4, tie_word_embeddings=False)),
    # Gemma3ForCausalLM: 8-token sliding windows in 3 of every 4 layers (their own rope base), linear rope scaling in
    # the full layers, per-head q/k norms, query_pre_attn_scalar, GeGLU, sandwich norms, a scaled embedding
    "gemma3": ("gemma3_text", dict(head_dim=32, sliding_window=8, num_hidden_layers=4, query_pre_attn_scalar=24,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0,
                                                                            rope_theta=1e6),
                                                        sliding_attention=dict(rope_type="default", rope_theta=1e4)))),
    # Gemma2ForCausalLM: soft-capped attention scores and logits, 8-token windows in every other layer, no q/k norms;
    # the caps low enough to bend this tiny model's small scores (at 2, dropping the attention's cap passed)
    "gemma2": ("gemma2", dict(head_dim=32, sliding_window=8, num_hidden_layers=4, query_pre_attn_scalar=24,
                              attn_logit_softcapping=0.01, final_logit_softcapping=1.0, rope_theta=1e4)),
    # SeedOssForCausalLM: q/k/v biases (attention_bias), none on o (attention_out_bias)
    "seed_oss": ("seed_oss", dict(head_dim=32, rope_theta=1e7)),
    # Olmo2ForCausalLM: post-norm blocks, q and k normalized over the whole projection, GQA
    "olmo2": ("olmo2", dict(rope_theta=5e5, tie_word_embeddings=False)),
    # Olmo3ForCausalLM: OLMo 2's blocks, 8-token windows in 3 of every 4 layers (the default pattern) rotating at the
    # default 500000, the full layer's rope at 10000 with yarn (the released form: rope_theta and rope_scaling)
    "olmo3": ("olmo3", dict(num_hidden_layers=4, sliding_window=8, rope_theta=1e4, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    # Exaone4ForCausalLM: OLMo 2's post-norm blocks with q/k norms per head, 8-token windows in 3 of every 4 layers
    # (the default pattern), the full layer without rope; EXAONE 4.0 32B's llama3 rope scaling
    "exaone4": ("exaone4", dict(num_hidden_layers=4, sliding_window=8, rope_theta=2e4, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64))),
    # and without a window: every layer full, every one rotating (layer types as transformers needs them then)
    "exaone4_no_window": ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 2)),
    # OLMo 3 in transformers 5's form: each kind's rope, explicit layer types
    "olmo3_layer_types": ("olmo3", dict(num_hidden_layers=3, sliding_window=6, layer_types=[
        "full_attention", "sliding_attention", "sliding_attention"], rope_parameters=dict(
            full_attention=dict(rope_type="default", rope_theta=2e4),
            sliding_attention=dict(rope_type="default", rope_theta=3e3)))),
    # SmolLM3ForCausalLM: NoPE layers (every 4th of SmolLM3-3B's; here every 2nd, from the interval), tied head
    "smollm3_nope_interval": ("smollm3", dict(no_rope_layer_interval=2, rope_theta=5e6, tie_word_embeddings=True,
                                              num_hidden_layers=4)),
    # and an explicit list, the first layer without rope
    "smollm3_nope_list": ("smollm3", dict(no_rope_layers=[0, 1, 1], num_hidden_layers=3)),
    # GraniteForCausalLM: Granite 3-style scalars (embedding 12, residual 0.22, attention 1/128, logits 16), tied head
    "granite": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                                logits_scaling=16.0, tie_word_embeddings=True, rope_theta=1e7)),
    # Mistral 7B v0.1's sliding window, here 48 tokens: the context it caps holds every sequence below
    "mistral_window": ("mistral", dict(sliding_window=48)),
    # Qwen2ForCausalLM: q/k/v biases; yarn as Qwen2.5's long-context configs add it (its attention factor too)
    "qwen2_qkv_bias_yarn": ("qwen2", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=1e6))),
    # use_sliding_window: transformers 5 lists the sliding layers in layer_types (Qwen2's from max_window_layers on,
    # Qwen2-MoE's odd ones below it); full attention, equal while a sequence fits the window, which caps the context
    "qwen2_sliding_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
    "qwen2_moe_sliding_layers": ("qwen2_moe", dict(QWEN3_MOE, shared_expert_intermediate_size=48,
                                                   use_sliding_window=True, sliding_window=64, max_window_layers=2)),
    # Qwen3MoeForCausalLM: softmax-routed experts (renormalized, and not), a dense first layer
    "qwen3_moe_norm_topk": ("qwen3_moe", dict(head_dim=32, norm_topk_prob=True, mlp_only_layers=[0],
                                              num_hidden_layers=3)),
    "qwen3_moe_raw_topk": ("qwen3_moe", dict(head_dim=32, norm_topk_prob=False, decoder_sparse_step=1)),
    # Qwen2MoeForCausalLM: q/k/v biases, softmax-routed experts (raw top-k) and a gated shared expert, a dense layer
    "qwen2_moe": ("qwen2_moe", dict(QWEN3_MOE, shared_expert_intermediate_size=48, norm_topk_prob=False,
                                    mlp_only_layers=[1], num_hidden_layers=3)),
    # Phi3ForCausalLM: q/k/v and gate/up fused in the checkpoint (read as row slices), GQA, Phi-3-mini-4k's sliding
    # window in every layer (here 12 tokens)
    "phi3": ("phi3", dict(rope_theta=250000.0, pad_token_id=None, eos_token_id=2, sliding_window=12)),
    # Phi-3.5-mini's longrope (short factors within the original context, which caps the executor's: 64 here)
    "phi3_longrope": ("phi3", dict(pad_token_id=None, eos_token_id=2, original_max_position_embeddings=64, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0]))),
    # Phi-4-mini's: longrope over the 12 of 16 dimensions its partial_rotary_factor rotates, the rest passed
    "phi4_mini_partial": ("phi3", dict(pad_token_id=None, eos_token_id=2, original_max_position_embeddings=64,
                                       partial_rotary_factor=0.75,
                                       rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                                                         long_factor=[2.0] * 6))),
    # MixtralForCausalLM: experts of intermediate_size in every layer, top-2 renormalized, w1 / w3 / w2 names
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None)),
    # Qwen3ForCausalLM: q/k RMSNorm per head before the rope, tied head
    "qwen3_qk_norm": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    # q_proj (no q LoRA), yarn with mscale != mscale_all_dim, 4 groups keep 2, one shared expert
    "deepseek_no_q_lora": ("deepseek_v3", dict(q_lora_rank=None, n_group=4, topk_group=2, n_shared_experts=1,
                                               first_k_dense_replace=1, rope_parameters=YARN)),
    # no shared expert: transformers still saves one of intermediate size 0 (zero-size tensors, read by no one)
    "deepseek_no_shared": ("deepseek_v3", dict(n_group=2, topk_group=1, n_shared_experts=0,
                                               first_k_dense_replace=1)),
    # DeepseekV2ForCausalLM (V2-Lite's form): softmax top-k, no renormalization, scaled; no q LoRA
    "deepseek_v2_greedy": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2,
                                               first_k_dense_replace=1, routed_scaling_factor=1.0,
                                               rope_parameters=YARN)),
    # V2's group_limited_greedy: 4 groups ranked by their best softmax score, 2 kept, top 3 of their 4; q LoRA
    "deepseek_v2_groups": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                                               topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
                                               first_k_dense_replace=1)),
    # Glm4MoeLiteForCausalLM (GLM-4.7-Flash's form): MLA with q LoRA and qk_nope / v head sizes of their own, the MoE
    # layers listed (dense, sparse, dense, sparse), 2 groups keep 1, one shared expert, scaled by 1.8
    "glm4_moe_lite": ("glm4_moe_lite", dict(q_lora_rank=24, qk_nope_head_dim=24, v_head_dim=20, n_group=2,
                                            topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8,
                                            num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"],
                                            rope_theta=1e6)),
    # q LoRA, 2 groups keep 1, two shared experts, two dense layers, non-interleaved rope
    "deepseek_q_lora": ("deepseek_v3", dict(q_lora_rank=24, n_group=2, topk_group=1, n_shared_experts=2,
                                            first_k_dense_replace=2, num_hidden_layers=4, norm_topk_prob=False,
                                            rope_interleave=False, rope_parameters=YARN)),
}


def _routers(model: torch.nn.Module, std: float) -> torch.nn.Module:
    """Routers sharp enough that routing (and a group choice) depends on the token."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, std)
    return model


def _qkv_biases(model: torch.nn.Module) -> torch.nn.Module:
    """q/k/v biases that count (transformers initializes them to 0). v's is smaller: it adds the same vector to
    every token's attention output, and at 0.5 it outweighed the tokens' own states, so that every token was
    routed to few experts (one choice over 45 tokens in GLM-4.5's cases, four in Qwen2-MoE's; 6-21 at 0.05)."""
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for proj, std in ((a.q_proj, 0.5), (a.k_proj, 0.5), (a.v_proj, 0.05)):
                proj.bias.normal_(0.0, std)
    return model


def _hf_model(arch: str, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**{**LLAMA_BASE, **overrides})).eval()
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return _qkv_biases(Qwen2ForCausalLM(Qwen2Config(**{**LLAMA_BASE, **overrides})).eval())
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return _routers(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**LLAMA_BASE, **QWEN3_MOE, **overrides},
                                                           dtype=torch.float32)).eval(), 0.2)
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        model = _routers(_qkv_biases(Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**LLAMA_BASE, **overrides})).eval()), 0.2)
        with torch.no_grad():  # a shared-expert gate that counts
            for layer in model.model.layers:
                if hasattr(layer.mlp, "shared_expert_gate"):
                    layer.mlp.shared_expert_gate.weight.normal_(0.0, 0.5)
        return model
    if arch == "phi3":
        from transformers import Phi3Config, Phi3ForCausalLM

        return Phi3ForCausalLM(Phi3Config(**{**LLAMA_BASE, **overrides})).eval()
    if arch == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return _routers(MixtralForCausalLM(MixtralConfig(**{**LLAMA_BASE, **overrides})).eval(), 0.2)
    if arch == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**{**LLAMA_BASE, **overrides})).eval()
        with torch.no_grad():  # norm weights away from 1, so that a missing or misread one shows
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        return model
    if arch == "glm4":
        from transformers import Glm4Config, Glm4ForCausalLM

        model = _qkv_biases(Glm4ForCausalLM(Glm4Config(**{**LLAMA_BASE, "pad_token_id": None, **overrides})).eval())
        with torch.no_grad():  # norm weights away from 1, so that a missing or misread one shows
            for layer in model.model.layers:
                for norm in (layer.post_self_attn_layernorm, layer.post_mlp_layernorm):
                    norm.weight.uniform_(0.5, 1.5)
        return model
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        model = _routers(_qkv_biases(Glm4MoeForCausalLM(Glm4MoeConfig(**{**LLAMA_BASE, "pad_token_id": None,
                                                                         **overrides}, dtype=torch.float32)).eval()),
                         0.2)
        with torch.no_grad():  # a correction bias that counts; q/k norm weights away from 1
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.uniform_(0.0, 0.3)
                if hasattr(layer.self_attn, "q_norm"):
                    layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                    layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        return model
    if arch == "ernie4_5":
        from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

        return Ernie4_5ForCausalLM(Ernie4_5Config(**{**LLAMA_BASE, **overrides})).eval()
    if arch == "ernie4_5_moe":
        from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

        model = _routers(Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**{**LLAMA_BASE, **overrides},
                                                                    dtype=torch.float32)).eval(), 0.2)
        with torch.no_grad():  # a correction bias that counts (softmax scores of 8 experts: about 0.125 each)
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.moe_statics.e_score_correction_bias.uniform_(0.0, 0.1)
        return model
    if arch in ("gemma3_text", "gemma2"):
        from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

        cls, config = (Gemma2ForCausalLM, Gemma2Config) if arch == "gemma2" else (Gemma3ForCausalLM, Gemma3TextConfig)
        model = cls(config(**{**LLAMA_BASE, "pad_token_id": None, **overrides})).eval()
        with torch.no_grad():  # norm weights away from 0 (Gemma's norms multiply by 1 + weight)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(-0.5, 0.5)
        return model
    if arch == "seed_oss":
        from transformers import SeedOssConfig, SeedOssForCausalLM

        config = SeedOssConfig(**{**LLAMA_BASE, "pad_token_id": None, **overrides})
        return _qkv_biases(SeedOssForCausalLM(config).eval())
    if arch in ("olmo2", "olmo3", "exaone4"):
        from transformers import (Exaone4Config, Exaone4ForCausalLM, Olmo2Config, Olmo2ForCausalLM, Olmo3Config,
                                  Olmo3ForCausalLM)

        config, cls = {"olmo3": (Olmo3Config, Olmo3ForCausalLM), "exaone4": (Exaone4Config, Exaone4ForCausalLM)}.get(
            arch, (Olmo2Config, Olmo2ForCausalLM))
        model = cls(config(**{**LLAMA_BASE, "pad_token_id": None, **overrides})).eval()
        with torch.no_grad():  # norm weights away from 1, so that a missing or misread one shows
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.post_attention_layernorm,
                             layer.post_feedforward_layernorm):
                    norm.weight.uniform_(0.5, 1.5)
        return model
    if arch == "smollm3":
        from transformers import SmolLM3Config, SmolLM3ForCausalLM

        return SmolLM3ForCausalLM(SmolLM3Config(**{**LLAMA_BASE, "pad_token_id": None, **overrides})).eval()
    if arch == "granite":
        from transformers import GraniteConfig, GraniteForCausalLM

        return GraniteForCausalLM(GraniteConfig(**{**LLAMA_BASE, **overrides})).eval()
    if arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(**{**LLAMA_BASE, **overrides})).eval()
    if arch == "glm4_moe_lite":
        from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

        model = _routers(Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**{**DEEPSEEK_BASE, **overrides},
                                                                  dtype=torch.float32)).eval(), 0.3)
        with torch.no_grad():  # a correction bias that counts
            for layer in model.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.uniform_(0.0, 0.3)
        return model
    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        return _routers(DeepseekV2ForCausalLM(DeepseekV2Config(**{**DEEPSEEK_BASE, **overrides})).eval(), 0.3)
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # dtype= keeps the router float32, as the released checkpoints have it.
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**DEEPSEEK_BASE, **overrides}, dtype=torch.float32)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                # A router sharp enough that routing depends on the token, and a non-zero correction bias.
                # transformers 5.24 masks dropped groups with -inf, as our routing (and DeepSeek's code)
                # does; older releases used 0.0, which agrees only while every biased score is positive,
                # so the bias stays positive and the test holds for both.
                layer.mlp.gate.weight.normal_(0.0, 0.2)
                layer.mlp.gate.e_score_correction_bias.uniform_(0.0, 0.3)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(transformers model, its save_pretrained directory, an Executor over it)."""
    arch, overrides = CASES[request.param]
    model = _hf_model(arch, overrides)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, _executor(path)


def test_every_architecture_has_a_parity_case():
    """models/architectures.ARCHITECTURES and the transformers classes of CASES name the same architectures."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    from pieceworks.models.architectures import ARCHITECTURES

    assert {CAUSAL_LM[arch] for arch, _ in CASES.values()} == set(ARCHITECTURES)


def _executor(path, **quant) -> Executor:
    cfg = {"model": {"path": str(path)}, "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": 2048, "page_size": 4}, "quantization": quant}
    return Executor.from_config(cfg, progress=False)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ref_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    assert ours.shape == ref.shape
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < rtol, f"max |diff| / max |ref| = {err:.2e} (allowed {rtol:.0e})"


def test_score_matches_transformers(case):
    model, _, ex = case
    ids = _prompt(45, seed=1)
    ref = _ref_logits(model, ids)
    _assert_close(ex.score([ids])[0], ref)
    # The same prompt prefilled in 3 chunks (EXTEND with a cached prefix).
    _assert_close(score_chunked(ex, [ids], max_step_tokens=math.ceil(len(ids) / 3))[0], ref)


def test_greedy_generate_matches_transformers(case):
    model, _, ex = case
    prompts = [_prompt(11, seed=2), _prompt(5, seed=3)]
    ours = ex.generate(prompts, max_new_tokens=32)
    for prompt, got in zip(prompts, ours):
        seq = list(prompt)
        for _ in range(32):  # cache-free greedy reference
            seq.append(int(_ref_logits(model, seq)[-1].argmax()))
        assert got == seq[len(prompt):]


DROP = object()  # an edit that removes the key from config.json
IGNORED_BY_TRANSFORMERS = {
    # transformers' Llama-style attention rotates whole heads whatever partial_rotary_factor says (Phi-3, GLM-4 read it)
    "llama_partial_rotary": ("llama", dict(partial_rotary_factor=0.5), {}),
    "qwen3_partial_rotary": ("qwen3", dict(head_dim=32, partial_rotary_factor=0.5), {}),
    # Gemma3Attention keeps attn_logit_softcapping and never applies it
    "gemma3_attn_softcap": ("gemma3_text", dict(head_dim=32, sliding_window=8, num_hidden_layers=2,
                                                query_pre_attn_scalar=24, attn_logit_softcapping=0.05), {}),
    # transformers' DeepSeek-V2 always interleaves its rope
    "deepseek_v2_rope_interleave_false": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy",
                                                              n_shared_experts=1, first_k_dense_replace=1),
                                          {"rope_interleave": False}),
    # a top-level original_max_position_embeddings wins over the rope settings' (standardize_rope_params)
    "qwen2_yarn_top_level_original_context": ("qwen2", dict(rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=1e4)),
        {"original_max_position_embeddings": 16}),
    # and where config.json has none, Phi3Config's class default (4096) still wins over the longrope settings' 64
    "phi3_longrope_without_a_top_level_original_context": ("phi3", dict(
        pad_token_id=None, eos_token_id=2, original_max_position_embeddings=64, rope_scaling=dict(
            rope_type="longrope", original_max_position_embeddings=64,
            short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0])),
        {"original_max_position_embeddings": DROP}),
}


@pytest.mark.parametrize("name", list(IGNORED_BY_TRANSFORMERS))
def test_config_keys_read_as_transformers_reads_them(name, tmp_path):
    """Config keys that transformers ignores (or reads with another precedence) for a model: pieceworks computes
    what transformers' model of the saved config.json computes. The q/k projections are scaled up so that the rope
    and the attention scores show in the logits."""
    from transformers import AutoModelForCausalLM

    arch, overrides, edit = IGNORED_BY_TRANSFORMERS[name]
    model = _hf_model(arch, overrides)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if re.search(r"\.(q_proj|k_proj|kv_a_proj_with_mqa)\.weight$", n):
                p.mul_(3.0)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in {**config, **edit}.items() if v is not DROP}))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _prompt(45, seed=1)
    ex = _executor(tmp_path)
    _assert_close(ex.score([ids])[0], _ref_logits(ref, ids))
    _assert_close(score_chunked(ex, [ids], max_step_tokens=15)[0], _ref_logits(ref, ids))


def test_models_trace_in_one_graph(case):
    """fullgraph=True with a dynamic token dimension: one Dynamo graph for every token count, equal to
    eager (the executor runs the compiled module; compute_logits is reached through it)."""
    _, _, ex = case
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    eager = ex.model
    ids = _prompt(33, seed=4)
    expect = [ex.score([ids[:n]])[0] for n in (5, 17, 33)]
    ex.model = torch.compile(eager, backend=backend, fullgraph=True, dynamic=True)
    try:
        got = [ex.score([ids[:n]])[0] for n in (5, 17, 33)]
    finally:
        ex.model = eager
    assert len(graphs) == 1
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# --- NVFP4 ---------------------------------------------------------------------------------------


def _dequantized_reference(export_dir, config_dir):
    """transformers (float32) holding every tensor of a ModelOpt export, NVFP4 linears dequantized."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config_dir, dtype=torch.float32).eval()
    reader = CheckpointReader(export_dir)
    state = model.state_dict()
    with torch.no_grad():
        for name in reader.names():
            if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
                continue
            module = name.removesuffix(".weight")
            if reader.has(f"{module}.weight_scale"):
                n, k2 = reader.shape(name)
                w = read_fp4_linear(reader, module, 2 * k2, n)
                value = nvfp4.dequantize(w.weight, w.weight_scale, w.weight_scale_2)
            else:
                value = reader.get(name).float()
            if ".block_sparse_moe." in module:  # Mixtral's names of the modules transformers names as Qwen3-MoE's
                module = re.sub(r"\.w([123])$", lambda m: "." + MIXTRAL_PROJ[m[1]],
                                module.replace(".block_sparse_moe.", ".mlp."))
                name = f"{module}.weight"
            if ".mlp.moe_statics." in name:  # ERNIE 4.5's correction bias, under the router in transformers
                name = name.replace(".mlp.moe_statics.", ".mlp.gate.moe_statics.")
            if ".experts." in module:  # transformers stacks experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
                layer, expert, proj = module.split(".experts.")[0], *module.split(".experts.")[1].split(".")
                e, inter = int(expert), value.shape[0] if proj != "down_proj" else value.shape[1]
                if proj == "down_proj":
                    state[f"{layer}.experts.down_proj"][e].copy_(value)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    state[f"{layer}.experts.gate_up_proj"][e, rows].copy_(value)
            else:
                assert state[name].shape == value.shape, name
                state[name].copy_(value)
    return model


# w4a16 (weight-only) computes exactly what the dequantized reference does: fp32 rounding only.
# w4a4 also rounds activations to NVFP4 with the export's input_scale; on these tiny random models
# that moved logits by 0.14-0.16 (max |diff| / max |ref|, measured when written); the bound of 0.3 only
# catches a broken activation path (wrong input_scale, say), it is no statement about accuracy.
NUMERICS_RTOL = {"w4a16": RTOL, "w4a4": 0.3}


@pytest.mark.parametrize("numerics", list(NUMERICS_RTOL))
@pytest.mark.parametrize("fixture", ["tiny_llama_modelopt", "tiny_deepseek_modelopt"])
def test_nvfp4_export_matches_dequantized_transformers(fixture, numerics, request):
    export = request.getfixturevalue(fixture)
    ref = _dequantized_reference(export.fp4_dir, export.bf16_dir)
    ex = _executor(export.fp4_dir, fp4_numerics=numerics)
    assert ex.model.has_fp4()
    ids = _prompt(40, seed=5)
    _assert_close(ex.score([ids])[0], _ref_logits(ref, ids), NUMERICS_RTOL[numerics])


def test_nvfp4_unfusable_parts_stay_separate(tiny_llama_modelopt, tmp_path):
    """q/k/v with different global scales are kept as separate NVFP4 linears, and stay exact."""
    d = tmp_path / "fp4"
    shutil.copytree(tiny_llama_modelopt.fp4_dir, d)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight_scale_2"] *= 2
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    ex = _executor(d, fp4_numerics="w4a16")
    assert isinstance(ex.model.layers[0].self_attn.qkv_proj, SplitProj)
    assert not isinstance(ex.model.layers[1].self_attn.qkv_proj, SplitProj)
    ids = _prompt(20, seed=6)
    _assert_close(ex.score([ids])[0], _ref_logits(_dequantized_reference(d, tiny_llama_modelopt.bf16_dir), ids))


@pytest.mark.parametrize("name", ["qwen2_qkv_bias_yarn", "qwen3_moe_norm_topk", "mistral_no_window", "mixtral",
                                  "qwen2_moe", "deepseek_v2_groups", "phi3", "glm4_moe_qk_norm", "glm4_moe_lite",
                                  "ernie4_5_moe"])
def test_our_nvfp4_quantization_of_the_other_architectures_is_exact(name, tmp_path):
    """`pieceworks quantize` (a fixed amax: no calibration) of Qwen2 (biases stay bf16), Qwen3-MoE (experts and
    router), Mistral, Mixtral (its w1 / w3 / w2 experts), Qwen2-MoE (its shared expert; the gate stays bf16),
    DeepSeek-V2, GLM-4.5, GLM-4.7-Flash and ERNIE 4.5 checkpoints: w4a16 equals transformers holding the export
    dequantized."""
    from pieceworks.quant.quantizer import quantize_checkpoint

    arch, overrides = CASES[name]
    _hf_model(arch, overrides).save_pretrained(tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp4", amax=4.0, progress=False)
    ex = _executor(tmp_path / "fp4", fp4_numerics="w4a16")
    dense = CASES[name][0] in ("qwen2", "mistral", "phi3")
    assert ex.model.has_fp4() and ex.model.facts(4).moe_quant == ("none" if dense else "nvfp4")
    ids = _prompt(40, seed=5)
    _assert_close(ex.score([ids])[0], _ref_logits(_dequantized_reference(tmp_path / "fp4", tmp_path / "bf16"), ids))


def test_glm4_moe_in_its_released_config_form_with_a_multi_token_prediction_layer(tmp_path):
    """GLM-4.5's config.json as the released checkpoints write it (rope_theta at the top, rope_scaling null, here no
    partial_rotary_factor: transformers' default of half the head applies) and its checkpoint's multi-token-
    prediction layer after the last one (not run, kept whole by `pieceworks quantize`): both load and compute
    what transformers does."""
    import json

    from pieceworks.quant.quantizer import quantize_checkpoint

    arch, overrides = CASES["glm4_moe"]
    model = _hf_model(arch, overrides)
    src = tmp_path / "src"
    model.save_pretrained(src)
    hf = json.loads((src / "config.json").read_text())
    hf.update(rope_theta=hf.pop("rope_parameters")["rope_theta"], rope_scaling=None)
    (src / "config.json").write_text(json.dumps(hf))
    n, tensors = hf["num_hidden_layers"], load_file(src / "model.safetensors")
    mtp = {f"model.layers.{n}.{k}": torch.randn(*shape) for k, shape in
           (("eh_proj.weight", (64, 128)), ("enorm.weight", (64,)), ("hnorm.weight", (64,)),
            ("mlp.experts.0.gate_proj.weight", (32, 64)))}
    save_file({**tensors, **mtp}, src / "model.safetensors", metadata={"format": "pt"})
    ids = _prompt(40, seed=7)
    with _executor(src) as ex:
        assert len(ex.model.layers) == n and ex.model.layers[0].self_attn.rotary_dim == 16
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids))
    quantize_checkpoint(src, tmp_path / "fp4", amax=8.0, progress=False)
    out = load_file(tmp_path / "fp4" / "model.safetensors")
    assert all(torch.equal(out[k], v.to(out[k].dtype)) for k, v in mtp.items())
    with _executor(tmp_path / "fp4") as ex:
        assert ex.model.has_fp4() and ex.model.facts(4).moe_quant == "nvfp4"


LLAMA_FAMILIES = ["llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "granite",
                  "smollm3", "olmo2", "olmo3", "exaone4", "seed_oss", "glm4", "glm4_moe", "ernie4_5", "ernie4_5_moe"]


@pytest.mark.parametrize("model_type", LLAMA_FAMILIES + ["gemma3_text", "gemma2", "deepseek_v3", "deepseek_v2",
                                                         "glm4_moe_lite"])
def test_family_defaults_are_transformers(model_type):
    """A config.json that leaves out what it may: each family reads transformers' defaults (GLM-4's head_dim 128
    and half-head rope, ERNIE 4.5's rope_theta 500000 and tied head, Mixtral's rms_norm_eps 1e-5, DeepSeek-V3's q
    LoRA rank 1536 and routing, ...), or refuses the config; none computes another model."""
    from transformers import AutoConfig

    from pieceworks.models.deepseek_v3 import DeepseekV3Args
    from pieceworks.models.llama import LlamaArgs

    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    llama = model_type in LLAMA_FAMILIES
    sizes.update(num_key_value_heads=2) if llama else sizes.update(kv_lora_rank=32, qk_nope_head_dim=16,
                                                                    qk_rope_head_dim=8, v_head_dim=12)
    if model_type == "deepseek_v2":
        sizes.update(num_experts_per_tok=2)  # transformers' default None routes nothing
    if model_type in ("gemma3_text", "gemma2"):
        from pieceworks.models.gemma3 import Gemma3

        sizes.update(num_key_value_heads=2)
    ref = AutoConfig.for_model(model_type, **sizes)
    gemma = model_type in ("gemma3_text", "gemma2")
    read = Gemma3.args_from_hf if gemma else (LlamaArgs if llama else DeepseekV3Args).from_hf
    if model_type in ("olmo3", "exaone4"):  # OLMo 2's form of it, the full layers' rope (models/config_forms.py)
        from pieceworks.models.olmo2 import Exaone4, Olmo3

        read = (Olmo3 if model_type == "olmo3" else Exaone4).args_from_hf
    ours = read({"model_type": model_type, **sizes})
    rope = ref.rope_parameters.get("full_attention", ref.rope_parameters)  # Gemma 3's: per layer kind
    llama = llama or gemma
    assert ours.rope["rope_theta"] == rope["rope_theta"]
    assert (ours.rms_norm_eps, ours.max_position_embeddings, ours.tie_word_embeddings) == (
        ref.rms_norm_eps, ref.max_position_embeddings, ref.tie_word_embeddings)
    if llama:
        assert ours.head_dim == (getattr(ref, "head_dim", None) or 64 // 4)
        assert ours.rotary_dim == int(ours.head_dim * rope.get("partial_rotary_factor", 1.0))
    else:
        for key in ("q_lora_rank", "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor", "n_group",
                    "topk_group", "norm_topk_prob"):
            if model_type != "deepseek_v2" or key not in ("n_group", "topk_group"):  # V2's greedy: no groups
                assert getattr(ours, key) == getattr(ref, key), key
        assert [ours.is_moe(i) for i in range(2)] == [hasattr(m.mlp, "experts")
                                                      for m in _layers_of(ref)]


def test_gemma3_config_with_only_its_model_type_is_transformers_default():
    """A text_config as terse as the released Gemma 3 4B's leans on Gemma3TextConfig's defaults for the rest: an empty
    one builds transformers' default model (sizes, windows, attention scale)."""
    from transformers import Gemma3TextConfig

    from pieceworks.models.gemma3 import Gemma3
    from pieceworks.models.families import with_defaults
    from pieceworks.models.config_forms import gemma_form

    ref, hf = Gemma3TextConfig(), with_defaults({"model_type": "gemma3_text"})
    a = Gemma3.args_from_hf(hf)
    assert (a.vocab_size, a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads,
            a.head_dim) == (ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers,
                            ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    _, local, sliding = gemma_form(hf)
    assert sliding == tuple(k == "sliding_attention" for k in ref.layer_types)
    assert (hf["sliding_window"], hf["query_pre_attn_scalar"]) == (ref.sliding_window, ref.query_pre_attn_scalar)
    assert local["rope_theta"] == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert a.rope["rope_theta"] == ref.rope_parameters["full_attention"]["rope_theta"]


def _layers_of(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).model.layers


def test_ernie4_5_moe_multi_token_prediction_tensors_are_skipped(tmp_path):
    """ERNIE 4.5's MTP tensors (`model.mtp*`, which transformers ignores) load as unused with num_nextn_predict_layers
    set, are kept whole by `pieceworks quantize`, and are refused without it."""
    import json

    from pieceworks.errors import CheckpointError
    from pieceworks.quant.quantizer import quantize_checkpoint

    arch, overrides = CASES["ernie4_5_moe"]
    model = _hf_model(arch, overrides)
    src = tmp_path / "src"
    model.save_pretrained(src)
    mtp = {"model.mtp_linear_proj.0.weight": torch.randn(64, 128), "model.mtp_block.0.self_attn.q_proj.weight":
           torch.randn(128, 64)}
    save_file({**load_file(src / "model.safetensors"), **mtp}, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.mtp"):
        _executor(src)
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    ids = _prompt(30, seed=8)
    with _executor(src) as ex:
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids))
    quantize_checkpoint(src, tmp_path / "fp4", amax=8.0, progress=False)
    out = load_file(tmp_path / "fp4" / "model.safetensors")
    assert all(torch.equal(out[k], v.to(out[k].dtype)) for k, v in mtp.items())
    with _executor(tmp_path / "fp4") as ex:
        assert ex.model.has_fp4()


def _in_released_form(model, path, **top) -> Executor:
    """An executor of `model` saved with its config.json in the released form: no layer_types or per-kind
    rope_parameters, `top`'s keys at the top level instead."""
    import json

    model.save_pretrained(path)
    hf = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        hf.pop(key)
    hf.update(top)
    (path / "config.json").write_text(json.dumps(hf))
    return _executor(path)


def _peaked(model) -> None:
    """q . k 16x larger through the q / k norms, so that each layer's rope shows in the logits."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(4)
            layer.self_attn.k_norm.weight.mul_(4)


def test_gemma3_in_its_released_config_form(tmp_path):
    """Gemma 3's config.json as the released checkpoints write it (rope_theta, rope_local_base_freq and rope_scaling
    at the top, sliding_window_pattern in place of layer_types) computes what transformers computes."""
    arch, overrides = CASES["gemma3"]
    model = _hf_model(arch, {**overrides, "layer_types": None, "sliding_window_pattern": 3,
                             "rope_parameters": None, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
                             "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    assert model.config.layer_types[:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert model.config.rope_parameters["full_attention"]["factor"] == 4.0
    ids = _prompt(40, seed=9)
    with _in_released_form(model, tmp_path, sliding_window_pattern=3, rope_theta=5e5, rope_local_base_freq=2e4,
                           rope_scaling={"rope_type": "linear", "factor": 4.0}) as ex:
        assert ex.model.windows == (8, 8, 0, 8)
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids))


def test_olmo3_in_its_released_config_form(tmp_path):
    """OLMo 3's config.json as the released checkpoints write it (rope_theta and rope_scaling at the top, no layer
    types): every fourth layer full, its rope at rope_theta with the scaling, the sliding layers' at 500000 (as
    transformers reads this form), computes what transformers computes."""
    arch, overrides = CASES["olmo3"]
    model = _hf_model(arch, overrides)
    _peaked(model)
    assert model.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert model.config.rope_parameters["sliding_attention"]["rope_theta"] == 5e5
    ids = _prompt(40, seed=9)
    with _in_released_form(model, tmp_path, rope_theta=overrides["rope_theta"],
                           rope_scaling=overrides["rope_scaling"]) as ex:
        assert ex.model.windows == (8, 8, 8, 0)
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids))


def test_exaone4_in_its_released_config_form(tmp_path):
    """EXAONE 4's config.json with rope_theta at the top and sliding_window_pattern in place of layer_types (every
    fourth layer full, rotating nothing) computes what transformers computes."""
    arch, overrides = CASES["exaone4"]
    model = _hf_model(arch, overrides)
    _peaked(model)
    ids = _prompt(40, seed=9)
    with _in_released_form(model, tmp_path, rope_theta=overrides["rope_theta"], rope_scaling=overrides["rope_scaling"],
                           sliding_window_pattern=4) as ex:
        assert ex.model.windows == (8, 8, 8, 0) and ex.model.args.rope_layers == (True, True, True, False)
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids))


def test_gemma3_text_model_of_a_multimodal_checkpoint(tmp_path):
    """Gemma3ForConditionalGeneration (Gemma 3 4B-27B): pieceworks runs its text model (text_config, tensors under
    language_model.model.), the vision tower and projector unread; text-only logits and greedy tokens equal
    transformers' multimodal model's; `pieceworks quantize` leaves the vision model unquantized and its NVFP4 text
    model computes what transformers does with the dequantized weights."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from pieceworks.quant.nvfp4 import dequantize
    from pieceworks.quant.quantizer import quantize_checkpoint

    _, overrides = CASES["gemma3"]
    torch.manual_seed(0)
    text = {**LLAMA_BASE, "pad_token_id": None, **overrides, "vocab_size": 300}
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path / "src")
    ids = _prompt(40, seed=10)
    with _executor(tmp_path / "src") as ex:
        assert ex.model.windows == (8, 8, 8, 0)
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids))
        got = ex.generate([ids[:7]], max_new_tokens=8)[0]
    seq = ids[:7]
    for _ in range(8):
        seq.append(int(_ref_logits(model, seq)[-1].argmax()))
    assert got == seq[7:]
    # the same tensors as transformers 5 may name them (model.language_model., model.vision_tower., ...)
    shutil.copytree(tmp_path / "src", tmp_path / "t5")
    renamed = {re.sub(r"^language_model\.model\.", "model.language_model.", re.sub(
        r"^(vision_tower|multi_modal_projector)\.", r"model.\1.", k)): v
        for k, v in load_file(tmp_path / "src" / "model.safetensors").items()}
    save_file(renamed, tmp_path / "t5" / "model.safetensors", metadata={"format": "pt"})
    with _executor(tmp_path / "t5") as ex:
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids))

    quantize_checkpoint(tmp_path / "src", tmp_path / "fp4", amax=8.0, progress=False)
    tensors = {k: v for f in sorted((tmp_path / "fp4").glob("*.safetensors")) for k, v in load_file(f).items()}
    packed = {k[:-len(".weight")] for k, v in tensors.items() if k.endswith(".weight") and v.dtype == torch.uint8}
    assert packed and all(p.startswith("language_model.model.layers.") for p in packed)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for p in packed:
            w = dequantize(tensors[f"{p}.weight"], tensors[f"{p}.weight_scale"], tensors[f"{p}.weight_scale_2"])
            params[p.replace("language_model.model.", "model.language_model.") + ".weight"].copy_(w)
    with _executor(tmp_path / "fp4") as ex:
        assert ex.model.has_fp4()
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids), rtol=1e-3)


def test_random_olmo2_from_model_sizes():
    """model.sizes.model_type=olmo2 builds OLMo 2's post-norm blocks over a Llama preset."""
    from pieceworks.models.olmo2 import Olmo2

    cfg = {"model": {"arch": "llama", "preset": "tiny", "sizes": {"model_type": "olmo2"}},
           "runtime": {"device": "cpu", "dtype": "float32"}}
    with Executor.from_config(cfg, progress=False) as ex:
        assert isinstance(ex.model, Olmo2) and ex.model.layers[0].input_layernorm is None
        assert ex.model.layers[0].self_attn.q_norm.weight.shape[0] == ex.model.args.num_heads * ex.model.args.head_dim
        assert len(ex.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2  # piecewise graphs (CPU) as well


def test_random_granite_from_model_sizes():
    """model.sizes.model_type=granite builds Granite's class over a Llama preset, with its scalars."""
    from pieceworks.models.granite import Granite

    cfg = {"model": {"arch": "llama", "preset": "tiny", "sizes": {"model_type": "granite", "logits_scaling": 4.0,
                                                                   "residual_multiplier": 0.5}},
           "runtime": {"device": "cpu", "dtype": "float32"}, "cuda_graph": {"piecewise": {"enabled": "off"}}}
    with Executor.from_config(cfg, progress=False) as ex:
        assert isinstance(ex.model, Granite) and ex.model.logits_scaling == 4.0
        assert {b.residual_multiplier for b in ex.model.layers} == {0.5}
        assert len(ex.generate([[1, 2, 3]], max_new_tokens=2)[0]) == 2


@pytest.mark.parametrize("interval,layers", [(4, 36), (2, 5), (1, 3), (7, 6)])
def test_smollm3_nope_layers_from_the_interval_as_transformers_derives_them(interval, layers):
    """A config.json with no_rope_layer_interval and no list (transformers writes the list it derives, so the
    parity cases above read lists): the same layers rotate."""
    from transformers import SmolLM3Config

    from pieceworks.models.hf_config import rope_layers

    want = SmolLM3Config(num_hidden_layers=layers, no_rope_layer_interval=interval).no_rope_layers
    hf = {"model_type": "smollm3", "num_hidden_layers": layers, "no_rope_layer_interval": interval}
    assert rope_layers(hf) == tuple(bool(v) for v in want)


@pytest.mark.parametrize("name", ["olmo2", "olmo3", "exaone4", "granite", "phi4_mini_partial", "smollm3_nope_interval", "seed_oss",
                                  "glm4", "ernie4_5", "gemma3", "gemma2"])
def test_quantized_checkpoints_of_the_newer_families_load_as_nvfp4(name, tmp_path):
    """`pieceworks quantize` (a fixed activation amax: these directories hold no tokenizer) of each family's
    transformers checkpoint loads as an NVFP4 model that computes what the transformers model computes with the
    checkpoint's weights dequantized (every tensor found under its name, Phi-3's fused rows included)."""
    from safetensors.torch import load_file

    from pieceworks.quant.nvfp4 import dequantize
    from pieceworks.quant.quantizer import quantize_checkpoint

    arch, overrides = CASES[name]
    model = _hf_model(arch, overrides)
    model.save_pretrained(tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "fp4", amax=8.0, progress=False)
    tensors = {k: v for f in sorted((tmp_path / "fp4").glob("*.safetensors")) for k, v in load_file(f).items()}
    packed = {k[:-len(".weight")] for k, v in tensors.items() if k.endswith(".weight") and v.dtype == torch.uint8}
    assert packed, "nothing was quantized"
    with torch.no_grad():
        params = dict(model.named_parameters())
        for p in packed:
            w = dequantize(tensors[f"{p}.weight"], tensors[f"{p}.weight_scale"], tensors[f"{p}.weight_scale_2"])
            params[f"{p}.weight"].copy_(w)
    ids = _prompt(40, seed=4)
    with _executor(tmp_path / "fp4") as ex:
        assert ex.model.has_fp4()
        _assert_close(ex.score([ids])[0], _ref_logits(model, ids), rtol=1e-3)
