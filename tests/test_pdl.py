"""Programmatic dependent launch: when pieceworks' Triton kernels use it, and how much of its weights
an NVFP4 GEMM hints into L2 before waiting. (The kernels with PDL on run in tests/gpu: every GPU test
on an sm_90 machine uses it, test_triton_attention.py and test_triton_fp4.py also with it off.)"""

from __future__ import annotations

import torch

from pieceworks.backends import pdl
from pieceworks.backends.fp4_gemm.triton import PREFETCH_BYTES, prefetch_steps


def test_off_on_cpu_and_by_environment(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.env_allows()
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_kwargs(torch.device("cpu")) == {}
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(pdl.ENV, off)
        assert not pdl.env_allows()
        assert not pdl.enabled(torch.device("cuda", 0))  # decided before asking the GPU
        assert pdl.launch_kwargs(torch.device("cuda", 0)) == {}
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.env_allows()


def test_on_for_hopper_only(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setattr(pdl, "_triton_supports_pdl", lambda: True)
    for cap, want in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(pdl, "_device_supports", lambda index, cap=cap: cap >= (9, 0))
        assert pdl.enabled(torch.device("cuda", 0)) is want
        assert pdl.launch_kwargs(torch.device("cuda", 0)) == ({"PDL": True, "launch_pdl": True} if want else {})
    monkeypatch.setattr(pdl, "_triton_supports_pdl", lambda: False)  # a Triton without launch_pdl
    assert not pdl.enabled(torch.device("cuda", 0))


def test_prefetch_steps():
    # Llama-3.1-8B qkv at M = 1: 96 tiles x 3 splits of 16 K steps (<= 6 each): all 6 fit the budget.
    assert prefetch_steps(288, 64, 256, 6) == 8
    # gate_up: 448 programs x 16 steps x 8 KB = 59 MB; 4 steps (14.7 MB) fit in the 24 MB budget.
    assert prefetch_steps(448, 64, 256, 16) == 4
    assert prefetch_steps(448, 64, 256, 1) == 1
    assert prefetch_steps(10**6, 64, 256, 16) == 0  # not even one step fits
    for programs in (1, 7, 132, 264, 528, 4096, 20000):
        for steps in (1, 2, 3, 5, 8, 16, 56):
            p = prefetch_steps(programs, 64, 256, steps)
            assert p == 0 or p & (p - 1) == 0  # a power of two: the kernel's tl.arange
            assert p <= 8
            assert min(p, steps) * programs * 64 * 128 <= PREFETCH_BYTES  # distinct lines hinted
            if p and steps <= 8 and steps * programs * 64 * 128 <= PREFETCH_BYTES // 2:
                assert p >= steps  # small ranges are hinted whole
