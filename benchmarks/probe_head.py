"""Probe (not for main): where a piecewise step's wall time over the whole graph goes, from CUPTI runtime +
kernel records. Per step: marker (cudaStreamQuery at the call) -> first GPU work, GPU idle waiting for the
host (kernel's launch call ended after the GPU ran dry) vs not, host enqueue time, wall b2b."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import time

import torch
from common import sync, wall_ms
from graphs import whole_graph

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context

CATS = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver")
GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def trace(fn, n, path, cpu=False):  # noqa: D103
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            torch.cuda.current_stream().query()  # marker: cudaStreamQuery
            fn()
            sync()
            time.sleep(0.003)
    prof.export_chrome_trace(path)
    with open(path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in CATS]
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path)
    return sorted(ev, key=lambda e: e["ts"])


def analyse(ev, name):
    marks = [e for e in ev if e["cat"] == "cuda_runtime" and e["name"] == "cudaStreamQuery"]
    rows = []
    for i, m in enumerate(marks):
        end = marks[i + 1]["ts"] if i + 1 < len(marks) else float("inf")
        step = [e for e in ev if m["ts"] <= e["ts"] < end]
        gpu = [e for e in step if e["cat"] in GPU]
        host = [e for e in step if e["cat"] in ("cuda_runtime", "cuda_driver")]
        launch = {e["args"].get("correlation"): e for e in host}
        syncs = [e for e in host if "ynchronize" in e["name"]]
        if not gpu:
            continue
        first = gpu[0]["ts"]
        t_end, host_wait, other_idle, waits = first, 0.0, 0.0, {}
        for e in gpu:
            gap = e["ts"] - t_end
            if gap > 0.5:
                la = launch.get(e["args"].get("correlation"))
                if la is not None and la["ts"] + la["dur"] > t_end:
                    w = min(gap, la["ts"] + la["dur"] - t_end)
                    host_wait += w
                    key = la["name"] + ":" + e["name"][:40]
                    waits[key] = waits.get(key, 0.0) + w
                    other_idle += gap - w
                else:
                    other_idle += gap
            t_end = max(t_end, e["ts"] + e["dur"])
        last_launch = max((h["ts"] + h["dur"] for h in host if h not in syncs), default=m["ts"])
        first_host = [h for h in host if h is not m][:1]
        rows.append(dict(head=first - m["ts"], span=t_end - first, host_wait=host_wait, other_idle=other_idle,
                         enqueue=last_launch - m["ts"], lag=t_end - last_launch,
                         first_call=(first_host[0]["name"] if first_host else ""),
                         to_first_call=(first_host[0]["ts"] - m["ts"] if first_host else 0),
                         waits=waits, n_host=len(host), n_gpu=len(gpu)))
    if not rows:
        print(name, "no steps")
        return
    rows = rows[1:] if len(rows) > 2 else rows
    med = {k: statistics.median(r[k] for r in rows) for k in ("head", "span", "host_wait", "other_idle", "enqueue",
                                                               "lag", "to_first_call", "n_host", "n_gpu")}
    print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()) + f"; first call {rows[0]['first_call']}")
    agg = {}
    for r in rows:
        for k, v in r["waits"].items():
            agg[k] = agg.get(k, 0.0) + v / len(rows)
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    host wait {v:7.1f} us before {k}")


def setup(ex, chunk, decodes, context):
    seqs = [ex.new_sequence() for _ in range(decodes + 1)]
    for s in seqs[1:]:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,)).tolist()]))
    toks = [torch.randint(0, ex.vocab_size, (chunk,)).tolist()] + [[1]] * decodes
    return seqs, toks


def stamps_of(ex, size):
    """Wrap the recorded program's calls in place so each appends a perf_counter_ns stamp; returns the list."""
    prog = ex.piecewise.programs[size]
    lists = [c.cell_contents for c in prog.__closure__ if isinstance(c.cell_contents, list)]
    st = []

    def wrap(fn):
        def g(*a):
            fn(*a)
            st.append(time.perf_counter_ns())
        return g

    saved = [list(lst) for lst in lists]
    for lst in lists:
        for i, (fn, args) in enumerate(lst):
            lst[i] = (wrap(fn), args)

    def restore():
        for lst, old in zip(lists, saved):
            lst[:] = old
    return st, restore


def probe(ex, seqs, toks, out, label, repeats, save):
    T = sum(map(len, toks))
    mode = ForwardMode.classify(list(map(len, toks)), [s.kv_len for s in seqs])
    new_pages = ex._reserve_pages(seqs, toks)
    meta, ids = ex.prepare_step(mode, GraphMode.EAGER, seqs, toks)
    k_eager = ex.table.step(mode, GraphMode.EAGER)
    pad = ex.piecewise.padded_size(T)
    meta_p, ids_p = ex.prepare_step(mode, GraphMode.PIECEWISE, seqs, toks, pad)
    k_pw = ex.table.step(mode, GraphMode.PIECEWISE)

    def plan():
        for b in (k_pw.attention, k_pw.mla):
            if b is not None:
                b.plan(meta_p)

    def pw_new():
        ex.run_model(k_pw, meta_p, ids_p)

    def pw_old():
        plan()
        with forward_context(ForwardContext(k_pw, meta_p, ex.kv)):
            ex.piecewise(ids_p, meta_p.positions)

    pw_new()
    g = None
    res = {"plan_host": wall_ms(plan, repeats, wait=False), "new_enqueue": wall_ms(pw_new, repeats, wait=False),
           "old_enqueue": wall_ms(pw_old, repeats, wait=False)}
    att = k_pw.attention
    print(label, "fast run", getattr(att, "_fast", None) is not None, "fast plan",
          getattr(att, "_fast_plan", None) is not None, flush=True)
    if save:
        analyse(trace(pw_new, 8, f"{out}/{label}_pw.json"), f"{label} piecewise (new order)")
    # unprofiled host stamps per call, GPU drained before each step, and back to back
    st, restore = stamps_of(ex, pad)
    for wait in (False, True):
        runs = []
        for _ in range(repeats):
            sync()
            st.clear()
            t0 = time.perf_counter_ns()
            pw_new()
            t1 = time.perf_counter_ns()
            if wait:
                sync()
            runs.append([t0] + list(st) + [t1])
        d = [[(r[i + 1] - r[i]) / 1e3 for i in range(len(r) - 1)] for r in runs]
        med = [statistics.median(x[i] for x in d) for i in range(len(d[0]))]
        print(f"  {label} host us per call ({'b2b' if wait else 'drained'}): head {med[0]:.1f} (copy + first "
              f"piece), then plan+attn0 {med[1]:.1f}, replays med {statistics.median(med[2::2]):.1f} max "
              f"{max(med[2::2]):.1f}, attention med {statistics.median(med[3::2]):.1f} max {max(med[3::2]):.1f}, "
              f"total {sum(med):.1f}; first 8: " + " ".join(f"{v:.0f}" for v in med[:8]), flush=True)
    restore()
    g = whole_graph(ex, k_eager, meta, ids)
    # alternated, back to back each
    fns = {"new": pw_new, "old": pw_old, "whole": g.replay}
    acc = {k: [] for k in fns}
    for _ in range(3):
        for f in fns.values():
            f()
    sync()
    for _ in range(repeats):
        for k, f in fns.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            acc[k].append((time.perf_counter() - t0) * 1e3)
    res.update({f"{k}_b2b": statistics.median(v) for k, v in acc.items()})
    res["new-whole"] = res["new_b2b"] - res["whole_b2b"]
    res["old-whole"] = res["old_b2b"] - res["whole_b2b"]
    print(label, {k: round(v, 4) for k, v in res.items()}, flush=True)
    g = None
    ex._release(seqs, new_pages)
    torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.max_context=9216", "runtime.dtype=bfloat16",
          "kv_cache.num_tokens=40960", "backends.attention=flashinfer", "backends.mla=flashinfer",
          "backends.options.flashinfer.variant=fa2", "cuda_graph.decode.enabled=off",
          "cuda_graph.piecewise.sizes=[16,64,128,256,288,512]", *a.set]
    ex = Executor.from_config(None, ov, progress=False)
    print(torch.cuda.get_device_name(), flush=True)
    for T in (16, 128, 256):
        seqs, toks = setup(ex, T, 0, 0)
        probe(ex, seqs, toks, a.out, f"T{T}", a.repeats, T == 16)
        for s in seqs:
            ex.free(s)
    seqs, toks = setup(ex, 256, 32, 512)
    probe(ex, seqs, toks, a.out, "mixed", a.repeats, True)


if __name__ == "__main__":
    main()
