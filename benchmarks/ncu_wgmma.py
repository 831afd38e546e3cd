"""The default NVFP4 GEMM backend called a few times on one shape at one M, for Nsight Compute on its wgmma
kernel (M = 17..1024 on sm_90):

    ncu --kernel-name regex:fp4_wgmma --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section LaunchStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \
        python benchmarks/ncu_wgmma.py llama.gate_up 32

Arguments: a shape name of benchmarks/common.py's SHAPES and M. Random k32 weights, the shipped tile table, PDL
as configured (off). Prints the plan (tile, K splits). Nsight Compute runs the SM at its base clock (1.35 GHz on
the H200), so its durations are longer than fp4_gemm.py's. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch
from common import SHAPES, random_nvfp4
from fp4_gemm import backend_with

from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("m", type=int)
    args = parser.parse_args()
    name, m = args.shape, args.m
    n, k = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(0)
    w, s, gs = random_nvfp4(n, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    backend = backend_with(parse_table(FP4_GEMM_TILES))
    for _ in range(4):
        backend.forward(x, w, s, gs, gs, n)
    torch.cuda.synchronize()
    print(name, "M =", m, backend.plan(x, n, k))


if __name__ == "__main__":
    main()
