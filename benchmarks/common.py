"""What the benchmark scripts share: the ceilings they report against, the GEMM shapes, random NVFP4
weights, CUDA-graph and wall-clock timing, the `--pdl` switch and markdown tables.

The scripts import it as `common` (Python puts a script's folder first on sys.path); importing it puts
the repository root on sys.path too, so `pieceworks` comes from this checkout without an install.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM = 4.24e12  # bytes/s: the device-to-device copy rate measured on the H200, the bandwidth ceiling quoted
ROTATE_BYTES = 400e6  # weight copies a timed graph rotates over: L2 (60 MB) never serves a weight twice
SHAPES = {  # name: (N, K) of the decode GEMMs of Llama-3.1-8B and of one DeepSeek-V3 expert
    "llama.qkv": (6144, 4096),
    "llama.o": (4096, 4096),
    "llama.gate_up": (28672, 4096),
    "llama.down": (4096, 14336),
    "dsv3.expert.gate_up": (4096, 7168),
    "dsv3.expert.down": (7168, 2048),
}


def copies_for(nbytes: float) -> int:
    """How many copies of an `nbytes` weight to rotate over (at least 2)."""
    return max(2, math.ceil(ROTATE_BYTES / nbytes))


def fp4_bytes(m: int, n: int, k: int) -> int:
    """Bytes an [m, k] x [n, k]^T NVFP4 GEMM moves: codes, e4m3 block scales, bf16 x in and y out."""
    return n * k // 2 + n * k // 16 + m * k * 2 + m * n * 2


def random_nvfp4(n: int, k: int, gen: torch.Generator):
    """(codes uint8 [n, k/2], block scales e4m3 [n, k/16], global scale float32 []) on the GPU: random
    bytes are random e2m1 codes in any layout; scales in [0.05, 2.05)."""
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s = (torch.rand(n, k // 16, device="cuda", generator=gen) * 2 + 0.05).to(torch.float8_e4m3fn)
    return w, s, torch.tensor(0.01, device="cuda")


def graph_time(call, n_calls: int, replays: int = 7) -> float:
    """Seconds per call: median over replays of a CUDA graph holding `n_calls` calls call(i)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(n_calls, 2)):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            call(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / n_calls)
    del graph
    return statistics.median(times)


def time_bf16(m: int, n: int, k: int, gen) -> float:
    """Seconds per cuBLAS `x @ W.t()` in bf16 (the baseline of the fp4 speed-ups), same rotation."""
    copies = copies_for(n * k * 2)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    return graph_time(lambda i: x @ ws[i % copies].t(), copies)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn, repeats: int, wait: bool = True, before=None) -> float:
    """Median wall-clock ms of fn() followed by a synchronize, after 3 warm-up calls; wait=False: the GPU
    drained before each call instead, so that only fn's host time counts; `before()` runs untimed (and
    drained) ahead of each timed call."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        sync()
        t0 = time.perf_counter()
        fn()
        if wait:
            sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def gpu_ms(fn, repeats: int) -> float:
    """Median ms between CUDA events around fn()'s work, queued behind a ~10 ms sleep kernel: the GPU time
    of fn with the host ahead of the GPU, i.e. without the part of fn's wall time that waits for the host."""
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)
        a.record()
        fn()
        b.record()
        sync()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64."""
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def ints(text: str) -> list[int]:
    """"1,8,16" -> [1, 8, 16] (empty items skipped)."""
    return [int(v) for v in text.split(",") if v]


def add_pdl_option(parser) -> None:
    parser.add_argument("--pdl", default="off", choices=("auto", "on", "off"),
                        help="programmatic dependent launch of the kernels (runtime.pdl; default off: each "
                             "call timed on its own, as the bf16 baseline)")


def configure_pdl(args) -> None:
    from pieceworks.backends import pdl

    print("pdl:", pdl.configure(args.pdl, "cuda"), flush=True)


def md_table(head: list[str], rows: list[list], align: str | None = None) -> str:
    """A markdown table; `align` has one letter per column, l or r (default: the first l, the rest r)."""
    align = align or "l" + "r" * (len(head) - 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
