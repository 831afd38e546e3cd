"""Probe (exp/mixed-probe): where a piecewise step's wall time over the whole-forward graph goes, for an extend
step and a mixed step (one chunk + decodes): b2b walls alternated with the whole graph, the plan's and the launch's
host time, and a per-call timeline (host launch done vs GPU done)."""
import statistics, sys, time
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from graphs import whole_graph
from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context

CPU = not torch.cuda.is_available()  # a dry run of the setup
sync = (lambda: None) if CPU else torch.cuda.synchronize
ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "kv_cache.num_tokens=40960", "cuda_graph.piecewise.enabled=on",
      "cuda_graph.piecewise.sizes=[16,288]", "cuda_graph.decode.enabled=off", "quantization.format=none",
      "runtime.dtype=bfloat16", "model.max_context=9216",
      "backends.attention=flashinfer", "backends.options.flashinfer.variant=fa2", *sys.argv[1:]]
ex = Executor.from_config(None, ov, progress=False)


def case(chunk, decodes, context=512):
    seqs = [ex.new_sequence() for _ in range(decodes + 1)]
    for s in seqs[1:]:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,)).tolist()]))
    toks = [torch.randint(0, ex.vocab_size, (chunk,)).tolist()] + [[1]] * decodes
    T = sum(map(len, toks))
    mode = ForwardMode.classify(list(map(len, toks)), [s.kv_len for s in seqs])
    new = ex._reserve_pages(seqs, toks)
    meta, ids = ex.prepare_step(mode, GraphMode.PIECEWISE, seqs, toks, ex.piecewise.padded_size(T))
    k = ex.table.step(mode, GraphMode.PIECEWISE)
    me, ie = ex.prepare_step(mode, GraphMode.EAGER, seqs, toks)
    ke = ex.table.step(mode, GraphMode.EAGER)
    att = k.attention

    def step():
        ex.run_model(k, meta, ids)
    for _ in range(5):
        step()
    sync()
    # host time of the plan alone and of the whole step's launches (GPU drained first)
    hp, hs = [], []
    for _ in range(30):
        sync(); t = time.perf_counter(); att.plan(meta); hp.append((time.perf_counter() - t) * 1e6)
        sync(); t = time.perf_counter(); step(); hs.append((time.perf_counter() - t) * 1e6)
    sync()
    if CPU:
        print(T, mode, len(hp), flush=True)
        ex._release(seqs, new)
        return
    # per-call timeline
    size = ex.piecewise.padded_size(T)
    prog = ex.piecewise.programs[size]
    calls = next(c.cell_contents for c in prog.__closure__ if isinstance(c.cell_contents, list))
    rows = []
    for rep in range(9):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 2)]
        hs_ = []
        sync(); t0 = time.perf_counter(); ev[0].record()
        att.plan(meta)
        with forward_context(ForwardContext(k, meta, ex.kv)):
            ex.piecewise.static_ids[:size].copy_(ids); ex.piecewise.static_pos[:size].copy_(meta.positions)
            ev[1].record(); hs_.append(time.perf_counter() - t0)
            for i, (fn, a) in enumerate(calls):
                fn(*a); ev[i + 2].record(); hs_.append(time.perf_counter() - t0)
        sync(); tot = (time.perf_counter() - t0) * 1e3
        rows.append((hs_, [ev[0].elapsed_time(e) for e in ev[1:]], tot))
    h = [statistics.median(r[0][i] for r in rows) * 1e3 for i in range(len(calls) + 1)]
    g = [statistics.median(r[1][i] for r in rows) for i in range(len(calls) + 1)]
    # GPU idle waiting for the host: boundaries where the host finished launching call i after the GPU finished i-1
    waits = [(i, h[i] - g[i - 1]) for i in range(1, len(h)) if h[i] > g[i - 1]]
    graph = whole_graph(ex, ke, me, ie)
    pw, wh = [], []
    for _ in range(30):
        for fn, out in ((step, pw), (graph.replay, wh)):
            sync(); t = time.perf_counter(); fn(); sync(); out.append((time.perf_counter() - t) * 1e3)
    med = statistics.median
    print(f"{chunk} + {decodes} (T {T}, padded {size}): b2b piecewise {med(pw):.3f} whole {med(wh):.3f} "
          f"gap {med(pw) - med(wh):.3f} ms; plan host {med(hp):.1f} us (min {min(hp):.1f}); step host "
          f"{med(hs):.1f} us; timeline: total {med(r[2] for r in rows):.3f} ms, head (plan+copy) host {h[0]:.3f} "
          f"gpu {g[0]:.3f}, first call gpu done {g[1]:.3f}, last gpu {g[-1]:.3f}, host done {h[-1]:.3f}", flush=True)
    print("  GPU waits for host at: " + ", ".join(f"{i}:{w:.3f}" for i, w in waits[:12]) + f" ({len(waits)} calls, "
          f"sum {sum(w for _, w in waits):.3f} ms)", flush=True)
    per = [(h[i] - h[i - 1]) * 1e3 for i in range(2, len(h))]
    print(f"  host us per call: attention {med(per[0::2]):.1f}, replay {med(per[1::2]):.1f}; "
          f"gpu us per call: {med([(g[i] - g[i-1]) * 1e3 for i in range(2, len(g))]):.1f}", flush=True)
    graph = None
    ex._release(seqs, new)
    for s in seqs:
        ex.free(s)
    torch.cuda.empty_cache()


case(16, 0)
case(256, 32, int(__import__("os").environ.get("CTX", 512)))
case(256, 32, int(__import__("os").environ.get("CTX", 512)))
case(16, 0)
