"""The eager path calls the ops' implementations without the dispatcher; Dynamo still traces the ops.

`core.direct` wrappers run an op's implementation straight in eager code (the dispatcher costs tens of
microseconds per call) and the op itself while Dynamo traces, so piecewise graphs keep their nodes.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch
from pieceworks.backends import fused


def _dispatched_ops(fn) -> set[str]:
    """Names of the pieceworks custom ops the dispatcher ran during fn()."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("pieceworks::")}


def test_a_dispatched_op_is_seen():
    # the profiler sees an op that goes through the dispatcher (else the checks below prove nothing)
    x, w = torch.randn(4, 16), torch.ones(16)
    assert "pieceworks::rms_norm" in _dispatched_ops(lambda: torch.ops.pieceworks.rms_norm(x, w, 1e-5))
    assert _dispatched_ops(lambda: fused.rms_norm(x, w, 1e-5)) == set()


@pytest.mark.parametrize("arch,quant", [("llama", "none"), ("llama", "nvfp4"), ("deepseek_v3", "none")])
def test_eager_forward_runs_no_custom_op_dispatch(arch, quant):
    ex = Executor.from_config(None, [f"model.arch={arch}", "model.preset=tiny", "runtime.device=cpu",
                                     f"quantization.format={quant}", "cuda_graph.piecewise.enabled=off",
                                     "kv_cache.num_tokens=256"], progress=False)
    assert ex.model.has_fp4() == (quant == "nvfp4")
    seq = ex.new_sequence()
    assert _dispatched_ops(lambda: ex.forward(ForwardBatch([seq], [[1, 2, 3, 4, 5]]))) == set()
    assert _dispatched_ops(lambda: ex.forward(ForwardBatch([seq], [[6]]))) == set()


def test_traced_graph_holds_the_ops():
    w = torch.ones(16)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(x, r, cos, sin):
        h, s = fused.add_rms_norm(fused.rms_norm(x, w, 1e-6), r, w, 1e-6)
        q, k = fused.rope_qk(h.view(-1, 2, 8), s.view(-1, 2, 8), cos, sin, False)
        return fused.silu_mul(q.flatten(1), k.flatten(1))

    args = (torch.randn(5, 16), torch.randn(5, 16), torch.randn(5, 4).cos(), torch.randn(5, 4).sin())
    got = torch.compile(f, fullgraph=True, backend=backend)(*args)
    assert torch.equal(got, f(*args))
    for op in ("rms_norm", "add_rms_norm", "rope_qk", "silu_mul"):
        assert any(f"pieceworks.{op}" in t for t in seen), (op, seen)
