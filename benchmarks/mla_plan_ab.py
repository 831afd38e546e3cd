"""FastMLAPlan on / off alternated in one process (DeepSeek-V3 shapes, 4 layers, NVFP4, fa2): the MLA plan's host
ms per step and Executor.forward ms (synchronized) for piecewise extend and FULL-graph decode steps; also the
host us of one wrapper.run call (eager/piecewise layers)."""
import statistics, sys, time
from dataclasses import replace
import torch
from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch
from pieceworks.backends.mla.flashinfer import FlashInferMLABackend as M
from flashinfer.mla import BatchMLAPagedAttentionWrapper as W

ov = ["model.arch=deepseek_v3", "model.preset=deepseek-v3", "model.sizes.num_hidden_layers=4",
      "model.sizes.first_k_dense_replace=1", "quantization.format=nvfp4", "runtime.dtype=bfloat16",
      "model.max_context=2048", "kv_cache.num_tokens=40960", "backends.options.flashinfer.variant=fa2",
      "cuda_graph.decode.batch_sizes=[1,8,32]", "cuda_graph.piecewise.sizes=[16,128,512]"]
ex = Executor.from_config(None, ov, progress=False)
mla = [b for b in ex.table.instances("mla")]
orig, rec = M.plan, []
def timed(self, meta):
    t = time.perf_counter(); orig(self, meta); rec.append(time.perf_counter() - t)
M.plan = timed
run_orig, runs = W.run, []
def run_timed(self, *a, **k):
    t = time.perf_counter(); r = run_orig(self, *a, **k); runs.append(time.perf_counter() - t); return r
W.run = run_timed
med = lambda xs: statistics.median(xs) * 1e3
res = {}
for rnd in range(4):
    on = rnd % 2 == 0
    for b in mla:
        b.options = replace(b.options, fast_plan=on); b._fast.clear()
    for T in (16, 128, 512):
        fw, pl, rr = [], [], []
        for i in range(12):
            s = ex.new_sequence()
            rec.clear(); runs.clear(); torch.cuda.synchronize(); t = time.perf_counter()
            ex.forward(ForwardBatch([s], [list(range(1, T + 1))])); torch.cuda.synchronize()
            if i >= 2:
                fw.append(time.perf_counter() - t); pl += rec; rr += runs
            ex.free(s)
        res.setdefault((f"extend {T}", on), []).append((med(pl), med(fw)))
        print(f"extend {T} fast {on}: wrapper.run host {med(rr) * 1e3:.1f} us per call ({len(rr) // 10} a step)", flush=True)
    for B in (1, 8, 32):
        seqs = [ex.new_sequence() for _ in range(B)]
        for s in seqs:
            ex.forward(ForwardBatch([s], [list(range(1, 513))]))
        fw, pl = [], []
        for i in range(25):
            rec.clear(); torch.cuda.synchronize(); t = time.perf_counter()
            ex.forward(ForwardBatch(seqs, [[7]] * B)); torch.cuda.synchronize()
            if i >= 5:
                fw.append(time.perf_counter() - t); pl += rec
        res.setdefault((f"decode {B}", on), []).append((med(pl), med(fw)))
        for s in seqs:
            ex.free(s)
print("| step | plan ms fast on (2 rounds) | off | Executor.forward ms on | off |")
for key in [k for k in dict.fromkeys(k for k, _ in res)]:
    a, b = res[(key, True)], res[(key, False)]
    print(f"| {key} | {' / '.join(f'{p:.3f}' for p, _ in a)} | {' / '.join(f'{p:.3f}' for p, _ in b)} | "
          f"{' / '.join(f'{f:.3f}' for _, f in a)} | {' / '.join(f'{f:.3f}' for _, f in b)} |", flush=True)
