"""nvrtc's on-disk cubin cache, on the CPU: NVRTC itself is replaced by a counting stand-in."""

from __future__ import annotations

import logging

import pytest

from pieceworks.backends import nvrtc

CUBIN = b"\x7fELF" + bytes(range(256)) * 3  # any bytes, newlines and zeros included, after the ELF magic


@pytest.fixture
def compiles(monkeypatch, tmp_path):
    """The cache in tmp_path/cache; returns the list of (source, name, arch) NVRTC was asked to compile."""
    calls = []

    def fake_compile(source, name, arch):
        calls.append((source, name, arch))
        return CUBIN + name.encode(), f"_Z{len(name)}{name}", ""

    monkeypatch.setattr(nvrtc, "_compile", fake_compile)
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(nvrtc, "_cache_dir", nvrtc._cache_dir)  # restored after the test
    nvrtc.configure_cache(tmp_path / "cache")
    return calls


def test_second_compile_comes_from_the_disk(compiles, tmp_path):
    first = nvrtc.compile_cubin("src", "k<1>", "sm_90")
    assert first == (CUBIN + b"k<1>", "_Z4k<1>") and len(compiles) == 1
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == 1
    assert nvrtc.compile_cubin("src", "k<1>", "sm_90") == first
    assert len(compiles) == 1, "the second call must not compile"


@pytest.mark.parametrize("change", ["source", "name", "arch", "version"])
def test_key_covers_source_name_arch_and_nvrtc_version(compiles, monkeypatch, change):
    nvrtc.compile_cubin("src", "k<1>", "sm_90")
    args = {"source": "src", "name": "k<1>", "arch": "sm_90"}
    if change == "version":
        monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 1))
    else:
        args[change] = {"source": "src2", "name": "k<2>", "arch": "sm_90a"}[change]
    nvrtc.compile_cubin(args["source"], args["name"], args["arch"])
    assert len(compiles) == 2


def test_a_damaged_file_is_compiled_again_and_replaced(compiles, tmp_path, caplog):
    nvrtc.compile_cubin("src", "k<1>", "sm_90")
    (path,) = (tmp_path / "cache").glob("*.cubin")
    path.write_bytes(b"_Z4k<1>\ntruncated")
    with caplog.at_level(logging.WARNING, logger="pieceworks.backends.nvrtc"):
        assert nvrtc.compile_cubin("src", "k<1>", "sm_90")[0] == CUBIN + b"k<1>"
    assert len(compiles) == 2 and "not a cubin" in caplog.text
    assert path.read_bytes().endswith(CUBIN + b"k<1>")
    nvrtc.compile_cubin("src", "k<1>", "sm_90")
    assert len(compiles) == 2


def test_off_and_unwritable_directories_compile_every_time(compiles, monkeypatch, tmp_path):
    nvrtc.configure_cache(None)
    assert nvrtc.cache_dir() is None
    nvrtc.compile_cubin("src", "k<1>", "sm_90")
    nvrtc.compile_cubin("src", "k<1>", "sm_90")
    assert len(compiles) == 2
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    nvrtc.configure_cache(blocker / "cache")
    assert nvrtc.compile_cubin("src", "k<1>", "sm_90")[1] == "_Z4k<1>"
    assert len(compiles) == 3


def test_default_directory_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setattr(nvrtc, "_cache_dir", nvrtc._DEFAULT)  # no executor configured it
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.cache_dir() == tmp_path / "pieceworks" / "nvrtc"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # not absolute: ignored, as the XDG spec says
    assert nvrtc.cache_dir().parts[-3:] == (".cache", "pieceworks", "nvrtc")


def test_runtime_config_sets_the_cache(monkeypatch, tmp_path):
    """`runtime.cache_dir` / `runtime.kernel_cache` reach nvrtc through Executor.from_config."""
    from pieceworks.config import load_config
    from pieceworks.executor.runner import Executor

    monkeypatch.setattr(nvrtc, "_cache_dir", nvrtc._DEFAULT)
    overrides = ["model.arch=llama", "model.preset=tiny", "runtime.device=cpu", f"runtime.cache_dir={tmp_path}",
                 "cuda_graph.piecewise.enabled=off"]
    Executor.from_config(load_config(None, overrides), progress=False)
    assert nvrtc.cache_dir() == tmp_path / "nvrtc"
    Executor.from_config(load_config(None, [*overrides, "runtime.kernel_cache=false"]), progress=False)
    assert nvrtc.cache_dir() is None
