"""The CPU side of programmatic dependent launch (backends/pdl.py): the switch and its config key. The
launches themselves are tested on the H200 (tests/gpu/test_pdl.py)."""

from __future__ import annotations

import pytest

from pieceworks.backends import pdl
from pieceworks.config import ConfigError, Switch, load_config
from pieceworks.executor.runner import Executor


@pytest.fixture(autouse=True)
def _restore_switch():
    yield
    pdl.configure("auto", "cpu")


def test_unsupported_on_cpu_with_a_reason():
    assert "CUDA device" in pdl.unsupported_reason("cpu")
    assert pdl.configure("auto", "cpu") is False
    assert pdl.launch_options("cpu") == (False, {})
    with pytest.raises(ValueError, match="runtime.pdl=on: PDL needs a CUDA device"):
        pdl.configure("on", "cpu")
    with pytest.raises(ValueError, match="use auto, on or off"):
        pdl.configure("sometimes", "cpu")


def test_config_key():
    assert load_config({"model": {"arch": "llama"}}).runtime.pdl is Switch.auto
    assert load_config({"model": {"arch": "llama"}}, ["runtime.pdl=off"]).runtime.pdl is Switch.off
    assert load_config({"model": {"arch": "llama"}}, ["runtime.pdl=false"]).runtime.pdl is Switch.off
    with pytest.raises(ConfigError, match="runtime.pdl: 'never' is not allowed"):
        load_config({"model": {"arch": "llama"}}, ["runtime.pdl=never"])


def test_executor_refuses_pdl_on_where_unsupported_before_loading():
    with pytest.raises(ConfigError, match="runtime.pdl: on, but PDL needs a CUDA device"):
        Executor.from_config({"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu"}},
                             ["runtime.pdl=on"], progress=False)
