"""Probe (not for main), CPU: an eager extend step of 16 tokens (`Executor.run_model`, the narrow 32-layer model of
graphs.py's CPU command, one thread) with grad mode on, as the executor runs it, and under torch.inference_mode,
alternated 40 times; hidden states compared. The CPU machine, 2026-12-06 21:45 and 21:46: 51.6 / 54.1 against
48.3 / 48.9 ms (6-10% less), equal. Run from the repository root: python benchmarks/probe_inference_mode_cpu.py"""
import time, statistics, torch
from pieceworks import Executor
from pieceworks.core.batch import ForwardMode, GraphMode
torch.set_num_threads(1)
ov = ["runtime.device=cpu", "runtime.dtype=float32", "cuda_graph.piecewise.enabled=off", "model.max_context=4096",
      "model.sizes.hidden_size=256", "model.sizes.intermediate_size=512", "model.sizes.num_attention_heads=8",
      "model.sizes.num_key_value_heads=2", "model.sizes.head_dim=32", "model.sizes.vocab_size=1024",
      "model.preset=llama-3.1-8b", "model.arch=llama"]
ex = Executor.from_config(None, ov, progress=False)
seq = ex.new_sequence(); toks = [torch.randint(0, 1024, (16,)).tolist()]
pages = ex._reserve_pages([seq], toks)
meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.EAGER, [seq], toks)
k = ex.table.step(ForwardMode.EXTEND, GraphMode.EAGER)
def run(): return ex.run_model(k, meta, ids)
def inf():
    with torch.inference_mode(): return ex.run_model(k, meta, ids)
a, b = run(), inf()
print("equal:", torch.equal(a, b))
acc = {"grad": [], "inference": []}
for _ in range(5): run(); inf()
for _ in range(40):
    for key, f in (("grad", run), ("inference", inf)):
        t = time.perf_counter(); f(); acc[key].append((time.perf_counter() - t) * 1e3)
print({k2: round(statistics.median(v), 3) for k2, v in acc.items()}, "ms, 40 alternated")
