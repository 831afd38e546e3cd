"""The CPU main job's model (configs/smollm2-fp4.yaml, fp4_gemm.dequant): prefill of 16 and 256 tokens and
batch-2 decode steps, medians; and float32 decode-sized x @ W.T ([N, K] weights) against x @ W ([K, N]) over 100
rotated 3072 x 576 weights. Run it on the tree and on its parent to compare the two weight layouts."""
import statistics
import time

import torch

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch

torch.set_num_threads(2)
ws = [torch.randn(3072, 576) for _ in range(100)]
x = torch.randn(2, 576)
for name, mats, op in (("x @ W.T", ws, lambda w: x @ w.t()), ("x @ W", [w.t().contiguous() for w in ws],
                                                               lambda w: x @ w)):
    for w in mats[:3]:
        op(w)
    t = time.perf_counter()
    for w in mats:
        op(w)
    print(f"{name}: {100 * 3072 * 576 * 4 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
ex = Executor.from_config("configs/smollm2-fp4.yaml")


def prefill(n: int) -> float:
    s = ex.new_sequence()
    t = time.perf_counter()
    ex.forward(ForwardBatch([s], [list(range(1, n + 1))]))
    dt = time.perf_counter() - t
    ex.free(s)
    return dt


for n in (16, 256):
    prefill(n)
    print(f"prefill {n}: {statistics.median(prefill(n) for _ in range(5)) * 1e3:.1f} ms")
seqs = [ex.new_sequence() for _ in range(2)]
ex.forward(ForwardBatch(seqs, [[1] * 40, [2] * 50]))
steps = []
for _ in range(25):
    t = time.perf_counter()
    ex.forward(ForwardBatch(seqs, [[3], [4]]))
    steps.append(time.perf_counter() - t)
print(f"decode, batch 2: {statistics.median(steps[5:]) * 1e3:.1f} ms")
