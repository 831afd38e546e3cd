"""Where the time of one step goes.

    python benchmarks/profile_step.py --tokens 16 --set backends.attention=flashinfer  # piecewise extend: cProfile
    python benchmarks/profile_step.py --tokens 16,64,128,256 --mixed 256x32 --timeline \
        --set backends.attention=flashinfer --set backends.options.flashinfer.variant=fa2  # piecewise vs whole graph
    python benchmarks/profile_step.py --decode 1 --set quantization.format=nvfp4  # decode: kernels, cProfile
    python benchmarks/profile_step.py --decode 1 --timeline --steps 20 --set quantization.format=nvfp4 \
        --set backends.fp4_gemm=cuda --set backends.options.flashinfer.variant=fa2 [--trace PATH.json]

Under programmatic dependent launch (runtime.pdl, on by default on sm_90) kernels overlap, so per-kernel
times add up to more than the step; `--set runtime.pdl=off` gives a breakdown that sums to its GPU time.

Extend `--timeline`, per T (and the `--mixed` step): host ms of the plan, of the forward's launches, synchronized
forward with and without the plan, a whole-forward graph of the step (no re-plan); from CUPTI records of both,
GPU span, busy and idle us, idle by the kernel family that ends it, idle before the first attention kernel, and
idle waiting for the host: before a kernel whose launch call returned after the GPU ran dry (`host_waits`).
Decode `--timeline` walks each replay's kernels (CUPTI records) in start order (`walk`): per role (q/k/v
GEMM, attention, o, norms, gate/up, down, lm_head, ...) the kernel time, the time it adds to the step's
span (exposed) and its lead (< 0: it overlapped the kernels before it), next to a synchronized
Executor.forward timed without the profiler. Both need a CUDA GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time

import torch
from common import md_table, sync, wall_ms
from graphs import plan as plan_step
from graphs import mixed_step, whole_graph

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context

FAMILIES = (("nvfp4_decode_gemm", "fp4 gemm (cuda)"), ("nvfp4_decode_dequant", "fp4 dequant (cuda)"),
            ("fp4_gemm", "fp4 gemm (Triton)"), ("nvjet", "bf16 gemm (cuBLAS: lm_head)"),
            ("splitk", "fp4 gemm split-K reduce"), ("gemm", "bf16 gemm (cuBLAS: lm_head)"),
            ("gemv", "bf16 gemm (cuBLAS: lm_head)"), ("_decode_kernel", "attention (attention.triton)"),
            ("prefill", "attention (FlashInfer)"), ("decode", "attention (FlashInfer)"),
            ("write_rows", "KV write"), ("rms", "norm"), ("norm", "norm"))
EPILOGUES = {"2": "q/k/v gemm (+rope)", "1": "gate/up gemm (+swiglu)", "3": "o/down gemm (+residual)",
             "4": "o/down gemm (+residual, norm)"}


def kernel_family(name: str) -> str:
    n = name.lower()
    return next((family for key, family in FAMILIES if key in n), "other elementwise/reduction")


def role(name: str, previous: str) -> str:
    """A kernel's place in the Llama step: the CUDA GEMMs by their epilogue (a plain one, and every wgmma one
    but gate/up's, by the GEMM before it, `previous`), other kernels by family."""
    if "fp4_wgmma_tma<" in name:  # <BM, stages, SWIGLU, SPLIT, SK>: the M > 16 kernel; no epilogue in its name
        if name.split("fp4_wgmma_tma<")[1].split(">")[0].split(",")[2].strip() == "1":
            return "gate/up gemm (+swiglu)"
        return {"q/k/v": "o gemm", "gate/up": "down gemm"}.get(previous.split(" ")[0], "q/k/v gemm (+rope)")
    if "nvfp4_decode_gemm<" not in name:
        return kernel_family(name)
    epi = name.split("nvfp4_decode_gemm<")[1].split(">")[0].split(",")[3].strip()
    return EPILOGUES.get(epi, "down gemm" if previous.startswith("gate/up") else "o gemm")


def split_steps(events: list[dict], gap_us: float = 20.0, least: int = 10) -> list[list[dict]]:
    """Kernel records (chrome-trace "X" events: ts, dur in us) in start order -> steps: split where the
    GPU was idle for more than `gap_us` (the host work between synchronized steps); steps of fewer than
    `least` kernels dropped."""
    steps, cur, last_end = [], [], None
    for e in events:
        if last_end is not None and e["ts"] - last_end > gap_us:
            steps.append(cur)
            cur = []
        cur.append(e)
        last_end = max(last_end if last_end is not None else e["ts"], e["ts"] + e["dur"])
    steps.append(cur)
    return [s for s in steps if len(s) >= least]


def host_waits(step: list[dict], launches: dict, least_us: float = 0.5) -> tuple[float, dict[str, float]]:
    """GPU idle time of one step spent waiting for the host: an idle gap (over `least_us`) before a record whose
    launch call (`launches`: CUPTI runtime/driver records by correlation id; a graph's kernels share their
    cudaGraphLaunch's) ended after the GPU ran dry counts up to that end. (total us, {launch call: us})."""
    end, total, by_call = step[0]["ts"], 0.0, {}
    for e in step:
        gap = e["ts"] - end
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if gap > least_us and launch is not None and launch["ts"] + launch["dur"] > end:
            wait = min(gap, launch["ts"] + launch["dur"] - end)
            total += wait
            by_call[launch["name"]] = by_call.get(launch["name"], 0.0) + wait
        end = max(end, e["ts"] + e["dur"])
    return total, by_call


def walk(step: list[dict]) -> tuple[float, dict[str, list[float]]]:
    """One step's kernels in start order -> (span, {role: [kernel us, exposed us, lead us, launches]}):
    exposed = the part of a kernel after the latest end of the kernels before it, lead = its start minus
    that end (negative: it overlapped them). The exposed times add up to the span."""
    end_so_far, prev_gemm = step[0]["ts"], ""
    acc: dict[str, list[float]] = {}
    for e in step:
        r = role(e["name"], prev_gemm)
        if "gemm" in r and "reduce" not in r:  # a split-K sum between q/k/v and o is no GEMM of the layer's
            prev_gemm = r
        start, end = e["ts"], e["ts"] + e["dur"]
        a = acc.setdefault(r, [0.0, 0.0, 0.0, 0])
        a[0] += e["dur"]
        a[1] += max(0.0, end - max(start, end_so_far))
        a[2] += start - end_so_far
        a[3] += 1
        end_so_far = max(end_so_far, end)
    return end_so_far - step[0]["ts"], acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--arch", default="llama")
    p.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[16],
                   help="extend tokens, comma-separated (without --decode)")
    p.add_argument("--mixed", default="", help="CHUNKxDECODES, e.g. 256x32: also a mixed step of one prefill chunk "
                   "and DECODES decode rows over --context-token sequences (without --decode)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--decode", type=int, default=0, help="profile decode graph replays at this batch size")
    p.add_argument("--context", type=int, default=512, help="tokens per sequence before the decode steps and rows")
    p.add_argument("--timeline", action="store_true",
                   help="the kernel timeline (with --decode: under PDL; without: against a whole-forward graph)")
    p.add_argument("--trace", help="with --timeline: also write the chrome trace here")
    args = p.parse_args()
    if args.timeline and not torch.cuda.is_available():
        raise SystemExit("--timeline needs a CUDA GPU (it reads CUDA graphs' kernels from a trace)")
    if args.decode:
        ex, batch = decode_setup(args)
        (timeline if args.timeline else profile_decode)(ex, batch, args)
        return
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", "kv_cache.num_tokens=16384",
                 "cuda_graph.piecewise.enabled=on", "cuda_graph.piecewise.max_tokens=512",
                 "cuda_graph.decode.enabled=off", *args.set]  # on a CPU the pieces run directly
    ex = Executor.from_config(None, overrides, progress=False)
    cases = [(f"T = {T}", [ex.new_sequence()], [torch.randint(0, ex.vocab_size, (T,)).tolist()]) for T in args.tokens]
    if args.mixed:
        chunk, decodes = map(int, args.mixed.split("x"))
        seqs: list = []
        cases.append((f"{chunk} + {decodes} x 1", seqs, mixed_step(ex, chunk, decodes, args.context, seqs)))
    for label, seqs, toks in cases:
        mode = ForwardMode.classify(list(map(len, toks)), [s.kv_len for s in seqs])
        new_pages = ex._reserve_pages(seqs, toks)
        size = ex.piecewise.padded_size(sum(map(len, toks)))
        meta, ids = ex.prepare_step(mode, GraphMode.PIECEWISE, seqs, toks, size)
        kernels = ex.table.step(mode, GraphMode.PIECEWISE)

        def plan(kernels=kernels, meta=meta):
            plan_step(kernels, meta)

        def forward(kernels=kernels, meta=meta, ids=ids):
            with forward_context(ForwardContext(kernels, meta, ex.kv)):
                ex.piecewise(ids, meta.positions)

        def step(kernels=kernels, meta=meta, ids=ids):
            ex.run_model(kernels, meta, ids)  # as Executor.forward

        if args.timeline:
            extend_timeline(ex, label, mode, seqs, toks, plan, forward, step, args.steps)
        else:
            print(f"{label}, piecewise {mode.name.lower()}: plan + forward")
            print_cprofile(step, args.steps, 25)
        ex._release(seqs, new_pages)
        for s in seqs:
            ex.free(s)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def extend_timeline(ex, label, mode, seqs, toks, plan, forward, step, steps: int) -> None:
    """The extend `--timeline` of one step (module docstring); `step`: plan + forward as the executor runs them."""
    plan()
    forward()
    t = {"plan host": wall_ms(plan, steps, wait=False), "forward launches": wall_ms(forward, steps, False, plan),
         "forward": wall_ms(forward, steps, True, plan), "plan + forward": wall_ms(step, steps)}
    launches: dict = {"piecewise plan + forward": {}, "whole graph": {}}  # per trace: launch records by correlation
    traces = {"piecewise plan + forward": traced_steps(step, 5, launches=launches["piecewise plan + forward"])}
    # The whole graph last: a plan after its capture would free the index buffers it reads (`whole_graph`).
    meta, ids = ex.prepare_step(mode, GraphMode.EAGER, seqs, toks)
    kernels = ex.table.step(mode, GraphMode.EAGER)
    graph = whole_graph(ex, kernels, meta, ids)
    t["whole graph"] = wall_ms(graph.replay, steps)
    traces["whole graph"] = traced_steps(graph.replay, 5, launches=launches["whole graph"])
    print(f"{label}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in t.items()) +
          f"; plan + forward - whole graph {t['plan + forward'] - t['whole graph']:.3f} ms")
    rows = []
    for name, steps_traced in traces.items():
        gaps, spans, busy, head = {}, [], [], []  # idle us by family; per step: span, busy, idle at the head
        waits, calls = [], {}  # per step: idle waiting for the host; us by launch call over all steps
        for s in steps_traced:
            w, by_call = host_waits(s, launches[name])
            waits.append(w)
            for k, v in by_call.items():
                calls[k] = calls.get(k, 0.0) + v / len(steps_traced)
            end, b, first_attention = s[0]["ts"], 0.0, None
            for e in s:
                fam = kernel_family(e["name"]) if e.get("cat") == "kernel" else "copy"
                if e["ts"] > end:
                    gaps[fam] = gaps.get(fam, 0.0) + (e["ts"] - end) / len(steps_traced)
                if first_attention is None and fam.startswith("attention"):
                    first_attention = e["ts"] - s[0]["ts"] - b
                b += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
                end = max(end, e["ts"] + e["dur"])
            spans.append(end - s[0]["ts"])
            busy.append(b)
            head.append(first_attention or 0.0)
        top = ", ".join(f"{fam} {us:.0f}" for fam, us in sorted(gaps.items(), key=lambda kv: -kv[1])[:4])
        span, b = statistics.median(spans), statistics.median(busy)
        waiting = ", ".join(f"{k} {us:.0f}" for k, us in sorted(calls.items(), key=lambda kv: -kv[1])[:3])
        rows.append([name, f"{span:.0f}", f"{b:.0f}", f"{span - b:.0f}", f"{statistics.median(head):.0f}", top,
                     f"{statistics.median(waits):.0f}" + (f" ({waiting})" if waiting else "")])
    print(md_table([label, "GPU span us", "busy us", "idle us", "idle before the first attention us",
                    "idle us by the kernel family after it", "idle us waiting for the host (by launch call)"], rows))


def traced_steps(fn, n: int, trace: str | None = None, cats=("kernel", "gpu_memcpy", "gpu_memset"),
                 gap_us: float = 1000.0, launches: dict | None = None) -> list[list[dict]]:
    """Records of `cats` over n synchronized calls of fn (2 ms apart), split into calls (`split_steps`);
    `launches` (a dict) receives the launch calls' records by correlation id (`host_waits`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
            sync()
            time.sleep(0.002)
    path = trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    if launches is not None:
        launches.update({(e.get("args") or {}).get("correlation"): e for e in events
                         if e.get("cat") in ("cuda_runtime", "cuda_driver")})
    events = [e for e in events if e.get("cat") in cats]
    return split_steps(sorted(events, key=lambda e: e["ts"]), gap_us=gap_us, least=1 if gap_us > 100 else 10)


def print_cprofile(step, steps: int, top: int) -> float:
    """Run step() `steps` times under cProfile, print the `top` functions by own time; wall s per step."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())
    return (time.perf_counter() - t0) / steps


def decode_setup(args):
    """An executor for `args` (preset, arch, --set overrides) with full decode graphs at batch
    `args.decode`, that many sequences of `args.context` tokens prefilled, and the next decode batch,
    after 5 warm-up steps: (executor, batch)."""
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", "kv_cache.num_tokens=65536",
                 "cuda_graph.piecewise.enabled=off",
                 f"cuda_graph.decode.batch_sizes=[{args.decode}]", *args.set]
    ex = Executor.from_config(None, overrides, progress=False)
    seqs = [ex.new_sequence() for _ in range(args.decode)]
    for s in seqs:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (args.context,)).tolist()]))
    batch = ForwardBatch(seqs, [[1]] * args.decode)
    for _ in range(5):
        ex.forward(batch)
    sync()
    return ex, batch


def profile_decode(ex, batch, args) -> None:
    """GPU time per kernel over full-graph decode steps, then synchronized steps under cProfile."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ex.forward(batch)
        sync()
    per_kernel: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel.setdefault(ev.name, []).append(ev.device_time)
    total = sum(sum(v) for v in per_kernel.values()) / args.steps
    rows = sorted(((sum(v) / args.steps, len(v) / args.steps, k) for k, v in per_kernel.items()), reverse=True)
    print(f"decode batch {args.decode}: {total / 1e3:.3f} ms of kernel time per step over {args.steps} steps")
    from pieceworks.backends import pdl

    if pdl.enabled(ex.device):
        print("(PDL on: kernels overlap, so this sum exceeds the step; --set runtime.pdl=off for a breakdown)")
    families: dict[str, float] = {}
    for us, _, name in rows:
        families[kernel_family(name)] = families.get(kernel_family(name), 0.0) + us
    print(md_table(["kernel family", "us per step", "share"], [[fam, f"{us:.0f}", f"{100 * us / total:.0f}%"]
                   for fam, us in sorted(families.items(), key=lambda kv: -kv[1])]))
    print("\n" + md_table(["kernel", "us per step", "launches per step"],
                          [[name[:90], f"{us:.1f}", f"{count:.0f}"] for us, count, name in rows[:25]]))

    print("\nhost profile of synchronized steps under cProfile (adds overhead), top functions by own time:")
    wall = print_cprofile(lambda: (ex.forward(batch), sync()), args.steps, 30)
    print(f"{wall * 1e3:.3f} ms per synchronized step under cProfile")


def timeline(ex, batch, args) -> None:
    """Kernel records of `args.steps` synchronized decode steps, walked per step (module docstring)."""
    wall = wall_ms(lambda: ex.forward(batch), args.steps)
    steps = traced_steps(lambda: ex.forward(batch), args.steps, args.trace, ("kernel",), gap_us=20.0)
    per_role: dict[str, list[list[float]]] = {}
    spans = []
    for s in steps:
        span, acc = walk(s)
        spans.append(span)
        for r, a in acc.items():
            per_role.setdefault(r, []).append(a)
    n = len(steps)
    print(f"decode batch {args.decode}, {args.context} tokens: {n} steps traced; span (first kernel start to "
          f"last end) median {statistics.median(spans):.1f} us; synchronized Executor.forward without the "
          f"profiler median {wall * 1e3:.1f} us")
    rows = sorted(((*(sum(v[i] for v in lst) / n for i in (1, 3, 0, 2)), r) for r, lst in per_role.items()),
                  reverse=True)
    cells = [[r, f"{c:.0f}", f"{k:.1f}", f"{x:.1f}", f"{lead:.1f}", f"{x / max(c, 1):.2f}"] for x, c, k, lead, r in rows]
    cells.append(["sum", "", f"{sum(r[2] for r in rows):.1f}", f"{sum(r[0] for r in rows):.1f}", "", ""])
    print("\n" + md_table(["role", "launches", "kernel us", "exposed us", "lead us (sum; < 0: overlap)",
                           "exposed per launch"], cells))

if __name__ == "__main__":
    main()
