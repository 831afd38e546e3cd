"""Probe (not for the tree): the extend graph runner's host work before its replay, on the CPU (EagerExtendRunner with the
replay stubbed; tiny model, 9,216-token context, pages of 16). `python benchmarks/exp/extend_host_prep.py`."""
import time, statistics, torch
from pieceworks import Executor
from pieceworks.core.batch import ForwardMode
from pieceworks.executor.extend_graph import EagerExtendRunner
ov = ["model.arch=llama", "model.preset=tiny", "model.max_context=9216", "model.sizes={max_position_embeddings: 9216}", "runtime.device=cpu",
      "kv_cache.num_tokens=40960", "kv_cache.page_size=16"]
ex = Executor.from_config(None, ov, progress=False)
r = EagerExtendRunner(ex.model, ex.table, ex.kv, ex.max_context, [16, 32, 64, 128, 256, 512], 64)
r.replay = lambda t, meta: None
for t in (16, 64, 512): r.logits[t] = torch.zeros(64, 10)
for T, B in ((16, 1), (64, 1), (128, 1), (256, 1), (288, 33)):
    seqs, toks = [], []
    for i in range(B):
        s = ex.new_sequence(); seqs.append(s)
        n = T - (B - 1) if i == 0 else 1
        toks.append(torch.randint(0, 500, (n,)).tolist())
    ex._reserve_pages(seqs, toks)
    for t in r.sizes: r.logits[t] = torch.zeros(64, 10)
    f = lambda: r.run(ForwardMode.EXTEND if B == 1 else ForwardMode.MIXED, seqs, toks, None)
    for _ in range(50): f()
    xs = []
    for _ in range(300):
        t0 = time.perf_counter(); f(); xs.append(time.perf_counter() - t0)
    print(T, B, f"{1e6*statistics.median(xs):.1f} us")
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(300): f()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
