"""Experiment (branch exp/tiled): the decode GEMM reading weights stored tile by tile (each BLOCK_N x
BLOCK_K tile of units, and of scales, contiguous in memory) against the row-major k32 layout, same
kernel and plan otherwise. Checks that both give the same bits, then times them interleaved.

    python benchmarks/tiled_probe.py [--ms 1,16] [--swiglu]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import HBM, SHAPES, fp4_bytes, graph_time, weights_for  # noqa: E402

from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm import triton_kernels as tk  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend  # noqa: E402


def tile_major(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[N, C] -> the same elements with each (rows x cols) tile contiguous, tiles in (row block, col
    block) order."""
    n, c = t.shape
    return t.view(n // rows, rows, c // cols, cols).permute(0, 2, 1, 3).contiguous().view(n, c)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,16")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    pdl.configure("off", "cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    backend = TritonFp4GemmBackend(BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
    counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    for name, (n, k) in SHAPES.items():
        if name.startswith("dsv3"):
            continue
        plain = weights_for(n, k, gen)
        for m in [int(v) for v in args.ms.split(",")]:
            tile, split = backend._plan(m, n, k)
            bq, bg = tile.block_k // 4, tile.block_k // 32
            tiled = [(tile_major(w.view(torch.int16), tile.block_n, bq).view(torch.uint8),
                      tile_major(s.view(torch.int16), tile.block_n, bg).view(torch.float8_e4m3fn), g)
                     for w, s, g in plain]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            y0 = tk.fp4_gemm(x, *plain[0], n, k, tile, split, counters)
            y1 = tk.fp4_gemm(x, *tiled[0], n, k, tile, split, counters, tiled=True)
            same = torch.equal(y0, y1)
            times = {"rows": [], "tiled": []}
            for _ in range(args.rounds):
                for label, ws in (("rows", plain), ("tiled", tiled)):
                    times[label].append(graph_time(
                        lambda i: tk.fp4_gemm(x, *ws[i % len(ws)], n, k, tile, split, counters,
                                              tiled=label == "tiled"), len(ws)) * 1e6)
            frac = {lb: fp4_bytes(m, n, k) / (min(t) * 1e-6) / HBM for lb, t in times.items()}
            print(f"{name:14s} M={m:3d} {tile.block_m}x{tile.block_n}x{tile.block_k} split {split}: "
                  f"rows {' / '.join(f'{t:.1f}' for t in times['rows'])} us ({100 * frac['rows']:.0f}%), "
                  f"tiled {' / '.join(f'{t:.1f}' for t in times['tiled'])} us ({100 * frac['tiled']:.0f}%), "
                  f"same bits {same}", flush=True)


if __name__ == "__main__":
    main()
