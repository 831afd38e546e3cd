"""FastMLARun on / off alternated in one process (DeepSeek-V3 shapes, 4 layers, NVFP4, fa2; FastMLAPlan on):
synchronized Executor.forward ms of one-sequence extend steps (piecewise at 16/128/512, eager at 600)."""
import statistics, time
import torch
from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch
from flashinfer.mla import BatchMLAPagedAttentionWrapper as W

ov = ["model.arch=deepseek_v3", "model.preset=deepseek-v3", "model.sizes.num_hidden_layers=4",
      "model.sizes.first_k_dense_replace=1", "quantization.format=nvfp4", "runtime.dtype=bfloat16",
      "model.max_context=2048", "kv_cache.num_tokens=40960", "backends.options.flashinfer.variant=fa2",
      "cuda_graph.decode.batch_sizes=[1]", "cuda_graph.piecewise.sizes=[16,128,512]"]
ex = Executor.from_config(None, ov, progress=False)
mla = list(ex.table.instances("mla"))
runs = [0]
orig = W.run
def counted(self, *a, **k):
    runs[0] += 1; return orig(self, *a, **k)
W.run = counted
res = {}
for rnd in range(4):
    on = rnd % 2 == 0
    for b in mla:
        b._fast_run, b._fast_run_refused = None, not on
    for T in (16, 128, 512, 600):
        fw = []
        runs[0] = 0
        for i in range(12):
            s = ex.new_sequence()
            torch.cuda.synchronize(); t = time.perf_counter()
            ex.forward(ForwardBatch([s], [list(range(1, T + 1))])); torch.cuda.synchronize()
            if i >= 2:
                fw.append(time.perf_counter() - t)
            ex.free(s)
        res.setdefault((T, on), []).append((statistics.median(fw) * 1e3, runs[0]))
print("| T | Executor.forward ms, FastMLARun on (run() calls in 12 steps) | off |")
for T in (16, 128, 512, 600):
    a, b = res[(T, True)], res[(T, False)]
    print(f"| {T} | {' / '.join(f'{m:.3f} ({n})' for m, n in a)} | {' / '.join(f'{m:.3f} ({n})' for m, n in b)} |", flush=True)
