"""Probe (not for main), CPU: FlashInferAttentionBackend.plan() host us for a mixed step (256 + 32 x 1 over 513, pages of
16; host page indices: no GPU gather here) with a stand-in flashinfer (tests/test_flashinfer_fast_paths.py's Wrapper),
FastPlan recorded. `--prof`: cProfile of it; `--cold`: each plan right after a loop that thrashes the caches (a 64 MB
sum and 30,000 dict reads) against a plan at once after it (the CPU machine, 2026-12-06: 368 against 80 us; run again, 521 against 77).
Run from the repository root: python benchmarks/probe_plan_cold_cpu.py 33 --cold"""
import sys, time, types, statistics, cProfile, pstats
sys.path.insert(0, "tests")
import torch
from test_flashinfer_fast_paths import Wrapper
fi = types.ModuleType("flashinfer")
fi.BatchPrefillWithPagedKVCacheWrapper = lambda ws, layout, backend: Wrapper()
sys.modules["flashinfer"] = fi
from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.attention.flashinfer import FlashInferAttentionBackend, FlashInferOptions
from pieceworks.core.batch import ForwardMode, GraphMode, Sequence
from pieceworks.executor.inputs import step_inputs
LLAMA = ModelFacts(dtype=torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
spec = BackendSpec(device="cpu", capability=(9, 0), model=LLAMA, modules=frozenset({"flashinfer"}))
be = FlashInferAttentionBackend(spec, FlashInferOptions("fa2"))
be._ws = lambda d: torch.zeros(4)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 33
seqs = []
p = 0
for i in range(B):
    n = 0 if i == 0 else 512
    s = Sequence(id=i); s.tokens = [1] * n; np_ = -(-(n + (256 if i == 0 else 1)) // 16)
    s.pages = list(range(p, p + np_)); p += np_
    seqs.append(s)
toks = [[1] * 256] + [[1]] * (B - 1)
meta, ids = step_inputs(ForwardMode.MIXED if B > 1 else ForwardMode.EXTEND, GraphMode.PIECEWISE, seqs, toks, 16, 0,
                        torch.device("cpu"), 288 if B > 1 else 256)
import test_flashinfer_fast_paths as T
_W = T.Wrapper.__init__
def _init(self, graph=False):
    _W(self, graph); self._kv_lens_buffer = torch.zeros(256, dtype=torch.int32)
T.Wrapper.__init__ = _init
be.plan(meta); be.plan(meta)
assert be._fast_plan is not None
def bench(f, n=2000):
    for _ in range(100): f()
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter() - t) / n * 1e6)
    return min(ts), statistics.median(ts)
print("plan us (min, median of 7 x 2000):", bench(lambda: be.plan(meta)))
if "--prof" in sys.argv:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(5000): be.plan(meta)
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
if "--cold" in sys.argv:
    import numpy as np
    junk = np.ones(64 << 20 >> 3)
    objs = [dict(a=i, b=str(i)) for i in range(200000)]
    def thrash():
        junk.sum(); s = 0
        for o in objs[::7]: s += o["a"]
    warm, cold = [], []
    for _ in range(200):
        thrash(); t = time.perf_counter(); be.plan(meta); cold.append((time.perf_counter() - t) * 1e6)
        t = time.perf_counter(); be.plan(meta); warm.append((time.perf_counter() - t) * 1e6)
    print("after thrash (cold):", statistics.median(cold), "second (warm):", statistics.median(warm))
