"""Whether the wgmma GEMM at serving M is held back by the GPU's clock (power) rather than its SMs: each
variant's CUDA graph (back-to-back calls over rotating weight copies, as `common.graph_time`) replays for about
`--seconds` while `nvidia-smi` samples the SM clock and the board power every 50 ms; per variant: us per call,
TFLOP/s, median SM clock MHz and power W over the samples taken while it ran.

    python benchmarks/gemm_clock_probe.py --ms 256,512 --seconds 2 --out $OUT

Variants per shape (Llama-3.1-8B q/k/v and gate/up) and M: bf16 cuBLAS, the wgmma kernel one 256-token tile per CTA
(q/k/v: 48 CTAs at 256 rows, 96 at 512, the launch the plan uses there), and stream-K forced (one CTA per SM).
Per-CTA speed falling as CTAs are added at the same clock points at a shared resource (L2); a lower clock with
more SMs busy at power.
H200 only (sm_90a).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from common import SHAPES, copies_for, random_nvfp4

from pieceworks.backends import pdl
from pieceworks.backends.fp4_gemm import cuda_wgmma as W
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors


def graph_of(call, n_calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            call(i)
    return graph


def sustained(graph: torch.cuda.CUDAGraph, n_calls: int, seconds: float) -> tuple[float, float, float]:
    """(seconds per call, start, end) of replays for about `seconds` (wall clock of the timed part)."""
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.time()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 0
    while time.time() - t0 < seconds:
        for _ in range(10):
            graph.replay()
        reps += 10
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * n_calls), t0, time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="256,512", help="rows; at 256-token tiles 256 rows run 48 q/k/v CTAs, 512 96")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--shapes", default="llama.qkv,llama.gate_up")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    print("pdl", pdl.configure("on", "cuda"), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = multiprocessors(torch.device("cuda"))
    work = torch.zeros(W.workspace_floats(sms, 256), device="cuda")
    flags = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    spans, rows = [], []
    for name, m in [(name, int(m)) for name in args.shapes.split(",") for m in args.ms.split(",")]:
        n, k = SHAPES[name]
        ws = [random_nvfp4(n, k, gen) for _ in range(copies_for(n * k * 0.5625))]
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(copies_for(n * k * 2))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        bm = 256  # the same per-CTA work at every M: only the number of CTAs changes
        st = W.max_stages(bm)
        variants = {
            "bf16": (lambda i: torch.matmul(x, wb[i % len(wb)].t(), out=out), len(wb)),
            "wgmma": (lambda i: W.gemm(x, *ws[i % len(ws)], n, k, bm, st, out=out), len(ws)),
            "stream-k": (lambda i: W.gemm(x, *ws[i % len(ws)], n, k, bm, st, out=out, stream_k=sms,
                                          workspace=(work, flags)), len(ws)),
        }
        for label, (call, n_calls) in variants.items():
            graph = graph_of(call, n_calls)
            per_call, t0, t1 = sustained(graph, n_calls, args.seconds)
            spans.append((name, label, t0, t1))
            ctas = sms if label == "stream-k" else -(-m // bm) * -(-n // W.ROWS)
            rows.append(dict(shape=name, variant=label, m=m, ctas=ctas, us=per_call * 1e6,
                             tflops=2 * m * n * k / per_call / 1e12))
            del graph
            time.sleep(0.3)
    time.sleep(0.2)
    smi.terminate()
    samples = []
    for line in smi.stdout.read().splitlines():
        try:
            stamp, clock, power = [f.strip() for f in line.split(",")]
            samples.append((time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S"))
                            + float("0." + stamp.split(".")[1]), float(clock), float(power)))
        except ValueError:
            continue
    for row, (_, _, t0, t1) in zip(rows, spans):  # nvidia-smi's local-time stamps, read back by mktime
        inside = [(c, p) for s, c, p in samples if t0 + 0.3 <= s <= t1]
        row["clock_mhz"] = statistics.median(c for c, _ in inside) if inside else float("nan")
        row["power_w"] = statistics.median(p for _, p in inside) if inside else float("nan")
        row["samples"] = len(inside)
        print(f"{row['shape']:14s} M={row['m']} {row['variant']:9s} CTAs {row['ctas']:4d} {row['us']:8.1f} us {row['tflops']:6.0f} TFLOP/s  "
              f"SM clock {row['clock_mhz']:6.0f} MHz  power {row['power_w']:5.0f} W  ({row['samples']} samples)",
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm_clock.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
