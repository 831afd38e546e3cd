"""Model families: which one a config.json describes (`family`: the one its architectures name, else its model_type),
the defaults transformers gives each for the keys its config.json leaves out (`with_defaults`), the text model of a
multimodal checkpoint (`text_model`), and how the Llama families that fuse projections name them in their checkpoints
(`FusedNames`: Phi-3's q/k/v and gate/up, GLM-4's gate/up)."""

from __future__ import annotations

from typing import Any

ARCHITECTURE_FAMILIES = {"MixtralForCausalLM": "mixtral", "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
                         "Olmo3ForCausalLM": "olmo3", "SeedOssForCausalLM": "seed_oss",
                         "Exaone4ForCausalLM": "exaone4", "Glm4ForCausalLM": "glm4",
                         "Glm4MoeForCausalLM": "glm4_moe", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
                         "Ernie4_5ForCausalLM": "ernie4_5", "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
                         "Gemma3ForCausalLM": "gemma3_text", "Gemma2ForCausalLM": "gemma2"}


def family(hf: dict) -> str | None:
    """The config's model_type, or the one its architectures name (`ARCHITECTURE_FAMILIES`)."""
    for name in hf.get("architectures") or []:
        if name in ARCHITECTURE_FAMILIES:
            return ARCHITECTURE_FAMILIES[name]
    return hf.get("model_type")


# multimodal checkpoints whose text model pieceworks runs: its architecture, the prefixes its tensors take (the
# released form, transformers 5's), the other models' tensors (not read)
MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
OTHER_PARTS = ("vision_tower", "multi_modal_projector", "model.vision_tower", "model.multi_modal_projector")


def text_model(hf: dict) -> dict | None:
    """A multimodal config.json's text model as a config of its own (`text_config`, with the top-level head tying
    and quantization; `text_of` names the multimodal architecture), or None for any other config."""
    archs = [a for a in hf.get("architectures") or [] if a in MULTIMODAL]
    if not archs or not isinstance(hf.get("text_config"), dict):
        return None
    top = {k: hf[k] for k in ("tie_word_embeddings", "quantization_config") if k in hf}
    return {**hf["text_config"], **top, "architectures": [MULTIMODAL[archs[0]]], "text_of": archs[0]}


# families whose every layer attends through config.json's sliding_window in transformers (Mistral 7B v0.1's 4,096
# tokens, Phi-3-mini-4k's 2,047); the Qwen families' windows depend on use_sliding_window and max_window_layers, and
# there a window shorter than the context caps it instead (`hf_config.context_cap`)
WINDOWED = ("mistral", "mixtral", "phi3")


def layer_windows(hf: dict, num_layers: int) -> tuple[int, ...]:
    """Per layer, the keys a query sees (`ModelFacts.sliding_windows`) in a `WINDOWED` family whose window is
    shorter than its positions; () where no window cuts anything."""
    window = hf.get("sliding_window")
    if family(hf) in WINDOWED and window is not None and window < hf.get("max_position_embeddings", 2048):
        return (int(window),) * num_layers
    return ()


def is_mixtral(hf: dict) -> bool:
    return family(hf) == "mixtral"


class FusedNames:
    """A checkpoint whose projections are row slices of fused ones: Phi-3's q, k and v in `qkv_proj` and gate and up
    in `gate_up_proj`; GLM-4's gate and up in `gate_up_proj`. Calling it gives the checkpoint's tensor (or module)
    name; `rows` the rows of it a tensor is, where it is a slice (weights and their block scales; a fused linear's
    global and input scales are shared whole)."""

    FUSED = {"phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                      "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"},
             "glm4": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}}

    @classmethod
    def of(cls, hf: dict) -> "FusedNames | None":
        return cls(hf, cls.FUSED[family(hf)]) if family(hf) in cls.FUSED else None

    def __init__(self, hf: dict, fused: dict[str, str]) -> None:
        heads = hf["num_attention_heads"]
        d = hf.get("head_dim") or hf["hidden_size"] // heads
        q, kv, inter = heads * d, (hf.get("num_key_value_heads") or heads) * d, hf["intermediate_size"]
        spans = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
                 "gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}
        self.fused, self.spans = fused, {k: spans[k] for k in fused}

    def _split(self, name: str) -> tuple[str, str, str] | None:
        """(prefix, projection, suffix) of a name of a fused projection, else None."""
        for proj in self.fused:
            head, sep, tail = name.partition(f".{proj}")
            if sep and (not tail or tail.startswith(".")):
                return head, proj, tail
        return None

    def __call__(self, name: str) -> str:
        parts = self._split(name)
        return name if parts is None else f"{parts[0]}.{self.fused[parts[1]]}{parts[2]}"

    def rows(self, name: str) -> tuple[int, int] | None:
        parts = self._split(name)
        return self.spans[parts[1]] if parts is not None and parts[2] in (".weight", ".weight_scale") else None

    def total(self, name: str) -> tuple[int, str]:
        """The rows of the fused tensor that `name` (one with `rows`) is a slice of, as config.json gives them, and
        their sum spelled out (q 64 + k 16 + v 16)."""
        fused = self.fused[self._split(name)[1]]
        parts = [(p.split("_")[0], self.spans[p][1] - self.spans[p][0]) for p in self.fused if self.fused[p] == fused]
        return sum(n for _, n in parts), " + ".join(f"{p} {n}" for p, n in parts)


# transformers' defaults (5.25's config classes) for keys a family's config.json may leave out, where they are not
# what the model classes assume without them (Llama's: rms_norm_eps 1e-6, rope_theta 10000, 2048 positions, untied
# head, head_dim hidden / heads; DeepSeek-V3Args': no q LoRA, no experts, no shared experts, scaling 1, no dense
# layers). tests/test_models_parity.py compares each against transformers.
_LONG = {"max_position_embeddings": 131072}
_E5 = {"rms_norm_eps": 1e-5}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": _LONG, "mixtral": {**_LONG, **_E5, "rope_theta": 1e6},
    "phi3": {**_E5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
    "qwen2": {"max_position_embeddings": 32768}, "qwen2_moe": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128}, "qwen3_moe": {"max_position_embeddings": 32768},
    "smollm3": {"max_position_embeddings": 32768, "rope_theta": 2e6, "tie_word_embeddings": True},
    "olmo2": _E5, "olmo3": {**_E5, "rope_theta": 5e5, "sliding_window": 4096},
    "exaone4": {**_E5, "sliding_window": 4096, "sliding_window_pattern": 4},
    "seed_oss": {"max_position_embeddings": 524288, "head_dim": 128},
    "glm4": {**_LONG, "rms_norm_eps": 1.5625e-07, "partial_rotary_factor": 0.5, "head_dim": 128},
    "glm4_moe": {**_LONG, **_E5, "partial_rotary_factor": 0.5},
    "ernie4_5": {**_LONG, **_E5, "head_dim": 128, "rope_theta": 500000.0, "tie_word_embeddings": True},
    "ernie4_5_moe": {**_LONG, **_E5, "rope_theta": 500000.0, "tie_word_embeddings": True},
    "gemma2": {"head_dim": 256, "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "max_position_embeddings": 8192, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
               "num_attention_heads": 8, "num_key_value_heads": 4},
    # Gemma 3's: the released 4B-27B checkpoints' text_config leaves out what equals these
    "gemma3_text": {**_LONG, "head_dim": 256, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4},
    "deepseek_v3": {"q_lora_rank": 1536, "n_routed_experts": 256, "moe_intermediate_size": 2048,
                    "num_experts_per_tok": 8, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4},
    "deepseek_v2": {"q_lora_rank": 1536, "n_routed_experts": 64, "moe_intermediate_size": 1407, "n_shared_experts": 2,
                    "max_position_embeddings": 2048},
    "glm4_moe_lite": {"q_lora_rank": 768, "n_routed_experts": 64, "moe_intermediate_size": 1536,
                      "num_experts_per_tok": 4, "n_shared_experts": 1, "routed_scaling_factor": 1.8, **_E5,
                      "max_position_embeddings": 202752},
}


def with_defaults(hf: dict) -> dict:
    """`hf` with its family's `FAMILY_DEFAULTS` for the keys it leaves out (a null stays: q_lora_rank's means none)."""
    extra = {k: v for k, v in FAMILY_DEFAULTS.get(family(hf), {}).items() if k not in hf}
    return {**hf, **extra} if extra else hf
