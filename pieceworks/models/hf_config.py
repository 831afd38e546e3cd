"""The config.json fields the models read, with their types and the arithmetic they must satisfy.

`check(hf, arch)` runs before a model is built (from a checkpoint's config.json or from a preset plus
`model.sizes`), so a value that makes no model is refused with the key, the bad value and what is
allowed instead of failing later as a KeyError, a division by zero or a shape error inside torch.
It raises `FieldError` (a `CheckpointError` carrying the key); the loader names the file, or turns it
into a `ConfigError` naming `model.sizes.<key>` when the value came from there.
"""

from __future__ import annotations

import math
from typing import Any

from pieceworks.config_checks import INT_MAX
from pieceworks.errors import CheckpointError
from pieceworks.models.families import family, WINDOWED, with_defaults


# the rope types pieceworks implements (models/rope.py) and the settings each needs beyond rope_theta
ROPE_NEEDS = {"default": (), "linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "yarn": (), "longrope": ("short_factor", "long_factor")}


def _rope_form(params: dict) -> dict:
    """Rope settings without rope_theta, `type` read as `rope_type`: what rope_parameters and rope_scaling
    must agree on when a config.json holds both."""
    out = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    out.setdefault("rope_type", params.get("type", "default"))
    return out


class FieldError(CheckpointError):
    """A config.json field is missing, of the wrong type or out of range. `key` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.detail = message


# (type, rule) per field; rule: "pos" >= 1, "nonneg" >= 0, "posf" a finite float > 0. Required
# fields have no default in the models; the others fall back to transformers' defaults.
_COMMON = {
    "vocab_size": ("int", "pos", True),
    "hidden_size": ("int", "pos", True),
    "intermediate_size": ("int", "pos", True),
    "num_hidden_layers": ("int", "pos", True),
    "num_attention_heads": ("int", "pos", True),
    "max_position_embeddings": ("int", "pos", False),
    "rms_norm_eps": ("float", "posf", False),
    "rope_theta": ("float", "posf", False),
    "tie_word_embeddings": ("bool", None, False),
    "rope_scaling": ("dict", None, False),
    "rope_parameters": ("dict", None, False),
    "attention_bias": ("bool", None, False),
    "hidden_act": ("str", None, False),
}
FIELDS: dict[str, dict[str, tuple[str, str | None, bool]]] = {
    "llama": {
        **_COMMON,
        "num_key_value_heads": ("int", "pos", False),
        "head_dim": ("int", "pos", False),
        "mlp_bias": ("bool", None, False),
        "sliding_window": ("int", "nonneg", False),  # Mistral's and Qwen's (a shorter one caps the context)
        "use_sliding_window": ("bool", None, False),
        "qkv_bias": ("bool", None, False),  # Qwen2-MoE's
        "attention_out_bias": ("bool", None, False),  # Seed-OSS's (o_proj; its attention_bias is q/k/v's)
        # Qwen2-MoE's, Qwen3-MoE's and Mixtral's experts
        "num_experts": ("int", "nonneg", False),
        "num_local_experts": ("int", "nonneg", False),
        "num_experts_per_tok": ("int", "pos", False),
        "moe_intermediate_size": ("int", "pos", False),
        "decoder_sparse_step": ("int", "pos", False),
        "norm_topk_prob": ("bool", None, False),
        "shared_expert_intermediate_size": ("int", "nonneg", False),
        # GLM-4.5's (Glm4MoeForCausalLM): DeepSeek-V3's routing and shared experts, dense first layers, q/k norms
        "n_routed_experts": ("int", "nonneg", False),
        "n_shared_experts": ("int", "nonneg", False),
        "n_group": ("int", "pos", False),
        "topk_group": ("int", "pos", False),
        "routed_scaling_factor": ("float", "posf", False),
        "first_k_dense_replace": ("int", "nonneg", False),
        "use_qk_norm": ("bool", None, False),
        "num_nextn_predict_layers": ("int", "nonneg", False),
        # ERNIE 4.5's: biases on every projection (refused), its experts (MoE layers from start to end, every
        # interval-th), their renormalization's floor
        "use_bias": ("bool", None, False),
        "moe_num_experts": ("int", "nonneg", False),
        "moe_k": ("int", "pos", False),
        "moe_num_shared_experts": ("int", "nonneg", False),
        "moe_layer_start_index": ("int", "nonneg", False),
        "moe_layer_end_index": ("int", None, False),
        "moe_layer_interval": ("int", "pos", False),
        "moe_norm_min": ("float", "posf", False),
        # Gemma's: the attention's scale, sliding-window layers (Gemma 3's rope base), GeGLU, Gemma 2's soft-capping
        "query_pre_attn_scalar": ("float", "posf", False),
        "sliding_window_pattern": ("int", "pos", False),
        "rope_local_base_freq": ("float", "posf", False),
        "hidden_activation": ("str", None, False),
        "final_logit_softcapping": ("float", "posf", False),
        "attn_logit_softcapping": ("float", "posf", False),
        "use_bidirectional_attention": ("bool", None, False),
        "layer_types": ("list", None, False),  # Gemma 3's sliding / full layers (the others: all full_attention)
        # SmolLM3's NoPE layers: 1 rotates, 0 does not (or every interval-th layer without rope)
        "no_rope_layers": ("list", None, False),
        "no_rope_layer_interval": ("int", "pos", False),
        # Phi-3.5 / Phi-4-mini's rope (longrope's original context, the rotated share of each head)
        "original_max_position_embeddings": ("int", "pos", False),
        "partial_rotary_factor": ("float", None, False),
        # Granite's scalars (models/granite.py)
        "embedding_multiplier": ("float", "posf", False),
        "residual_multiplier": ("float", "posf", False),
        "attention_multiplier": ("float", "posf", False),
        "logits_scaling": ("float", "posf", False),
    },
    "deepseek_v3": {
        **_COMMON,
        "num_key_value_heads": ("int", "pos", False),
        "moe_intermediate_size": ("int", "pos", False),
        "q_lora_rank": ("int", "nonneg", False),
        "kv_lora_rank": ("int", "pos", True),
        "qk_nope_head_dim": ("int", "pos", True),
        "qk_rope_head_dim": ("int", "pos", True),
        "v_head_dim": ("int", "pos", True),
        "n_routed_experts": ("int", "nonneg", False),
        "n_shared_experts": ("int", "nonneg", False),
        "num_experts_per_tok": ("int", "pos", False),
        "n_group": ("int", "pos", False),
        "topk_group": ("int", "pos", False),
        "norm_topk_prob": ("bool", None, False),
        "routed_scaling_factor": ("float", "posf", False),
        "first_k_dense_replace": ("int", "nonneg", False),
        "moe_layer_freq": ("int", "pos", False),
        "rope_interleave": ("bool", None, False),
        "num_nextn_predict_layers": ("int", "nonneg", False),
        "scoring_func": ("str", None, False),
        "topk_method": ("str", None, False),
        "mlp_layer_types": ("list", None, False),  # GLM-4.7-Flash's: "dense" or "sparse" per layer
    },
}
# Keys a config.json carries that change nothing in pieceworks' models; `model.sizes` may set them.
METADATA = ("architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
            "dtype", "initializer_range", "use_cache", "attention_dropout", "transformers_version",
            "pretraining_tp", "quantization_config")


def known_keys(arch: str) -> list[str]:
    """Every key `model.sizes` may set for `arch`."""
    return sorted([*FIELDS[arch], *METADATA])


def _type_ok(kind: str, v: Any) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "dict":
        return isinstance(v, dict)
    if kind == "list":
        return isinstance(v, list)
    return isinstance(v, str)


_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "dict": "a mapping",
          "str": "a string", "list": "a list"}


def rotary_dim(hf: dict) -> int:
    """A Llama-family head's rotated dimensions: head_dim times partial_rotary_factor (Phi-4-mini's 0.75)."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return int(head_dim * partial_rotary_factor(hf, hf.get("rope_parameters") or hf.get("rope_scaling") or {}))


PARTIAL_ROTARY = ("phi3", "glm4", "glm4_moe", "glm4_moe_lite")
"""The models whose transformers attention rotates part of each head (partial_rotary_factor); the others' rotate
all of it whatever their config says, and so does pieceworks (GLM-4.7-Flash's MLA rotates whole rope heads only:
a factor below 1 is refused there)."""


def given_partial_rotary_factor(hf: dict, params: dict) -> Any:
    """The config's partial_rotary_factor: the rope settings', else the top-level one, else 1.0."""
    top = hf.get("partial_rotary_factor")
    return params.get("partial_rotary_factor", 1.0 if top is None else top)


def partial_rotary_factor(hf: dict, params: dict) -> Any:
    """The rotated share of each head: the given factor in `PARTIAL_ROTARY`'s models, 1.0 elsewhere."""
    return given_partial_rotary_factor(hf, params) if family(hf) in PARTIAL_ROTARY else 1.0


def rope_layers(hf: dict) -> tuple[bool, ...]:
    """Whether each layer rotates q and k: all of them, but SmolLM3's NoPE layers (its `no_rope_layers`, else every
    `no_rope_layer_interval`-th layer, as transformers derives them)."""
    n = hf["num_hidden_layers"]
    if hf.get("model_type") != "smollm3" and "SmolLM3ForCausalLM" not in (hf.get("architectures") or []):
        return (True,) * n
    nope = hf.get("no_rope_layers")
    if nope is None:
        every = hf.get("no_rope_layer_interval", 4)
        nope = [int((i + 1) % every != 0) for i in range(n)]
    return tuple(bool(v) for v in nope[:n])


QWEN_WINDOWS = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
"""The families whose sliding window applies with use_sliding_window (`context_cap`), in the layers transformers
derives from max_window_layers or lists in layer_types."""


def context_cap(hf: dict) -> tuple[int, str] | None:
    """A Llama-family config's limit below max_position_embeddings on the sequences pieceworks runs as the model
    defines them, with its reason, or None. A Qwen family's sliding window (`use_sliding_window`): pieceworks runs
    full attention, equal to the window's while a sequence fits it (Mistral's, Mixtral's and Phi-3's windows run as
    windows: `families.layer_windows`). longrope (Phi-3.5-mini's, Phi-4-mini's):
    pieceworks computes the short factors, which transformers applies while a sequence fits the original context.
    The shorter wins (`models.base.context_limit`)."""
    positions, caps = hf.get("max_position_embeddings", 2048), []
    window = hf.get("sliding_window")
    if window is not None and hf.get("use_sliding_window", True) is not False and family(hf) not in WINDOWED:
        caps.append((window, f"the model's sliding window ({window} tokens, config.json sliding_window): pieceworks "
                             "runs full attention, which equals the window's only while a sequence fits it"))
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) == "longrope":
        old = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings", positions)
        caps.append((old, f"the model's longrope scaling (original_max_position_embeddings {old}): pieceworks "
                          "applies its short factors, which hold only while a sequence fits that context"))
    caps = [c for c in caps if c[0] < positions]
    return min(caps) if caps else None


def _check_groups(hf: dict, experts: int, grouped: bool = True) -> None:
    """DeepSeek-V3's (and GLM-4.5's) expert groups: at most n_group kept, n_group dividing the experts where the
    routing uses groups (`grouped`; DeepSeek-V2's greedy routing ignores them)."""
    groups = hf.get("n_group") or 1
    if (hf.get("topk_group") or 1) > groups:
        raise FieldError("topk_group", f"{hf.get('topk_group')} exceeds n_group={groups}")
    if grouped and experts and experts % groups:
        raise FieldError("n_group", f"{groups} does not divide the {experts} routed experts into equal groups")


def check(hf: dict, arch: str) -> None:
    """Raise `FieldError` for the first field of `hf` (a config.json dict) that makes no `arch` model.

    Checks presence of the required fields, types (an integer where a count is expected: not "64" or
    2.5), ranges (positive counts, a finite positive rms_norm_eps, rope_theta and rope scaling factors,
    a pretraining context of at least one position) and the shapes' arithmetic (heads divide the hidden
    size without head_dim, KV heads divide heads, rope head size even, top-k within the experts), its family's
    defaults filled in (`with_defaults`).
    """
    hf = with_defaults(hf)
    for key, (kind, rule, required) in FIELDS[arch].items():
        if key not in hf or (hf[key] is None and not required):
            if required:
                raise FieldError(key, f"missing; a {arch} config.json needs it ({_WORDS[kind]})")
            continue
        v = hf[key]
        if not _type_ok(kind, v):
            raise FieldError(key, f"{v!r} ({type(v).__name__}) must be {_WORDS[kind]}")
        if rule == "pos" and v < 1:
            raise FieldError(key, f"{v!r} must be >= 1")
        # sizes torch allocates; not positions, whose tables the context caps (model.max_context)
        if kind == "int" and v > INT_MAX and "position" not in key:
            raise FieldError(key, f"{v!r} must be at most {INT_MAX}")
        if rule == "nonneg" and v < 0:
            raise FieldError(key, f"{v!r} must be >= 0")
        if rule == "posf" and not (math.isfinite(v) and v > 0):
            raise FieldError(key, f"{v!r} must be a finite number > 0")
    heads = hf["num_attention_heads"]
    if arch == "llama":
        if hf.get("head_dim") is None and hf["hidden_size"] % heads:
            raise FieldError("num_attention_heads", f"{heads} does not divide hidden_size={hf['hidden_size']} "
                                                    "(set head_dim, or use a divisor)")
        # Mistral's window (null from Mistral 7B v0.2 on is full attention); Qwen's applies with use_sliding_window
        # (Qwen2-MoE's configs write 0 with use_sliding_window false); a window shorter than the context caps it
        # (`context_cap`)
        if hf.get("sliding_window") == 0 and hf.get("use_sliding_window", True) is not False:
            raise FieldError("sliding_window", "0 must be >= 1 (or null for full attention)")
        key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                    if hf.get(k) is not None), "num_experts")
        k_key = "moe_k" if hf.get("moe_k") is not None else "num_experts_per_tok"
        experts, top_k = hf.get(key) or 0, hf.get(k_key) or 0
        if experts and top_k > experts:
            raise FieldError(k_key, f"{top_k} exceeds {key}={experts}")
        _check_groups(hf, experts)
        if (hf.get("moe_norm_min") or 0) > 1e-6:  # ERNIE's floor of the renormalization's sum (1e-12: never reached)
            raise FieldError("moe_norm_min", f"{hf['moe_norm_min']!r} is not supported; pieceworks renormalizes the "
                             "chosen experts' scores by their sum (ERNIE 4.5's 1e-12)")
        dense = hf.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise FieldError("mlp_only_layers", f"{dense!r} must be a list of layer indices")
        nope = hf.get("no_rope_layers")
        if nope is not None and (len(nope) < hf["num_hidden_layers"] or any(v not in (0, 1) or isinstance(v, bool)
                                                                            for v in nope)):
            raise FieldError("no_rope_layers", f"{nope!r} must list 1 (rope) or 0 (none) for each of the "
                             f"{hf['num_hidden_layers']} layers")
        kinds = hf.get("layer_types") or []
        # a Qwen family's sliding layers, as transformers 5 lists them from use_sliding_window: full attention, the
        # context capped at the window where it applies (`context_cap`)
        kinds_run = ("full_attention", "sliding_attention") if family(hf) in QWEN_WINDOWS else ("full_attention",)
        if not isinstance(kinds, list) or any(k not in kinds_run for k in kinds):
            raise FieldError("layer_types", f"{kinds!r}: pieceworks' Llama runs full attention in every layer "
                             '(a list of "full_attention")')
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        if head_dim % 2:
            raise FieldError("head_dim", f"{head_dim} must be even (rope rotates pairs)")
        kv = hf.get("num_key_value_heads") or heads
        if heads % kv:
            raise FieldError("num_key_value_heads", f"{kv} must divide num_attention_heads={heads}")
    else:
        if hf["qk_rope_head_dim"] % 2:
            raise FieldError("qk_rope_head_dim", f"{hf['qk_rope_head_dim']} must be even (rope rotates pairs)")
        experts = hf.get("n_routed_experts") or 0
        if experts:
            if hf.get("moe_intermediate_size") is None:
                raise FieldError("moe_intermediate_size", "missing; needed with n_routed_experts > 0")
            k = hf.get("num_experts_per_tok") or 1
            if k > experts:
                raise FieldError("num_experts_per_tok", f"{k} exceeds n_routed_experts={experts}")
            kinds = hf.get("mlp_layer_types")
            if kinds is not None and (len(kinds) < hf["num_hidden_layers"]
                                      or any(k not in ("dense", "sparse") for k in kinds)):
                raise FieldError("mlp_layer_types", f"{kinds!r} must name \"dense\" or \"sparse\" for each of the "
                                 f"{hf['num_hidden_layers']} layers")
            v2 = hf.get("model_type") == "deepseek_v2" or "DeepseekV2ForCausalLM" in (hf.get("architectures") or [])
            _check_groups(hf, experts, hf.get("topk_method", "greedy" if v2 else "noaux_tc") != "greedy")
    new, old = hf.get("rope_parameters"), hf.get("rope_scaling")
    if isinstance(new, dict) and isinstance(old, dict) and new and old and _rope_form(new) != _rope_form(old):
        # readers differ in which one they apply (transformers 5 takes rope_scaling's factor)
        raise FieldError("rope_scaling", f"{old} disagrees with rope_parameters {new}; keep the one the model "
                         "was trained with and remove the other")
    key = "rope_parameters" if new else "rope_scaling"
    rope = hf.get(key)
    if isinstance(rope, dict) and rope:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ROPE_NEEDS or (kind == "longrope" and arch != "llama"):
            raise FieldError(f"{key}.rope_type", f"{kind!r} is not supported; pieceworks implements "
                             f"{', '.join(ROPE_NEEDS)}")
        for name in ROPE_NEEDS[kind]:
            if name not in rope:
                raise FieldError(f"{key}.{name}", f"missing; {kind} rope needs it")
    for key in ("rope_scaling", "rope_parameters"):
        params = hf.get(key) or {}
        given, partial = given_partial_rotary_factor(hf, params), partial_rotary_factor(hf, params)
        if not (_type_ok("float", given) and 0 < given <= 1):  # Phi-4-mini's 0.75 rotates part of each head
            raise FieldError(f"{key}.partial_rotary_factor", f"{given!r} must be a number in (0, 1]")
        if arch != "llama" and partial != 1.0:
            raise FieldError(f"{key}.partial_rotary_factor", f"{partial!r}: pieceworks' {arch} rotates whole heads")
        if arch == "llama" and (rotary_dim(hf) < 2 or rotary_dim(hf) % 2):
            raise FieldError(f"{key}.partial_rotary_factor", f"{partial!r} rotates {rotary_dim(hf)} of each head's "
                             "dimensions; pieceworks rotates an even number of at least 2")
        for name in ("short_factor", "long_factor"):
            if name in params and (not isinstance(params[name], list) or len(params[name]) * 2 != rotary_dim(hf)
                                   or not all(_type_ok("float", f) and math.isfinite(f) and f > 0
                                              for f in params[name])):
                raise FieldError(f"{key}.{name}", f"must list {rotary_dim(hf) // 2} finite numbers > 0 (one per "
                                 "pair of rotated dimensions)")
        for name in ("factor", "rope_theta", "low_freq_factor", "high_freq_factor"):
            if name in params and not (_type_ok("float", params[name]) and math.isfinite(params[name])
                                       and params[name] > 0):
                raise FieldError(f"{key}.{name}", f"{params[name]!r} must be a finite number > 0")
        for name, positive in (("beta_fast", True), ("beta_slow", True), ("attention_factor", True),
                               ("mscale", False), ("mscale_all_dim", False)):
            value = params.get(name)  # yarn's; null: the default
            if value is not None and not (_type_ok("float", value) and math.isfinite(value)
                                          and (value > 0 if positive else value >= 0)):
                raise FieldError(f"{key}.{name}", f"{value!r} must be a finite number {'>' if positive else '>='} 0")
        old_len = params.get("original_max_position_embeddings", 1)
        if not (_type_ok("int", old_len) and old_len >= 1):
            raise FieldError(f"{key}.original_max_position_embeddings", f"{old_len!r} must be an integer >= 1 "
                             "(the context the model was pretrained with)")
    old_len = hf.get("original_max_position_embeddings")
    if old_len is not None and not (_type_ok("int", old_len) and old_len >= 1):
        raise FieldError("original_max_position_embeddings", f"{old_len!r} must be an integer >= 1 (the context "
                         "the model was pretrained with)")
