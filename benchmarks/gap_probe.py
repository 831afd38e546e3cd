"""Where piecewise - whole graph goes: wall vs GPU-only (host kept ahead by a sleep kernel), per T."""
import statistics, sys, time
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from graphs import whole_graph
from pieceworks import Executor
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context

Ts = [int(x) for x in sys.argv[1].split(",")]
extra = sys.argv[2:]
ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "kv_cache.num_tokens=16384", "cuda_graph.piecewise.enabled=on",
      f"cuda_graph.piecewise.sizes=[{','.join(map(str, Ts))}]", "cuda_graph.decode.enabled=off",
      "backends.attention=flashinfer", "backends.options.flashinfer.variant=fa2", *extra]
ex = Executor.from_config(None, ov, progress=False)
sync = torch.cuda.synchronize
def med(fn, n=40, pre=None):
    for _ in range(3): fn()
    out = []
    for _ in range(n):
        if pre: pre()
        sync(); t = time.perf_counter(); fn(); sync(); out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)
def host(fn, n=40, pre=None):
    out = []
    for _ in range(n):
        if pre: pre()
        sync(); t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e3); sync()
    return statistics.median(out)
def gpu_only(fn, n=30):
    out = []
    for _ in range(n):
        sync(); torch.cuda._sleep(12_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); sync(); out.append(a.elapsed_time(b))
    return statistics.median(out)
for T in Ts:
    seq = ex.new_sequence(); toks = [torch.randint(0, ex.vocab_size, (T,)).tolist()]
    new = ex._reserve_pages([seq], toks)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], toks, ex.piecewise.padded_size(T))
    k = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)
    att = k.attention
    def plan(): att.plan(meta)
    def fwd():
        with forward_context(ForwardContext(k, meta, ex.kv)):
            ex.piecewise(ids, meta.positions)
    def step(): ex.run_model(k, meta, ids)
    step(); sync()
    prog = ex.piecewise.programs[T]
    calls = prog.__closure__[0].cell_contents if prog.__closure__ else None
    r = {}
    r["wall plan+fwd"] = med(step)
    r["wall fwd (planned)"] = med(fwd, pre=plan)
    r["host plan"] = host(plan)
    r["host plan+fwd launch"] = host(step)
    r["gpu-only plan+fwd"] = gpu_only(step)
    r["gpu-only fwd"] = gpu_only(fwd)
    fp = att._fast_plan
    if fp is not None:
        args = list(fp.args)
        r["host planner call"] = host(lambda: fp.fn(*args))
    # per call kind host time in the recorded program
    try:
        cells = [c.cell_contents for c in prog.__closure__]
        calls = next(c for c in cells if isinstance(c, list))
        kinds = {}
        for _ in range(20):
            plan(); sync()
            with forward_context(ForwardContext(k, meta, ex.kv)):
                for fn, a in calls:
                    t = time.perf_counter(); fn(*a); dt = (time.perf_counter() - t) * 1e3
                    name = getattr(fn, "__qualname__", str(fn)).split(".")[0][:30]
                    kinds.setdefault(name, []).append(dt)
            sync()
        for name, v in kinds.items():
            r[f"host per {name} x{len(v)//20}"] = sum(v) / 20
    except Exception as e:
        print("calls:", e)
    meta_e, ids_e = ex.prepare_step(ForwardMode.EXTEND, GraphMode.EAGER, [seq], toks)
    ke = ex.table.step(ForwardMode.EXTEND, GraphMode.EAGER)
    g = whole_graph(ex, ke, meta_e, ids_e)
    r["wall whole"] = med(g.replay)
    r["gpu-only whole"] = gpu_only(g.replay)
    r["host whole launch"] = host(g.replay)
    g = None
    ex._release([seq], new); ex.free(seq); torch.cuda.empty_cache()
    print(f"T={T}: " + "; ".join(f"{a} {b:.3f}" for a, b in r.items()), flush=True)
    print(f"  gap wall {r['wall plan+fwd']-r['wall whole']:.3f}  gap gpu-only(fwd) {r['gpu-only fwd']-r['gpu-only whole']:.3f}  gap gpu-only(plan+fwd) {r['gpu-only plan+fwd']-r['gpu-only whole']:.3f}", flush=True)
