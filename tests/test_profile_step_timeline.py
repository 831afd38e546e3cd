"""benchmarks/profile_step.py --timeline's bookkeeping (the docs quote its numbers): steps split at idle gaps, each
kernel's exposed time and lead, roles from kernel names. Pure python over synthetic kernel records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_dir = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_dir))  # the script imports its folder's `common`, as when run
_spec = importlib.util.spec_from_file_location("profile_step_script", _dir / "profile_step.py")
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)

QKV = "void nvfp4_decode_gemm<8, 2, 1, 2, 0, 0>(U4 const*)"
PLAIN = "void nvfp4_decode_gemm<16, 2, 1, 0, 0, 0>(U4 const*)"
SWIGLU = "void nvfp4_decode_gemm<2, 2, 1, 1, 0, 0>(U4 const*)"
WG_PLAIN = "void fp4_wgmma_tma<64, 8, 0, 1, 0>(CUtensorMap_st, CUtensorMap_st, __nv_bfloat16*)"
WG_SWIGLU = "void fp4_wgmma_tma<64, 8, 1, 0, 0>(CUtensorMap_st, CUtensorMap_st, __nv_bfloat16*)"


def ev(name, ts, dur):
    return {"name": name, "ts": ts, "dur": dur}


def test_roles_follow_the_llama_step():
    assert timeline.role(QKV, "") == "q/k/v gemm (+rope)"
    assert timeline.role(PLAIN, "q/k/v gemm (+rope)") == "o gemm"
    assert timeline.role(SWIGLU, "o gemm") == "gate/up gemm (+swiglu)"
    assert timeline.role(PLAIN, "gate/up gemm (+swiglu)") == "down gemm"
    assert timeline.role(WG_PLAIN, "") == "q/k/v gemm (+rope)"
    assert timeline.role(WG_PLAIN, "q/k/v gemm (+rope)") == "o gemm"
    assert timeline.role(WG_SWIGLU, "o gemm") == "gate/up gemm (+swiglu)"
    assert timeline.role(WG_PLAIN, "gate/up gemm (+swiglu)") == "down gemm"
    assert timeline.role(WG_PLAIN, "down gemm") == "q/k/v gemm (+rope)"
    assert timeline.role("_decode_kernel", "") == "attention (attention.triton)"
    assert timeline.role("_add_rms_norm_kernel", "") == "norm"
    assert timeline.role("nvjet_tst_128x64_64x3_1x2_h_bz_TNT", "") == "bf16 gemm (cuBLAS: lm_head)"
    assert timeline.role("nvjet_sm90_tst_64x16_64x16_2x1_v_bz_splitK_TNT", "") == "bf16 gemm (cuBLAS: lm_head)"


def test_exposed_and_lead_add_up_to_the_span():
    step = [ev("_add_rms_norm_kernel", 0.0, 2.0),
            ev(QKV, 1.0, 6.0),             # starts 1 us before the norm ends (PDL): lead -1, exposed 5
            ev("_decode_kernel", 7.5, 6.5),  # 0.5 us idle gap: lead +0.5, exposed 6.5
            ev(PLAIN, 12.0, 4.0),          # overlaps the attention by 2 us: exposed 2
            ev(PLAIN, 13.0, 1.0)]          # wholly inside the one before (an "o gemm" again): exposed 0
    span, acc = timeline.walk(step)
    assert span == pytest.approx(16.0)
    assert acc["norm"] == pytest.approx([2.0, 2.0, 0.0, 1])
    assert acc["q/k/v gemm (+rope)"] == pytest.approx([6.0, 5.0, -1.0, 1])
    assert acc["attention (attention.triton)"] == pytest.approx([6.5, 6.5, 0.5, 1])
    assert acc["o gemm"] == pytest.approx([5.0, 2.0, -2.0 + -3.0, 2])
    assert sum(a[1] for a in acc.values()) + 0.5 == pytest.approx(span)  # exposed + idle = span


def test_wgmma_roles_skip_split_k_sums():
    """The M > 16 kernel's GEMMs are named by the GEMM before them; a split-K sum between q/k/v and o is none."""
    step = [ev(WG_PLAIN, 0.0, 5.0), ev("splitk_reduce_rope", 5.0, 1.0), ev("_decode_kernel", 6.0, 4.0),
            ev(WG_PLAIN, 10.0, 3.0), ev("splitk_reduce", 13.0, 1.0), ev("_add_rms_norm_kernel", 14.0, 1.0),
            ev(WG_SWIGLU, 15.0, 9.0), ev(WG_PLAIN, 24.0, 6.0), ev(WG_PLAIN, 30.0, 5.0)]
    _, acc = timeline.walk(step)
    assert acc["q/k/v gemm (+rope)"][3] == 2 and acc["q/k/v gemm (+rope)"][0] == pytest.approx(10.0)
    assert acc["o gemm"] == pytest.approx([3.0, 3.0, 0.0, 1])
    assert acc["gate/up gemm (+swiglu)"][0] == pytest.approx(9.0)
    assert acc["down gemm"] == pytest.approx([6.0, 6.0, 0.0, 1])
    assert acc["fp4 gemm split-K reduce"][3] == 2


def test_steps_split_at_idle_gaps():
    a = [ev("k", float(i), 1.0) for i in range(12)]        # 0 .. 12 us
    b = [ev("k", 100.0 + i, 1.0) for i in range(12)]       # after 88 us idle
    short = [ev("k", 300.0, 1.0)]                          # a lone kernel: dropped
    steps = timeline.split_steps(a + b + short)
    assert [len(s) for s in steps] == [12, 12]
    assert steps[1][0]["ts"] == 100.0
    assert timeline.split_steps(a, gap_us=0.5) == [a]      # back-to-back kernels never split


def test_idle_counts_as_waiting_for_the_host_only_while_the_launch_call_ran():
    """A gap before a kernel counts as waiting for the host up to where its launch call returned, when that was
    after the GPU ran dry; a graph's kernels share their cudaGraphLaunch's correlation id."""
    def k(ts, dur, corr):
        return {"name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    launches = {1: {"name": "cudaGraphLaunch", "ts": 0.0, "dur": 2.0},
                2: {"name": "cudaLaunchKernel", "ts": 5.0, "dur": 20.0},    # returns at 25: the GPU idles 10..26
                3: {"name": "cudaGraphLaunch", "ts": 6.0, "dur": 1.0},      # queued long before its kernels ran
                4: {"name": "cuLaunchKernelEx", "ts": 30.0, "dur": 5.0}}    # returns at 35: 1 of the idle 34..36
    step = [k(3.0, 4.0, 1), k(7.0, 3.0, 1), k(26.0, 4.0, 2), k(31.0, 1.0, 3), k(32.0, 2.0, 3), k(36.0, 1.0, 4),
            k(40.0, 1.0, 99)]                                               # no launch record: not counted
    total, by_call = timeline.host_waits(step, launches)
    assert by_call == pytest.approx({"cudaLaunchKernel": 15.0, "cuLaunchKernelEx": 1.0})
    assert total == pytest.approx(16.0)
    assert timeline.host_waits(step[:2], launches) == (0.0, {})


def test_mixed_step_runs_on_the_cpu(monkeypatch, capsys):
    """`--mixed` adds a mixed step (a chunk and decode rows over `--context`-token sequences) to the extend steps;
    on the CPU both go through cProfile (tiny preset)."""
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--preset", "tiny", "--tokens", "8", "--mixed", "4x2",
                                      "--context", "16", "--steps", "1", "--set", "runtime.device=cpu",
                                      "--set", "runtime.dtype=float32"])
    timeline.main()
    out = capsys.readouterr().out
    assert "T = 8, piecewise extend: plan + forward" in out
    assert "4 + 2 x 1, piecewise mixed: plan + forward" in out
