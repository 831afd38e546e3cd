"""Config: schema validation, overrides, and error messages that name key, value and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from pieceworks.config import Config, ConfigError, Switch, load_config

BASE = {"model": {"arch": "llama"}}


def err(source, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_config(source, list(overrides))
    return str(e.value)


def test_defaults_and_overrides_give_frozen_plain_objects(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: /models/x\nbackends:\n  mla: {extend: flashinfer, decode: trtllm}\n")
    cfg = load_config(path, ["kv_cache.page_size=64", "cuda_graph.piecewise.sizes=[4,8,16]"])
    assert isinstance(cfg, Config) and cfg.model.path == "/models/x"
    assert cfg.backends.mla == {"extend": "flashinfer", "decode": "trtllm"}
    assert cfg.backends.choice("mla", "decode") == "trtllm" and cfg.backends.choice("attention", "extend") == "auto"
    assert cfg.kv_cache.page_size == 64 and cfg.cuda_graph.piecewise.sizes == [4, 8, 16]
    assert type(cfg.cuda_graph.piecewise.sizes) is list
    assert type(load_config(BASE, ["model.sizes.num_hidden_layers=2"]).model.sizes) is dict
    assert cfg.cuda_graph.piecewise.enabled is Switch.auto
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_cache.page_size = 1
    assert load_config(cfg) == cfg


def test_unknown_key_names_file_line_and_allowed_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  arch: llama\n  hiden: 3\n")
    msg = err(path)
    assert msg.startswith("model.hiden: unknown key") and f"{path}:3" in msg and "allowed keys under model: path, arch" in msg
    assert "runtime.foo: unknown key (in command-line overrides)" in err(BASE, ["runtime.foo=1"])
    assert "unknown key" in err({"model": {"arch": "llama"}, "nonsense": {}})


def test_wrong_types_name_key_and_value(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  arch: llama\nkv_cache:\n  page_size: sixteen\n")
    msg = err(path)
    assert "kv_cache.page_size" in msg and "'sixteen'" in msg and f"{path}:4" in msg
    assert "cuda_graph.piecewise.enabled" in err(BASE, ["cuda_graph.piecewise.enabled=maybe"])
    assert "use auto, on or off" in err(BASE, ["cuda_graph.piecewise.enabled=maybe"])
    assert load_config(BASE, ["cuda_graph.piecewise.enabled=on"]).cuda_graph.piecewise.enabled is Switch.on
    assert load_config(BASE, ["cuda_graph.decode.enabled=off"]).cuda_graph.decode.enabled is Switch.off


@pytest.mark.parametrize("override, needle", [
    ("kv_cache.page_size=0", "kv_cache.page_size: 0 must be >= 1"),
    ("kv_cache.memory_fraction=1.5", "kv_cache.memory_fraction: 1.5 must be in (0, 1]"),
    ("quantization.fp4_numerics=w8a8", "quantization.fp4_numerics: 'w8a8' is not allowed; use one of auto, w4a4, w4a16"),
    ("runtime.dtype=float8", "runtime.dtype: 'float8' is not allowed"),
    ("runtime.device=tpu", "runtime.device: 'tpu' is not allowed; use auto, cpu, cuda or cuda:N"),
    ("cuda_graph.piecewise.max_tokens=0", "cuda_graph.piecewise.max_tokens: 0 must be >= 1"),
    ("cuda_graph.piecewise.sizes=[8,4]", "cuda_graph.piecewise.sizes: [8, 4] must be strictly ascending"),
    ("cuda_graph.piecewise.sizes=[]", "cuda_graph.piecewise.sizes: the list is empty"),
    ("cuda_graph.decode.batch_sizes=[1,1]", "cuda_graph.decode.batch_sizes: [1, 1] must be strictly ascending"),
    ("backends.mla={prefill: x}", "backends.mla: {'prefill': 'x'} is not allowed; use auto, a backend name, or {extend: <name>, decode: <name>}"),
    ("model.arch=gpt2", "model.arch: 'gpt2' is not allowed; use one of llama, deepseek_v3"),
    ("generation.top_p=0", "generation.top_p: 0.0 must be in (0, 1]"),
    ("parallel.timeout_s=inf", "parallel.timeout_s: inf must be > 0 and at most 1,000,000"),
    ("model.path=''", "model.path: empty; give a model directory"),
])
def test_invalid_values(override, needle):
    assert needle in err(BASE, [override])


def test_preset_and_sizes_shape_random_weights_only():
    for override, key in (("model.preset=tiny", "model.preset"), ("model.sizes.num_hidden_layers=1", "model.sizes")):
        msg = err({"model": {"path": "/models/x"}}, [override])
        assert msg.startswith(f"{key}: shapes the random-weight model") and "config.json gives the shape" in msg


def test_cache_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    assert f"runtime.cache_dir: {tmp_path / 'f'} is a file; give a directory" in err(
        BASE, [f"runtime.cache_dir={tmp_path / 'f'}"])
    assert load_config(BASE, [f"runtime.cache_dir={tmp_path / 'new'}"]).runtime.cache_dir == str(tmp_path / "new")
    assert "runtime.cache_dir: ~nosuchuser/x: no home directory for its ~user" in err(
        BASE, ["runtime.cache_dir=~nosuchuser/x"])


def test_a_memory_fraction_too_small_for_two_pages_says_so():
    from pieceworks import Executor

    with pytest.raises(ValueError, match=r"kv_cache.memory_fraction=1e-12 of it holds 0 tokens .* fewer than 2 pages. "
                                         "Raise memory_fraction"):
        Executor.from_config(BASE, ["model.preset=tiny", "runtime.device=cpu", "kv_cache.memory_fraction=1e-12"],
                             progress=False)


def test_generation_prompts_are_strings():
    assert "generation.prompts: [[1, 2]] must be a list of strings" in err(BASE, ["generation.prompts=[[1,2]]"])


def test_a_config_made_in_code_is_checked_like_a_yaml_one():
    """Executor.from_config / Engine.from_config take a Config; one built or replaced in code goes through the same
    checks (and the same reading of its switches) as a YAML file."""
    from pieceworks import Engine, Executor
    from pieceworks.config import KVCacheConfig, PiecewiseConfig

    cfg = load_config(BASE, ["model.preset=tiny", "runtime.device=cpu", "kv_cache.num_tokens=256"])
    bad = dataclasses.replace(cfg, kv_cache=KVCacheConfig(page_size=0, num_tokens=256))
    for build in (Executor.from_config, Engine.from_config):
        with pytest.raises(ConfigError, match="kv_cache.page_size: 0 must be >= 1"):
            build(bad, progress=False)
    on = dataclasses.replace(cfg, cuda_graph=dataclasses.replace(cfg.cuda_graph, piecewise=PiecewiseConfig(
        enabled="on", sizes=[8])), model=dataclasses.replace(cfg.model, sizes={"num_hidden_layers": 1}))
    with Executor.from_config(on, progress=False) as ex:
        assert ex.piecewise is not None  # "on" reads as the switch on, as in YAML


def test_model_is_required_unless_told_otherwise():
    assert "set model.path" in err({})
    assert load_config({}, require_model=False).model.path is None
    assert "not both" in err({"model": {"arch": "llama", "path": "/x"}})


def test_bad_override_syntax_and_missing_file(tmp_path):
    assert "expected key=value" in err(BASE, ["model.arch"])
    assert "does not exist" in err(tmp_path / "missing.yaml")


def test_shipped_configs_load_with_every_value_they_set():
    import pathlib

    from omegaconf import OmegaConf

    from pieceworks.config import as_dict

    def leaves(node, prefix=()):
        for key, value in node.items():
            yield from leaves(value, (*prefix, key)) if isinstance(value, dict) else [((*prefix, key), value)]

    paths = sorted(pathlib.Path(__file__).parents[1].joinpath("configs").glob("*.yaml"))
    assert len(paths) >= 3
    for path in paths:
        loaded, written = as_dict(load_config(path)), list(leaves(OmegaConf.to_container(OmegaConf.load(path))))
        assert written, path
        for keys, value in written:
            got = loaded
            for key in keys:
                got = got[key]
            assert got == value, (path, ".".join(keys), got, value)


def test_to_yaml_reads_back_as_the_same_config(tmp_path):
    from pieceworks.config import to_yaml

    cfg = load_config(None, ["model.arch=llama", "backends.attention={extend: torch}", "runtime.pdl=off",
                             "model.sizes={num_hidden_layers: 3}", "cuda_graph.decode.batch_sizes=[1,2]"])
    path = tmp_path / "round.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_default_cache_root_follows_xdg_cache_home(monkeypatch, tmp_path):
    from pieceworks.config import cache_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "pieceworks"
    assert cache_root(str(tmp_path / "mine")) == tmp_path / "mine"  # runtime.cache_dir wins
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says to ignore it
    assert cache_root().parts[-2:] == (".cache", "pieceworks")
