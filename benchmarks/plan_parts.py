"""Host us of the piecewise step's head, part by part (Llama-3.1-8B shape, bf16, fa2)."""
import functools, statistics, sys, time
import torch
sys.path.insert(0, ".")
from pieceworks import Executor
from pieceworks.backends.attention import flashinfer_fast as ff
from pieceworks.backends.attention import flashinfer as fl
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context
T = int(sys.argv[1])
ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.sizes.num_hidden_layers=4", "kv_cache.num_tokens=16384",
      "cuda_graph.piecewise.enabled=on", f"cuda_graph.piecewise.sizes=[{T}]", "cuda_graph.decode.enabled=off",
      "backends.attention=flashinfer", "backends.options.flashinfer.variant=fa2"]
try:
    ex = Executor.from_config(None, ov, progress=False)
except Exception as e:
    print("num_layers override failed:", e); ov.remove("model.sizes.num_hidden_layers=4"); ex = Executor.from_config(None, ov, progress=False)
P = {}
def timed(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); P.setdefault(label, []).append((time.perf_counter() - t) * 1e6); return r
    setattr(obj, name, g)
seq = ex.new_sequence(); toks = [torch.randint(0, ex.vocab_size, (T,)).tolist()]
new = ex._reserve_pages([seq], toks)
meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], toks, ex.piecewise.padded_size(T))
k = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)
att = k.attention
for _ in range(5): ex.run_model(k, meta, ids)
torch.cuda.synchronize()
fp = att._fast_plan
timed(ff.FastPlan, "__call__", "FastPlan.__call__")
timed(fp, "fn", "planner (C++)")
timed(ff.PlanCopyGuard, "before", "guard.before")
timed(ff.PlanCopyGuard, "after", "guard.after")
timed(ff.FastRun, "rebind", "FastRun.rebind")
timed(att, "plan", "attention.plan")
timed(ff, "flat_pages", "flat_pages")
pw = ex.piecewise
timed(pw, "__call__", "piecewise.__call__ (copies + all launches)")
orig_copy = torch.Tensor.copy_
for _ in range(60):
    torch.cuda.synchronize()
    t = time.perf_counter(); ex.run_model(k, meta, ids); P.setdefault("run_model", []).append((time.perf_counter() - t) * 1e6)
torch.cuda.synchronize()
for kk, v in P.items():
    print(f"{kk:45s} median {statistics.median(v):8.1f} us  min {min(v):8.1f}")
# raw pieces
buf = fp.device_buf; st = fp.stage
def tm(fn, n=200):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)
print("copy_ pinned->dev 40 int32 non_blocking", tm(lambda: buf[:40].copy_(st[:40], non_blocking=True)))
print("static_ids copy_", tm(lambda: pw.static_ids[:T].copy_(ids)))
ev = torch.cuda.Event()
print("event.record", tm(lambda: ev.record()))
print("event.synchronize (done)", tm(lambda: ev.synchronize()))
print("is_current_stream_capturing", tm(lambda: torch.cuda.is_current_stream_capturing()))
