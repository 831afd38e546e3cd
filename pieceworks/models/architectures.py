"""Which model class a config.json builds, and how its checkpoint names the model's tensors.

`ARCHITECTURES` maps a checkpoint's `architectures` to the class; random-weight models are built by `model.arch`
(`ARCHS`), where `model.sizes.model_type` picks a family that has a class of its own (`OWN_CLASSES`; the other
families are flags of Llama's or DeepSeek-V3's arguments).
"""

from __future__ import annotations

from typing import Any, Callable

from pieceworks.errors import CheckpointError
from pieceworks.models.base import CausalLM
from pieceworks.models.deepseek_v3 import DeepseekV3
from pieceworks.models.families import TEXT_PREFIXES
from pieceworks.models.gemma3 import Gemma3
from pieceworks.models.glm4 import Glm4
from pieceworks.models.granite import Granite
from pieceworks.models.llama import Llama
from pieceworks.models.olmo2 import Exaone4, Olmo2, Olmo3

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": Llama,
    "MistralForCausalLM": Llama,  # Llama's layers; a sliding window caps the context (base.context_limit)
    "MixtralForCausalLM": Llama,  # with softmax-routed experts in every layer, named as Mixtral's checkpoints
    # name them (`Llama.checkpoint_names`)
    "Phi3ForCausalLM": Llama,  # Llama's layers, q/k/v and gate/up fused in its checkpoints (`Llama.checkpoint_names`)
    "Qwen2ForCausalLM": Llama,  # Llama's layers with q/k/v biases (LlamaArgs.qkv_bias)
    "Qwen2MoeForCausalLM": Llama,  # and softmax-routed experts with a gated shared expert in its sparse layers
    "Qwen3ForCausalLM": Llama,  # Llama's layers with q/k norms (LlamaArgs.qk_norm)
    "Qwen3MoeForCausalLM": Llama,  # and softmax-routed experts in its sparse layers (LlamaArgs.moe)
    "Glm4ForCausalLM": Glm4,  # q/k/v biases, half-head interleaved rope, sandwich norms (models/glm4.py)
    "Gemma3ForCausalLM": Gemma3,  # sliding-window layers, q/k norms, GeGLU, sandwich norms (models/gemma3.py)
    "Gemma2ForCausalLM": Gemma3,  # and soft-capped attention scores and logits, without q/k norms
    "Glm4MoeForCausalLM": Llama,  # q/k/v biases, half-head rope, DeepSeek-V3's routing and shared experts
    "Ernie4_5ForCausalLM": Llama,  # Llama's layers with an interleaved rope
    "Ernie4_5_MoeForCausalLM": Llama,  # and softmax-routed experts chosen with a correction bias, shared experts
    "Olmo2ForCausalLM": Olmo2,  # Llama's projections in post-norm blocks (models/olmo2.py)
    "Olmo3ForCausalLM": Olmo3,  # and sliding-window layers with a rope of their own
    "Exaone4ForCausalLM": Exaone4,  # OLMo 2's blocks, per-head q/k norms, windows, full layers without rope
    "SeedOssForCausalLM": Llama,  # Llama's layers with q/k/v biases (LlamaArgs.qkv_bias)
    "SmolLM3ForCausalLM": Llama,  # Llama's layers, some without rope (llama.rope_layers)
    "GraniteForCausalLM": Granite,  # Llama's layers with four scalars (models/granite.py)
    "DeepseekV2ForCausalLM": DeepseekV3,  # DeepSeek-V3's layers with softmax routing (DeepseekV3Args.scoring_func)
    "DeepseekV3ForCausalLM": DeepseekV3,
    "Glm4MoeLiteForCausalLM": DeepseekV3,  # GLM-4.7-Flash: DeepSeek-V3's layers (DeepseekV3Args.mlp_layer_types)
}
ARCHS: dict[str, type[CausalLM]] = {"llama": Llama, "deepseek_v3": DeepseekV3}
# model.sizes.model_type of the families with classes of their own, over model.arch=llama
OWN_CLASSES: dict[str, type[CausalLM]] = {"granite": Granite, "olmo2": Olmo2, "olmo3": Olmo3, "exaone4": Exaone4,
                                          "glm4": Glm4, "gemma3_text": Gemma3, "gemma2": Gemma3}


def architecture(hf: dict, where: Any) -> type[CausalLM]:
    """The model class for a config.json's `architectures` (or `model_type` when that is absent)."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(f"{where}: architectures={archs!r} must be a list of class names")
    for name in archs:
        if isinstance(name, str) and name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not archs and hf.get("model_type") in ARCHS:
        return ARCHS[hf["model_type"]]
    raise CheckpointError(f"{where}: architectures={archs!r} (model_type={hf.get('model_type')!r}) is not "
                          f"supported; pieceworks supports {', '.join(ARCHITECTURES)}")


def random_class(arch: str, hf: dict) -> type[CausalLM]:
    """The class of a random-weight model of `model.arch` `arch` and config `hf` (a preset with `model.sizes`)."""
    own = OWN_CLASSES.get(hf.get("model_type")) if arch == "llama" else None
    return own or ARCHS[arch]


def checkpoint_names(cls: type[CausalLM], hf: dict, reader: Any) -> Callable[[str], str] | None:
    """The model's `checkpoint_names`, or for a multimodal checkpoint's text model (`text_model`) its names under
    the prefix the checkpoint gives them (`language_model.model.` as released, `model.language_model.` as
    transformers 5 may write)."""
    if not hf.get("text_of"):
        return cls.checkpoint_names(hf)
    names = reader.names()
    prefix = next((p for p in TEXT_PREFIXES if any(n.startswith(p) for n in names)), None)
    if prefix is None:
        raise CheckpointError(f"{reader.model_dir}: a {hf['text_of']} checkpoint without its text model's tensors "
                              f"(none starts with {' or '.join(TEXT_PREFIXES)})")
    head = "language_model.lm_head." if prefix == TEXT_PREFIXES[0] else "lm_head."
    return lambda name: (prefix + name[len("model."):] if name.startswith("model.")
                         else head + name[len("lm_head."):] if name.startswith("lm_head.") else name)
