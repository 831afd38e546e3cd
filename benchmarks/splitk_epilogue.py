"""What the split-K epilogue of the Triton NVFP4 GEMM costs, per decode shape (M = 1 and 16):

    python benchmarks/splitk_epilogue.py [--pdl on|off]

Three launches of `_fp4_gemm_kernel` with the shipped tile and split count of each shape, timed as in
fp4_gemm.py (CUDA-graph replays of back-to-back calls over rotating weight copies): "shipped" (the
partials reduced in the kernel by the split that arrives last), "partials only" (every split stores
its float32 partial and nothing reduces it: not a usable result, the epilogue's lower bound) and
"no split" (one program per output tile over all of K). Needs a CUDA GPU and triton.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import SHAPES, graph_time, weights_for  # noqa: E402

from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.fp4_gemm import triton_kernels as tk  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import choose_split_k, parse_table, select_tile  # noqa: E402
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES  # noqa: E402


def partials_only(x, w, s, gs, n, k, cfg, split):
    m, kp = x.shape[0], w.shape[1] * 2
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    use_pdl, launch = pdl.launch_options(x.device)
    tk._fp4_gemm_kernel[(tiles, split)](
        x, w.view(torch.int16), s.view(torch.int16), gs, part, part, part,
        m, n, k, kp, x.stride(0), n, kp // cfg.block_k, split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SPLIT=True,
        FUSED_REDUCE=False, EVEN_K=k == kp, W_AS_A=cfg.w_as_a, USE_ASM=cfg.asm, ONE_DOT=cfg.one_dot,
        PDL=use_pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch)
    return part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pdl", default="off", choices=("auto", "on", "off"))
    args = parser.parse_args()
    pdl.configure(args.pdl, "cuda")
    table = parse_table(FP4_GEMM_TILES)
    gen = torch.Generator("cuda").manual_seed(0)
    counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    print("| shape | M | splits | shipped us | partials only us | no split us |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        ws = weights_for(n, k, gen)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            cfg = select_tile(table, m)
            split = choose_split_k(cfg, m, n, ws[0][0].shape[1] * 2)

            def shipped(i, sp=split):
                return tk.fp4_gemm(x, *ws[i % len(ws)], n, k, cfg, sp, counters)

            row = [f"{graph_time(shipped, len(ws)) * 1e6:.1f}"]
            if split > 1:
                row.append(f"{graph_time(lambda i: partials_only(x, *ws[i % len(ws)], n, k, cfg, split), len(ws)) * 1e6:.1f}")
            else:
                row.append("-")
            row.append(f"{graph_time(lambda i: shipped(i, 1), len(ws)) * 1e6:.1f}")
            print(f"| {name} | {m} | {split} | " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
