"""The CPU side of programmatic dependent launch (backends/pdl.py): the switch and its config key. The
launches themselves are tested on the H200 (tests/gpu/test_pdl_gpu.py)."""

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


def test_stream_order_launch_keeps_the_flag_without_the_launch_attribute(monkeypatch):
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    assert pdl.launch_options("cuda") == (True, {"launch_pdl": True})
    assert pdl.launch_options("cuda", early=False) == (True, {})
    monkeypatch.setattr(pdl, "enabled", lambda device: False)
    assert pdl.launch_options("cuda", early=False) == (False, {})


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


def test_attention_decode_launches_in_stream_order_with_its_trigger(monkeypatch):
    """attention.triton's decode kernel: PDL compiled in (its trigger lets the o projection launch early)
    but launched without the PDL attribute (it finishes later launched early: docs/benchmarks.md); the norm kernels
    keep the early launch."""
    pytest.importorskip("triton")
    import torch

    from pieceworks.backends.attention import triton_decode_kernel as tdk
    from pieceworks.backends import fused_kernels

    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    rec = _Recorder()
    monkeypatch.setattr(tdk, "_decode_kernel", rec)
    q = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    part = torch.zeros(1 << 16)
    tdk.decode(q, cache, cache, q, table, lens, 0.125, 4, part, part, torch.zeros(2, dtype=torch.int32))
    (_, kw), = rec.launches
    assert kw["PDL"] is True and "launch_pdl" not in kw

    norm = _Recorder()
    monkeypatch.setattr(fused_kernels, "_add_rms_norm_kernel", norm)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    fused_kernels.add_rms_norm(x, x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    (_, kw), = norm.launches
    assert kw["PDL"] is True and kw["launch_pdl"] is True
