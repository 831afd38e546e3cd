"""Named model sizes for random-weight models (`model.arch` + `model.preset`), as config.json dicts.

`model.sizes` overrides any key, e.g. `{num_hidden_layers: 4}` for a DeepSeek-V3-shaped model that
fits on one GPU.
"""

from __future__ import annotations

from typing import Any

LLAMA_TINY = dict(
    architectures=["LlamaForCausalLM"], model_type="llama",
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
)

LLAMA_31_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama",
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    bos_token_id=128000, eos_token_id=128001,
)

DEEPSEEK_TINY = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=128),
)

DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, first_k_dense_replace=3, moe_layer_freq=1, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
    scoring_func="sigmoid", topk_method="noaux_tc", max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=4096),
    bos_token_id=0, eos_token_id=1,
)

MIXTRAL_8X7B = dict(
    architectures=["MixtralForCausalLM"], model_type="mixtral",
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
    rope_theta=1e6, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
    bos_token_id=1, eos_token_id=2,
)

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, bos_token_id=151643,
    eos_token_id=151645,
)

DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, first_k_dense_replace=1, moe_layer_freq=1, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
    topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling=dict(type="yarn", factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
                      original_max_position_embeddings=4096),
    bos_token_id=100000, eos_token_id=100001,
)

GEMMA_3_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
    vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
    rope_local_base_freq=10000.0, sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
)

GEMMA_2_2B = dict(
    architectures=["Gemma2ForCausalLM"], model_type="gemma2",
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
    sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 107],
)

GLM_47_FLASH = dict(
    architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite",
    vocab_size=154880, hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
    num_hidden_layers=47, first_k_dense_replace=1, num_attention_heads=20, num_key_value_heads=20,
    q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.8, topk_method="noaux_tc", max_position_embeddings=202752, rms_norm_eps=1e-5,
    rope_theta=1e6, tie_word_embeddings=False, num_nextn_predict_layers=1, pad_token_id=154820,
    eos_token_id=[154820, 154827, 154829],
)

GLM_45_AIR = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=46, first_k_dense_replace=1, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, n_routed_experts=128, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
    num_nextn_predict_layers=1, pad_token_id=151329, eos_token_id=[151329, 151336, 151338],
)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {"tiny": LLAMA_TINY, "llama-3.1-8b": LLAMA_31_8B, "mixtral-8x7b": MIXTRAL_8X7B,
              "qwen3-30b-a3b": QWEN3_30B_A3B, "glm-4.5-air": GLM_45_AIR,
              "gemma-3-1b": GEMMA_3_1B, "gemma-2-2b": GEMMA_2_2B},
    "deepseek_v3": {"tiny": DEEPSEEK_TINY, "deepseek-v3": DEEPSEEK_V3, "deepseek-v2-lite": DEEPSEEK_V2_LITE,
                    "glm-4.7-flash": GLM_47_FLASH},
}


def preset_config(arch: str, preset: str | None, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of `preset` (default: tiny) for `arch`, with `sizes` overriding keys.

    Raises:
        ValueError: unknown arch or preset (the message lists the known ones).
    """
    if arch not in PRESETS:
        raise ValueError(f"model.arch={arch!r}: unknown; known: {', '.join(PRESETS)}")
    name = preset or "tiny"
    if name not in PRESETS[arch]:
        raise ValueError(f"model.preset={name!r}: unknown for arch {arch}; known: {', '.join(PRESETS[arch])}")
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PRESETS[arch][name].items()}
    cfg.update(sizes or {})
    return cfg
