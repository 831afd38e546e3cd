"""Where a full-graph decode step's GPU time goes with the kernels overlapping (PDL): a kernel timeline.

    python benchmarks/timeline.py --decode 1 --set quantization.format=nvfp4 --set backends.fp4_gemm=cuda \
        --set backends.options.flashinfer.variant=fa2 [--steps 20] [--trace PATH.json]

Records `--steps` replays of the step's decode graph (sequences of 512 tokens) with torch.profiler (CUPTI
kernel records, graph kernels included), then walks each step's kernels in start order: a kernel's
*exposed* time is the part of [start, end] after the latest end of the kernels before it (what it adds
to the step's span), its *lead* is start minus that latest end (negative: it started while the one
before still ran, as PDL allows; positive: an idle gap). Prints per role (the q/k/v GEMM, attention, o,
the norms, gate/up, down, lm_head, ...) the kernel time, exposed time and lead per step, and the step's
span next to a synchronized Executor.forward timed without the profiler (host work included). Needs a
CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests load this file by its path

from profile_step import decode_setup  # noqa: E402


def role(name: str, previous: str) -> str:
    """A kernel's place in the Llama step from its name and the role of the GEMM before it."""
    n = name.lower()
    if "nvfp4_decode_gemm" in n:
        epi = n.split("nvfp4_decode_gemm<")[1].split(">")[0].split(",")[3].strip()
        return {"2": "q/k/v gemm (+rope)", "1": "gate/up gemm (+swiglu)", "3": "o/down gemm (+residual)",
                "4": "o/down gemm (+residual, norm)"}.get(epi, "down gemm" if previous.startswith("gate/up")
                                                       else "o gemm")
    for key, r in (("fp4_gemm", "fp4 gemm (Triton)"), ("_decode_kernel", "attention"),
                   ("rms", "norm"), ("norm", "norm"), ("gemm", "lm_head (cuBLAS)"), ("gemv", "lm_head (cuBLAS)"),
                   ("nvjet", "lm_head (cuBLAS)")):
        if key in n:
            return r
    return "other: " + name[:60]


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
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--arch", default="llama")
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--trace", help="also write the chrome trace here")
    args = p.parse_args()
    ex, batch = decode_setup(args, args.context)
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        ex.forward(batch)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ex.forward(batch)
            torch.cuda.synchronize()
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    events.sort(key=lambda e: e["ts"])
    steps = split_steps(events)
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
    print("\n| role | launches | kernel us | exposed us | lead us (sum; < 0: overlap) | exposed per launch |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for r, lst in per_role.items():
        k, x, lead, c = (sum(v[i] for v in lst) / n for i in range(4))
        rows.append((x, r, c, k, lead))
    for x, r, c, k, lead in sorted(rows, reverse=True):
        print(f"| {r} | {c:.0f} | {k:.1f} | {x:.1f} | {lead:.1f} | {x / max(c, 1):.2f} |")
    print(f"| sum | | {sum(r[3] for r in rows):.1f} | {sum(r[0] for r in rows):.1f} | | |")
    # the first full layer of the first step: each kernel's start, duration, lead
    s = steps[0]
    print("\nfirst 16 kernels of one step (us from its first kernel): start, duration, lead, role")
    end_so_far, prev_gemm = s[0]["ts"], ""
    for e in s[:16]:
        r = role(e["name"], prev_gemm)
        if "gemm" in r:
            prev_gemm = r
        print(f"  {e['ts'] - s[0]['ts']:8.2f} {e['dur']:7.2f} {e['ts'] - end_so_far:7.2f}  {r}")
        end_so_far = max(end_so_far, e["ts"] + e["dur"])


if __name__ == "__main__":
    main()
