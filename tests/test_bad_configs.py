"""The config boundary's catalog of bad input: each case is refused with a ConfigError naming the file
(and line) or key, the bad value and what is allowed, before a model is built or weights allocated."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends.base import BackendSpec
from pieceworks.backends.registry import load_registry
from pieceworks.config import ConfigError, load_config
from pieceworks.executor.kv_cache import KVLayout, KVPool
from pieceworks.models.loader import model_facts

LLAMA = ["model.arch=llama", "model.preset=tiny", "runtime.device=cpu"]
DEEPSEEK = ["model.arch=deepseek_v3", "model.preset=tiny", "runtime.device=cpu"]

# (file text, needle): the message must hold the needle and the file's name.
YAML_CASES = {
    "tab": ("model:\n  arch: llama\n\tpreset: tiny\n", ":3: not valid YAML: found a tab character"),
    "duplicate key": ("model:\n  arch: llama\n  arch: deepseek_v3\n", ":3: not valid YAML: found duplicate key arch"),
    "unclosed bracket": ("model:\n  arch: [llama\n", ": not valid YAML: did not find expected ',' or ']'"),
    "top-level list": ("- model\n- kv_cache\n", ": the top level is a list; it must be a mapping of sections"),
    "top-level scalar": ("llama\n", ": the top level is a single value; it must be a mapping"),
    "unknown key with line": ("model:\n  arch: llama\n  hiden: 3\n", "model.hiden: unknown key"),
    "wrong type with line": ("model:\n  arch: llama\nkv_cache:\n  page_size: sixteen\n", ":4)"),
    "scalar for a list": ("model:\n  arch: llama\ngeneration:\n  prompts: hi\n",
                          'generation.prompts: expected a list (e.g. prompts: ["Hi","Hello"]), got \'hi\''),
    "list for a section": ("model:\n  arch: llama\nkv_cache: [1]\n",
                           "kv_cache: expected a mapping of kv_cache settings (e.g. kv_cache: {page_size: 16}), "
                           "got [1]"),
    "tab in a value": ("model:\n  arch:\tllama\n", ":2: not valid YAML: found character '\\t'"),
    "top-level number": ("42\n", ": the top level is a single value; it must be a mapping"),
    "nested too deeply": ("model:\n  sizes:\n" + "".join("  " * (i + 2) + f"a{i}:\n" for i in range(200)) +
                          "  " * 202 + "x: 1\n", ": nested too deeply to read"),
    "an integer of 5000 digits": ("runtime:\n  seed: " + "1" * 5000 + "\n",
                                  ": a value can't be read (Exceeds the limit (4300 digits)"),
    "missing value": ("model:\n  arch: ???\n", "model.arch: ??? (OmegaConf's missing value) is no setting; give a "
                                                "value, or leave the key out (in "),
    "a number for a flag": ("kv_cache:\n  prefix_caching: 2\n",
                            "kv_cache.prefix_caching: expected true or false (e.g. prefix_caching: true), got 2"),
    "a base-60 number": ("model:\n  arch: llama\nkv_cache:\n  page_size: 1:00\n",
                         ":4: 1:00 reads as 60 (YAML 1.1: a base-60 number); write 60 if that is meant, or quote "
                         "'1:00' for the text"),
    "an octal number in a list": ("cuda_graph:\n  piecewise:\n    sizes: [2, 016]\n",
                                  ":3: 016 reads as 14 (YAML 1.1: an octal number)"),
}


@pytest.mark.parametrize("name", YAML_CASES)
def test_bad_yaml_files(tmp_path, name):
    text, needle = YAML_CASES[name]
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and str(path) in str(e.value), str(e.value)


def test_a_scalar_section_names_the_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("runtime:\n  device: cpu\nmodel: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"model: expected a mapping of model settings (e.g. model: {{arch: llama}}), got 5 "
                            f"(in {path}:3)")


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match=r"is a directory; give a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "latin1.yaml").write_bytes("model:\n  arch: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 18"):
        load_config(tmp_path / "latin1.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml", require_model=False).model.arch is None


# (overrides, needle): values the schema refuses as soon as the config loads.
VALUE_CASES = [
    (["generation.temperature=-1"], "generation.temperature: -1.0 must be a finite number >= 0"),
    (["generation.temperature=nan"], "generation.temperature: nan must be a finite number >= 0"),
    (["generation.top_p=0"], "generation.top_p: 0.0 must be in (0, 1]"),
    (["generation.top_p=5"], "generation.top_p: 5.0 must be in (0, 1]"),
    (["generation.max_new_tokens=2.5"], "generation.max_new_tokens"),
    (["kv_cache.page_size=0"], "kv_cache.page_size: 0 must be >= 1"),
    (["backends.attention={extend: torch, prefill: torch}"], "backends.attention: "),
    (["backends.attention={extend: 3}"], "backends.attention: "),
    (["model.max_context=0"], "model.max_context: 0 must be >= 1"),
    (["model.arch=[llama"], "model.arch: can't parse the value '[llama' (did not find expected ',' or ']'); "
                            "quote it or fix the brackets"),
    (["model.sizes={a: 1"], "model.sizes: can't parse the value '{a: 1' (did not find expected ',' or '}')"),
    (["runtime.seed=99999999999999999999999"],
     "runtime.seed: 99999999999999999999999 is out of range; use an integer from -2**63 to 2**64 - 1"),
    ([f"runtime.seed={-2**63 - 1}"], f"runtime.seed: {-2**63 - 1} is out of range"),
    (["generation.prompts=hello"],
     'generation.prompts: expected a list (e.g. generation.prompts=["Hi","Hello"]), got \'hello\' (in command-line '
     'overrides)'),
    (["plugins.disabled=5"],
     "plugins.disabled: expected a list (e.g. plugins.disabled=[pieceworks.flashinfer]), got 5"),
    (["plugins.disabled={a: 1}"], "plugins.disabled: expected a list (e.g. plugins.disabled=[pieceworks.flashinfer]), "
                                  "got {'a': 1}"),
    (["cuda_graph.piecewise.sizes=4"], "cuda_graph.piecewise.sizes: expected a list (e.g. cuda_graph.piecewise.sizes="
                                       "[16,32,64]), got 4"),
    (["model.sizes=5"], "model.sizes: expected a mapping (e.g. model.sizes={num_hidden_layers: 4}), got 5"),
    (["model=5"], "model: expected a mapping of model settings (e.g. model={arch: llama}), got 5"),
    (["model..arch=llama"], "override 'model..arch=llama': the key 'model..arch' is malformed (empty part between "
                            "dots); did you mean model.arch=llama?"),
    ([".model.arch=llama"],
     "the key '.model.arch' is malformed (it starts with a dot); did you mean model.arch=llama?"),
    (["backends.options.flashinfer={variant: fa2}", "backends.options.flashinfer=[1]"],
     "backends.options.flashinfer: [1] is a list and can't replace {'variant': 'fa2'}, a mapping set before it; "
     "give a mapping or drop the earlier setting"),
    (["model.arch="], "override 'model.arch=': no value; give one, or model.arch=null to unset the key"),
    (["model.arch=???"], "model.arch: ??? (OmegaConf's missing value) is no setting"),
    (["runtime.cache_dir=''"], "runtime.cache_dir: empty; give a directory, or null for the default"),
    (["model.arch =llama"], "the key 'model.arch ' has spaces around it; write model.arch=llama"),
    (["kv_cache.prefix_caching=-1"], "kv_cache.prefix_caching: expected true or false (e.g. "
                                     "kv_cache.prefix_caching=true), got -1"),
    (["scheduler.async_steps='16'"], "scheduler.async_steps: expected true or false"),
    (["cuda_graph.piecewise.enabled=on", "cuda_graph.piecewise.sizes=[1,2]"],
     "cuda_graph.piecewise.sizes: [1, 2] starts at 1; the piecewise graphs' token dimension is traced dynamic"),
    (["runtime.device=cuda:\u0663"], "runtime.device: 'cuda:\u0663' is not allowed; use auto, cpu, cuda or cuda:N"),
    (["runtime.device=cuda:99999999999999999999"], "runtime.device: 'cuda:99999999999999999999' is not allowed"),
    (["cuda_graph.piecewise.max_tokens=99999999999999999999"],
     "cuda_graph.piecewise.max_tokens: 99999999999999999999 must be at most 2147483647"),
    (["runtime.seed=" + "1" * 5000], "runtime.seed: can't read the value (Exceeds the limit (4300 digits)"),
    (["kv_cache.page_size=016"], "kv_cache.page_size: 016 reads as 14 (YAML 1.1: an octal number); write 14 if that "
                                 "is meant, or quote '016' for the text"),
    (["model.path=-1:30"], "model.path: -1:30 reads as -90 (YAML 1.1: a base-60 number)"),
    (["generation.temperature=1:30.5"], "generation.temperature: 1:30.5 reads as 90.5 (YAML 1.1: a base-60 number)"),
]


@pytest.mark.parametrize("overrides, needle", VALUE_CASES, ids=[c[0][0][:40] for c in VALUE_CASES])
def test_bad_values(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, LLAMA + overrides)
    assert needle in str(e.value), str(e.value)


def test_seed_range_ends_load():
    """The ends of runtime.seed's range are what torch.Generator.manual_seed accepts."""
    for seed in (-2**63, 2**64 - 1):
        cfg = load_config(None, LLAMA + [f"runtime.seed={seed}"])
        assert torch.Generator().manual_seed(cfg.runtime.seed).initial_seed() == seed % 2**64


def _facts(overrides):
    cfg = load_config(None, overrides)
    return model_facts(cfg.model, cfg.quantization, cfg.kv_cache.page_size)


# (base, overrides, needle): model.sizes checked against the model's fields and arithmetic, on the meta
# device (no weights allocated).
SIZES_CASES = [
    (LLAMA, ["model.sizes.num_hidden_layers=0"], "model.sizes.num_hidden_layers: 0 must be >= 1"),
    (LLAMA, ["model.sizes.num_attention_heads=3", "model.sizes.num_key_value_heads=3", "model.sizes.head_dim=null"],
     "model.sizes.num_attention_heads: 3 does not divide hidden_size=64"),
    (LLAMA, ["model.sizes.num_attention_heads=3"], "num_key_value_heads: 2 must divide num_attention_heads=3"),
    (LLAMA, ["model.sizes.vocab_size=-1"], "model.sizes.vocab_size: -1 must be >= 1"),
    (LLAMA, ["model.sizes.vocab_size=0"], "model.sizes.vocab_size: 0 must be >= 1"),
    (LLAMA, ["model.sizes.vocab_size=99999999999999999999"],
     "model.sizes.vocab_size: 99999999999999999999 must be at most 2147483647"),
    (LLAMA, ["model.sizes.hidden_size=abc"], "model.sizes.hidden_size: 'abc' (str) must be an integer"),
    (LLAMA, ["model.sizes.hidden_size=[64]"], "model.sizes.hidden_size: [64] (list) must be an integer"),
    (LLAMA, ["model.sizes.num_hidden_layers=2.5"], "model.sizes.num_hidden_layers: 2.5 (float) must be an integer"),
    (LLAMA, ["model.sizes.rope_theta=abc"], "model.sizes.rope_theta: 'abc' (str) must be a number"),
    (LLAMA, ["model.sizes.rms_norm_eps=-1"], "model.sizes.rms_norm_eps: -1 must be a finite number > 0"),
    (LLAMA, ["model.sizes.max_position_embeddings=0"], "model.sizes.max_position_embeddings: 0 must be >= 1"),
    (LLAMA, ["model.sizes.head_dim=15"], "model.sizes.head_dim: 15 must be even"),
    (LLAMA, ["model.sizes.tie_word_embeddings=3"], "model.sizes.tie_word_embeddings: 3 (int) must be true or false"),
    (LLAMA, ["model.sizes.num_hiden_layers=2"], "model.sizes.num_hiden_layers: unknown key for model.arch=llama"),
    (LLAMA, ["model.sizes.kv_lora_rank=8"], "model.sizes.kv_lora_rank: unknown key for model.arch=llama"),
    (DEEPSEEK, ["model.sizes.num_experts_per_tok=9"], "model.sizes.num_experts_per_tok: 9 exceeds n_routed_experts=8"),
    (DEEPSEEK, ["model.sizes.qk_rope_head_dim=15"], "model.sizes.qk_rope_head_dim: 15 must be even"),
    (DEEPSEEK, ["model.sizes.kv_lora_rank=0"], "model.sizes.kv_lora_rank: 0 must be >= 1"),
    (DEEPSEEK, ["model.sizes.topk_group=3"], "model.sizes.topk_group: 3 exceeds n_group=2"),
    (LLAMA, ["model.sizes.final_logit_softcapping=-1.0", "model.sizes.model_type=gemma2"],
     "model.sizes.final_logit_softcapping: -1.0 must be a finite number > 0"),
    (LLAMA, ["model.sizes.use_bidirectional_attention=true", "model.sizes.model_type=gemma3_text"],
     "model.sizes.use_bidirectional_attention: true: pieceworks runs causal attention"),
    (LLAMA, ["model.sizes.layer_types=[sliding_attention,chunked_attention]", "model.sizes.model_type=gemma3_text"],
     "must name sliding_attention or full_attention for each of the 2 layers"),
    (LLAMA, ["model.sizes.moe_norm_min=0.5", "model.sizes.model_type=ernie4_5_moe", "model.sizes.moe_num_experts=4",
             "model.sizes.moe_k=2"], "model.sizes.moe_norm_min: 0.5 is not supported"),
    (LLAMA, ["model.sizes.sliding_window=0", "model.sizes.model_type=gemma3_text"],
     "model.sizes.sliding_window: 0 must be an integer >= 1"),
    (LLAMA, ["model.sizes.hidden_activation=gelu", "model.sizes.model_type=gemma3_text"],
     "model.sizes.hidden_activation: 'gelu': pieceworks' Gemma runs gelu_pytorch_tanh"),
    (DEEPSEEK, ["model.sizes.mlp_layer_types=[dense,moe,sparse]"],
     'model.sizes.mlp_layer_types: [\'dense\', \'moe\', \'sparse\'] must name "dense" or "sparse" for each of the 3'),
    (DEEPSEEK, ["model.sizes.mlp_layer_types=[dense,sparse]"], "for each of the 3 layers"),
    (DEEPSEEK, ["model.sizes.n_group=3"], "model.sizes.n_group: 3 does not divide the 8 routed experts"),
    (LLAMA, ["model.sizes.num_experts_per_tok=9", "model.sizes.model_type=glm4_moe", "model.sizes.n_routed_experts=8"],
     "model.sizes.num_experts_per_tok: 9 exceeds n_routed_experts=8"),
    (LLAMA, ["model.sizes.n_group=3", "model.sizes.model_type=glm4_moe", "model.sizes.n_routed_experts=8"],
     "model.sizes.n_group: 3 does not divide the 8 routed experts"),
    (LLAMA, ["model.preset=huge"], "model.preset='huge': unknown for arch llama"),
]


@pytest.mark.parametrize("base, overrides, needle", SIZES_CASES, ids=[c[1][0] for c in SIZES_CASES])
def test_bad_model_sizes(base, overrides, needle):
    with pytest.raises(ConfigError) as e:
        _facts(base + overrides)
    assert needle in str(e.value), str(e.value)


def test_deepseek_v2_greedy_routing_ignores_its_groups():
    """DeepSeek-V2's greedy routing never groups the experts: an n_group that does not divide them builds."""
    facts, _ = _facts(DEEPSEEK + ["model.sizes.model_type=deepseek_v2", "model.sizes.topk_method=greedy",
                                  "model.sizes.n_group=3", "model.sizes.norm_topk_prob=false"])
    assert facts.moe_experts == 8


def test_good_sizes_still_build():
    facts, ops = _facts(LLAMA + ["model.sizes.num_hidden_layers=1", "model.sizes.bos_token_id=1"])
    assert facts.num_heads == 4 and ops == {"attention"}


def _resolve(overrides):
    cfg = load_config(None, overrides)
    facts, ops = model_facts(cfg.model, cfg.quantization, cfg.kv_cache.page_size)
    spec = BackendSpec.for_device(torch.device("cpu"), model=facts)
    return load_registry(cfg.plugins).resolve(cfg.backends, spec, ops)


REGISTRY_CASES = [
    (["backends.mla=nosuch"], "backends.mla: no mla backend named 'nosuch'; registered: "),
    (["backends.attention={extend: torch, decode: nosuch}"], "backends.attention: no attention backend named 'nosuch'"),
    (["backends.options.nosuch.x=1"], "backends.options.nosuch: no registered backend is named 'nosuch'"),
    (["plugins.disabled=[pieceworks.nosuch]"], "plugins.disabled: 'pieceworks.nosuch' is no plugin here; known: "),
    # the values of a backend that can't serve here (no CUDA) are checked too
    (["backends.options.triton.cuda_decode_max_m=abc"], "backends.options.triton.cuda_decode_max_m='abc': use 0"),
    (["backends.options.flashinfer.variant=fa9"], "backends.options.flashinfer.variant: 'fa9'; use auto, fa2 or fa3"),
]


@pytest.mark.parametrize("overrides, needle", REGISTRY_CASES, ids=[c[0][0] for c in REGISTRY_CASES])
def test_typos_in_backend_and_plugin_names(overrides, needle):
    """Names are checked for every op, also those a Llama never calls (mla)."""
    with pytest.raises(ConfigError) as e:
        _resolve(LLAMA + overrides)
    assert needle in str(e.value), str(e.value)


def test_a_partial_per_mode_mapping_means_auto_for_the_missing_mode():
    cfg = load_config(None, LLAMA + ["backends.attention={extend: torch}"])
    assert cfg.backends.choice("attention", "decode") == "auto"
    table = _resolve(LLAMA + ["backends.attention={extend: torch}"])
    configured = {(d.op, d.forward_mode.value): d.configured for d in table.decisions}
    assert configured[("attention", "extend")] == "torch" and configured[("attention", "decode")] == "auto"
    assert {d.chosen for d in table.decisions if d.op == "attention" and d.chosen} == {"torch"}  # CPU: only torch


def test_a_huge_page_size_is_blamed_on_the_page_size():
    layout = KVLayout("gqa", 2, num_kv_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match=r"kv_cache.page_size: 1000000000 is too large: a pool needs 2 pages"):
        KVPool.sized(layout, 10**9, torch.float32, torch.device("cpu"), None, 0.85)
    with pytest.raises(ConfigError, match=r"kv_cache.page_size: 4096 exceeds kv_cache.num_tokens=512"):
        KVPool.sized(layout, 4096, torch.float32, torch.device("cpu"), 512, 0.85)


@pytest.mark.parametrize("args, needle", [
    ((None, "model.arch=llama"), "overrides: a list of 'key=value' strings, not 'model.arch=llama'"),
    ((None, ["model.arch=llama", None]), "overrides: a list of 'key=value' strings"),
    ((5,), "config: a YAML path, a dict, a Config or None, not int"),
    ((["model.arch=llama"],), "not list (overrides go in the second argument)"),
])
def test_config_and_overrides_of_the_wrong_kind(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(*args)
    assert needle in str(e.value)
    cfg = load_config(None, (f"model.{k}" for k in ("arch=llama", "preset=tiny")))  # any iterable of strings
    assert cfg.model.preset == "tiny"


def test_decimal_hex_and_quoted_numbers_still_read():
    """Only the numbers that YAML 1.1 reads as another number than the decimal they look like are refused."""
    cfg = load_config(None, LLAMA + ["kv_cache.page_size=0x10", "kv_cache.num_tokens=1_024", "model.max_context=0",
                                     "model.max_context=64", "runtime.device=cpu", "runtime.seed=07"])
    assert (cfg.kv_cache.page_size, cfg.kv_cache.num_tokens, cfg.model.max_context) == (16, 1024, 64)
    assert cfg.runtime.seed == 7  # a leading zero that reads the same in octal
    assert load_config(None, ["model.path='016'", "runtime.device=cpu"]).model.path == "016"
