"""Probe (not for main): FastPlan.__call__ and flat_pages host us on the CPU (planner stubbed, CPU buffers): 33
sequences (a 256-token chunk + 32 over 513 tokens) and 64 (+ 63 over 4,097 tokens), pages of 16; min of 5 x 2000 calls.
Run from the repository root: python benchmarks/probe_fastplan_cpu.py"""
import time, statistics, types
import numpy as np, torch
from pieceworks.backends.attention.flashinfer_fast import FastPlan, flat_pages
fp = FastPlan(lambda *a: None, [None]*10, 0, 16, torch.device("cpu"))
w = types.SimpleNamespace()
def bench(f, n=2000):
    for _ in range(50): f()
    ts=[]
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter()-t)/n*1e6)
    return min(ts)
for B, ctx in ((33, 512), (64, 4096)):
    qo = [256] + [1]*(B-1); kv = [256] + [ctx+1]*(B-1)
    pages = [list(range(i*300, i*300+300)) for i in range(B)]
    counts = [-(-n//16) for n in kv]
    print(B, ctx, "FastPlan us", round(bench(lambda: fp(w, qo, kv, pages)),1), "flat_pages us", round(bench(lambda: flat_pages(pages, counts)),1))
