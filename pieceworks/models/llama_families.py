"""Which family a config.json describes (`family`: the one its architectures name, else its model_type; all Llama's
but GLM-4.7-Flash's, which runs on DeepSeek-V3's layers), and how the Llama families that fuse projections name them
in their checkpoints (`FusedNames`: Phi-3's q/k/v and gate/up, GLM-4's gate/up)."""

from __future__ import annotations

ARCHITECTURE_FAMILIES = {"MixtralForCausalLM": "mixtral", "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
                         "SeedOssForCausalLM": "seed_oss", "Glm4ForCausalLM": "glm4",
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
