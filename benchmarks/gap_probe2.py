"""Per-call host launch time vs GPU completion, in a wall-clock piecewise step; and the gap vs a head start."""
import statistics, sys, time
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from graphs import whole_graph
from pieceworks import Executor
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context

Ts = [int(x) for x in sys.argv[1].split(",")]
ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "kv_cache.num_tokens=16384", "cuda_graph.piecewise.enabled=on",
      f"cuda_graph.piecewise.sizes=[{','.join(map(str, Ts))}]", "cuda_graph.decode.enabled=off",
      "backends.attention=flashinfer", "backends.options.flashinfer.variant=fa2", *sys.argv[2:]]
ex = Executor.from_config(None, ov, progress=False)
sync = torch.cuda.synchronize
CYC = 1.98e6  # sleep cycles per ms (approx)
for T in Ts:
    seq = ex.new_sequence(); toks = [torch.randint(0, ex.vocab_size, (T,)).tolist()]
    new = ex._reserve_pages([seq], toks)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], toks, ex.piecewise.padded_size(T))
    k = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)
    att = k.attention
    def step(): ex.run_model(k, meta, ids)
    for _ in range(5): step()
    sync()
    # the sleep kernel's own ms per cycle count
    def sleep_ms(c):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); torch.cuda._sleep(c); b.record(); sync(); return a.elapsed_time(b)
    ms_per = statistics.median(sleep_ms(2_000_000) for _ in range(5)) / 2_000_000
    res = {}
    for X in (0.0, 0.1, 0.2, 0.3, 0.5, 0.8, 1.5):
        vals = []
        for _ in range(25):
            sync(); t = time.perf_counter()
            if X: torch.cuda._sleep(int(X / ms_per))
            step(); sync(); vals.append((time.perf_counter() - t) * 1e3 - X)
        res[X] = statistics.median(vals)
    print(f"T={T}: wall - head start X: " + ", ".join(f"X={x} {v:.3f}" for x, v in res.items()), flush=True)
    # per-call timeline: events after each call
    prog = ex.piecewise.programs[T]
    calls = next(c.cell_contents for c in prog.__closure__ if isinstance(c.cell_contents, list))
    rows = []
    for rep in range(7):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 2)]
        hs = []
        sync(); t0 = time.perf_counter(); ev[0].record()
        att.plan(meta)
        with forward_context(ForwardContext(k, meta, ex.kv)):
            ex.piecewise.static_ids[:T].copy_(ids); ex.piecewise.static_pos[:T].copy_(meta.positions)
            ev[1].record(); hs.append(time.perf_counter() - t0)
            for i, (fn, a) in enumerate(calls):
                fn(*a); ev[i + 2].record(); hs.append(time.perf_counter() - t0)
        sync(); tot = (time.perf_counter() - t0) * 1e3
        gs = [ev[0].elapsed_time(e) for e in ev[1:]]
        rows.append((hs, gs, tot))
    hs = [statistics.median(r[0][i] for r in rows) * 1e3 for i in range(len(calls) + 1)]
    gs = [statistics.median(r[1][i] for r in rows) for i in range(len(calls) + 1)]
    print(f"  traced total {statistics.median(r[2] for r in rows):.3f} ms; host done {hs[-1]:.3f}; gpu done {gs[-1]:.3f}")
    # GPU idle at boundary i: GPU finished call i-1 at gs[i-1]; host finished launching call i at hs[i]
    idle, lines = 0.0, []
    for i in range(1, len(hs)):
        kind = "G" if "CUDAGraph" in getattr(calls[i - 1][0], "__qualname__", "") else "A"
        wait = max(0.0, hs[i] - gs[i - 1])  # upper bound of idle waiting for the host (launch completes at hs[i])
        lines.append(f"{kind}{i-1}: host {hs[i]:.3f} gpu {gs[i]:.3f} dgpu {gs[i]-gs[i-1]:.3f}")
    print("  " + " | ".join(lines[:14]))
    print("  ... " + " | ".join(lines[-4:]))
    ex._release([seq], new); ex.free(seq); torch.cuda.empty_cache()
