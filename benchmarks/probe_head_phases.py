"""Probe (not for main): host time of a piecewise step's head, phase by phase, unprofiled. Each step as graphs.py's
back-to-back timing runs it (synchronize, call, synchronize), with perf_counter_ns stamps from wrapped calls: the
plan (its copy guard, FastPlan up to the planner, the planner, the rest), the runner up to its program, the program's
calls (piece 0, layer 0's attention split at the kernel call, piece 1, ...). Also each phase hot (the same call
repeated at once) and the step's wall time against the whole graph, with and without gc. The lean head (`driver.LEAN`)
and torch's are alternated. The H100 run of 2026-12-06 20:19 in docs/benchmarks.md used this script's first form on
main's library (4fd61e4): `phases` and the wall times, without the lean A/B, the equality check and `cpu_after_step`.
Run: python benchmarks/probe_head_phases.py [--set ...]"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from common import sync
from graphs import whole_graph

from pieceworks import Executor
from pieceworks.backends import driver
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode


def set_lean(on: bool) -> None:
    driver.LEAN = on

ns = time.perf_counter_ns


def setup(ex, chunk, decodes, context):
    seqs = [ex.new_sequence() for _ in range(decodes + 1)]
    for s in seqs[1:]:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,)).tolist()]))
    return seqs, [torch.randint(0, ex.vocab_size, (chunk,)).tolist()] + [[1]] * decodes


def stamp(st, name, fn):
    def g(*a, **k):
        st.append((name + ">", ns()))
        r = fn(*a, **k)
        st.append((name + "<", ns()))
        return r
    return g


def probe(ex, seqs, toks, label, repeats):
    T = sum(map(len, toks))
    mode = ForwardMode.classify(list(map(len, toks)), [s.kv_len for s in seqs])
    new_pages = ex._reserve_pages(seqs, toks)
    pad = ex.piecewise.padded_size(T)
    meta, ids = ex.prepare_step(mode, GraphMode.PIECEWISE, seqs, toks, pad)
    k = ex.table.step(mode, GraphMode.PIECEWISE)
    att = k.attention

    def step():
        ex.run_model(k, meta, ids)

    for _ in range(3):
        step()
    outs = []
    for lean in (True, False, True):
        set_lean(lean)
        outs.append(ex.run_model(k, meta, ids).clone())
    print(f"{label}: lean and torch heads give equal hidden states: {all(torch.equal(outs[0], o) for o in outs)}",
          flush=True)
    sync()
    # wall b2b, alternated with the whole graph, gc on / off
    em, ei = ex.prepare_step(mode, GraphMode.EAGER, seqs, toks)
    ke = ex.table.step(mode, GraphMode.EAGER)
    acc = {"pw_lean": [], "pw_torch": [], "pw_lean_nogc": [], "whole": []}
    g = None
    for _ in range(repeats):
        for key in ("pw_lean", "pw_torch", "pw_lean_nogc"):
            set_lean(key != "pw_torch")
            if key.endswith("nogc"):
                gc.disable()
            sync()
            t0 = ns()
            step()
            sync()
            acc[key].append((ns() - t0) / 1e6)
            gc.enable()
    set_lean(True)
    med = {k2: statistics.median(v) for k2, v in acc.items() if v}
    print(f"{label} (T {T}, padded {pad}, fast plan {att._fast_plan is not None}, fast run {att._fast is not None}): "
          + ", ".join(f"{k2} {v:.3f} ms" for k2, v in med.items()), flush=True)
    for lean in (True, False):
        set_lean(lean)
        phases(ex, att, meta, step, pad, f"{label} {'lean' if lean else 'torch'}", repeats)
    set_lean(True)
    g = whole_graph(ex, ke, em, ei)
    for _ in range(repeats):
        sync()
        t0 = ns()
        g.replay()
        sync()
        acc["whole"].append((ns() - t0) / 1e6)
    w = statistics.median(acc["whole"])
    print(f"  {label} whole {w:.3f} ms; pw - whole: lean {med['pw_lean'] - w:.3f} ms, torch {med['pw_torch'] - w:.3f}, "
          f"lean nogc {med['pw_lean_nogc'] - w:.3f} (whole after the piecewise runs)", flush=True)
    g = None
    ex._release(seqs, new_pages)
    for s in seqs:
        ex.free(s)
    torch.cuda.empty_cache()


def phases(ex, att, meta, step, pad, label, repeats):
    st = []
    saved = {}
    fp, fr, guard = att._fast_plan, att._fast, att._plan_guard
    for obj, name, tag in ((att, "plan", "plan"), (guard, "before", "guard.before"), (guard, "after", "guard.after"),
                           (fp, "fn", "planner"), (att, "forward", "attn"), (fr, "fn", "kernel")):
        if obj is None:
            continue
        saved[(obj, name)] = (name in vars(obj), getattr(obj, name))
        setattr(obj, name, stamp(st, tag, getattr(obj, name)))
    prog = ex.piecewise.programs[pad]
    calls = next(c.cell_contents for c in prog.__closure__ if isinstance(c.cell_contents, list))
    old_calls = list(calls)
    for i, (fn, a) in enumerate(calls[:6]):
        calls[i] = (stamp(st, f"call{i}", fn), a)
    ex.piecewise.programs[pad] = stamp(st, "program", prog)
    runs = []
    try:
        for _ in range(repeats):
            sync()
            st.clear()
            t0 = ns()
            step()
            t1 = ns()
            sync()
            runs.append([("start", t0)] + list(st) + [("end", t1)])
        # hot: the plan twice in a row, the second timed
        hot = []
        for _ in range(repeats):
            sync()
            att.plan(meta)
            st.clear()
            t0 = ns()
            att.plan(meta)
            hot.append((ns() - t0) / 1e3)
    finally:
        for (obj, name), (own, fn) in saved.items():
            if own:
                setattr(obj, name, fn)
            else:
                delattr(obj, name)  # back to the class's method
        calls[:] = old_calls
        ex.piecewise.programs[pad] = prog
    # per phase: median us between consecutive stamps (the first attention call only)
    names = [n for n, _ in runs[0]]
    keep = len(names)
    seen_attn = 0
    for i, n in enumerate(names):
        if n == "attn<":
            seen_attn += 1
            if seen_attn == 1:
                keep = i + 1
    segs = []
    for i in range(1, min(keep + 6, len(names))):
        d = statistics.median((r[i][1] - r[i - 1][1]) / 1e3 for r in runs if len(r) > i)
        segs.append(f"{names[i - 1]}->{names[i]} {d:.1f}")
    total = statistics.median((r[-1][1] - r[0][1]) / 1e3 for r in runs)
    print(f"  {label} phases (us): " + "; ".join(segs), flush=True)
    print(f"  {label} host total {total:.0f} us; plan hot (second of two) {statistics.median(hot):.1f} us", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.max_context=4096", "runtime.dtype=bfloat16",
          "kv_cache.num_tokens=32768", "backends.attention=flashinfer", "backends.options.flashinfer.variant=fa2",
          "cuda_graph.decode.enabled=off", "cuda_graph.extend.enabled=off",
          "cuda_graph.piecewise.sizes=[16,64,128,256,288,512]", *a.set]
    ex = Executor.from_config(None, ov, progress=False)
    print(torch.cuda.get_device_name(), flush=True)
    for T in (16, 128):
        seqs, toks = setup(ex, T, 0, 0)
        probe(ex, seqs, toks, f"T{T}", a.repeats)
    seqs, toks = setup(ex, 256, 32, 512)
    probe(ex, seqs, toks, "mixed", a.repeats)
    cpu_after_step(ex, a.repeats)


def loop() -> int:
    s = 0
    for i in range(3000):
        s += i
    return s


def cpu_after_step(ex, repeats):
    """A tiny pure-Python loop (no cache footprint) timed right after a synchronize that ends a piecewise step, and
    again at once: slower the first time means a slow core after the wait (clock, power state), not cold caches."""
    seqs, toks = setup(ex, 128, 0, 0)
    new_pages = ex._reserve_pages(seqs, toks)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, seqs, toks, 128)
    k = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)
    first, second, idle = [], [], []
    for _ in range(repeats):
        ex.run_model(k, meta, ids)
        sync()
        t0 = ns()
        loop()
        t1 = ns()
        loop()
        t2 = ns()
        first.append((t1 - t0) / 1e3)
        second.append((t2 - t1) / 1e3)
        time.sleep(0.005)
        t0 = ns()
        loop()
        idle.append((ns() - t0) / 1e3)
    print(f"loop us: right after a step's synchronize {statistics.median(first):.1f}, at once again "
          f"{statistics.median(second):.1f}, after a 5 ms sleep {statistics.median(idle):.1f}", flush=True)
    ex._release(seqs, new_pages)


if __name__ == "__main__":
    main()
