"""Where the time of one step goes.

    python benchmarks/profile_step.py --tokens 16 --set backends.attention=flashinfer   # piecewise extend:
                                                                  # host time by function (cProfile)
    python benchmarks/profile_step.py --decode 1 --set quantization.format=nvfp4 \
        --set backends.attention=flashinfer       # full-graph decode: GPU time by kernel (torch.profiler),
                                                  # then host time by function (cProfile)
    python benchmarks/profile_step.py --decode 1 --timeline --steps 20 --set quantization.format=nvfp4 \
        --set backends.fp4_gemm=cuda --set backends.options.flashinfer.variant=fa2 [--trace PATH.json]

With programmatic dependent launch (runtime.pdl, on by default on sm_90) a kernel starts before the one
before it ends and waits on the GPU, so per-kernel times overlap and their sum exceeds the step; add
`--set runtime.pdl=off` for a breakdown whose sum is the GPU time of the step. The host time of each part
of a decode step (schedule, validate, reserve pages, plan, graph launch, sample): `serving.py --host-overhead`.

--timeline walks each replay's kernels (CUPTI records) in start order (`walk`): per role (q/k/v GEMM,
attention, o, norms, gate/up, down, lm_head, ...) the kernel time, the time it adds to the step's span
(exposed) and its lead (< 0: it overlapped the kernels before it, as PDL allows), next to a synchronized
Executor.forward timed without the profiler. Needs a CUDA GPU (piecewise and decode graphs).
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
from common import md_table, sync

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context

FAMILIES = (("nvfp4_decode_gemm", "fp4 gemm (cuda)"), ("nvfp4_decode_dequant", "fp4 dequant (cuda)"),
            ("fp4_gemm", "fp4 gemm (Triton)"), ("splitk", "fp4 gemm split-K reduce"),
            ("gemm", "bf16 gemm (cuBLAS: lm_head)"), ("gemv", "bf16 gemm (cuBLAS: lm_head)"),
            ("nvjet", "bf16 gemm (cuBLAS: lm_head)"), ("_decode_kernel", "attention (attention.triton)"),
            ("prefill", "attention (FlashInfer)"), ("decode", "attention (FlashInfer)"),
            ("write_rows", "KV write"), ("rms", "norm"), ("norm", "norm"))
EPILOGUES = {"2": "q/k/v gemm (+rope)", "1": "gate/up gemm (+swiglu)", "3": "o/down gemm (+residual)",
             "4": "o/down gemm (+residual, norm)"}


def kernel_family(name: str) -> str:
    n = name.lower()
    return next((family for key, family in FAMILIES if key in n), "other elementwise/reduction")


def role(name: str, previous: str) -> str:
    """A kernel's place in the Llama step: the CUDA GEMMs by their epilogue (a plain one by the GEMM before
    it, `previous`), other kernels by family."""
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


def walk(step: list[dict]) -> tuple[float, dict[str, list[float]]]:
    """One step's kernels in start order -> (span, {role: [kernel us, exposed us, lead us, launches]}):
    exposed = the part of a kernel after the latest end of the kernels before it, lead = its start minus
    that end (negative: it overlapped them). The exposed times add up to the span."""
    end_so_far, prev_gemm = step[0]["ts"], ""
    acc: dict[str, list[float]] = {}
    for e in step:
        r = role(e["name"], prev_gemm)
        if "gemm" in r:
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
    p.add_argument("--tokens", type=int, default=16, help="extend tokens (without --decode)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--decode", type=int, default=0, help="profile decode graph replays at this batch size")
    p.add_argument("--context", type=int, default=512, help="tokens per sequence before the decode steps")
    p.add_argument("--timeline", action="store_true", help="with --decode: the kernel timeline under PDL")
    p.add_argument("--trace", help="with --timeline: also write the chrome trace here")
    args = p.parse_args()
    if args.decode:
        ex, batch = decode_setup(args)
        (timeline if args.timeline else profile_decode)(ex, batch, args)
        return
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", "model.max_context=4096",
                 "kv_cache.num_tokens=16384", "cuda_graph.piecewise.max_tokens=256",
                 "cuda_graph.decode.enabled=off", *args.set]
    ex = Executor.from_config(None, overrides, progress=False)
    toks = torch.randint(0, ex.vocab_size, (args.tokens,)).tolist()
    seq = ex.new_sequence()
    ex._reserve_pages([seq], [toks])
    pad = ex.piecewise.padded_size(args.tokens)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], [toks], pad)
    kernels = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)

    def step():
        for b in (kernels.attention, kernels.mla):
            if b is not None:
                b.plan(meta)
        with forward_context(ForwardContext(kernels, meta, ex.kv)):
            ex.piecewise(ids, meta.positions)

    for _ in range(5):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - t0) / args.steps
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    print(f"host time per step {host * 1e3:.3f} ms (launch-bound if close to wall {wall * 1e3:.3f} ms)")
    print_cprofile(step, args.steps, 25)


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
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", "model.max_context=4096",
                 "kv_cache.num_tokens=65536", "cuda_graph.piecewise.enabled=off",
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

    # Executor.forward under cProfile (each step synchronized, as a caller reading logits).
    print("\nhost profile under cProfile (adds overhead), top functions by own time:")
    wall = print_cprofile(lambda: (ex.forward(batch), sync()), args.steps, 30)
    print(f"{wall * 1e3:.3f} ms per synchronized step under cProfile")


def timeline(ex, batch, args) -> None:
    """Kernel records of `args.steps` synchronized decode steps, walked per step (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        ex.forward(batch)
        sync()
        walls.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ex.forward(batch)
            sync()
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    steps = split_steps(sorted(events, key=lambda e: e["ts"]))
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
          f"profiler median {statistics.median(walls) * 1e6:.1f} us")
    rows = sorted(((*(sum(v[i] for v in lst) / n for i in (1, 3, 0, 2)), r) for r, lst in per_role.items()),
                  reverse=True)
    cells = [[r, f"{c:.0f}", f"{k:.1f}", f"{x:.1f}", f"{lead:.1f}", f"{x / max(c, 1):.2f}"] for x, c, k, lead, r in rows]
    cells.append(["sum", "", f"{sum(r[2] for r in rows):.1f}", f"{sum(r[0] for r in rows):.1f}", "", ""])
    print("\n" + md_table(["role", "launches", "kernel us", "exposed us", "lead us (sum; < 0: overlap)",
                           "exposed per launch"], cells))
    print("\nfirst 16 kernels of one step (us from its first kernel): start, duration, lead, role")
    s = steps[0]
    end_so_far, prev_gemm = s[0]["ts"], ""
    for e in s[:16]:
        r = role(e["name"], prev_gemm)
        prev_gemm = r if "gemm" in r else prev_gemm
        print(f"  {e['ts'] - s[0]['ts']:8.2f} {e['dur']:7.2f} {e['ts'] - end_so_far:7.2f}  {r}")
        end_so_far = max(end_so_far, e["ts"] + e["dur"])


if __name__ == "__main__":
    main()
