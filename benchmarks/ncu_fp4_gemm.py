"""A few Triton NVFP4 GEMM calls of the shipped tile table, for Nsight Compute.

    ncu --kernel-name regex:fp4 --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python benchmarks/ncu_fp4_gemm.py llama.gate_up 1

Arguments: comma-separated shape names of benchmarks/fp4_gemm.py, M, optionally a JSON tile table. Each shape is called once on
each of 6 random weight copies (ncu locks the SM clock to base, 1.34 GHz on the H200, so its durations
run longer than benchmarks/fp4_gemm.py's). Needs a CUDA GPU and triton.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp4_gemm as fb  # noqa: E402

from pieceworks.backends.fp4_gemm.triton import parse_table  # noqa: E402
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES  # noqa: E402


def main() -> None:
    names, m = sys.argv[1].split(","), int(sys.argv[2])
    gen = torch.Generator("cuda").manual_seed(0)
    rows = FP4_GEMM_TILES
    if len(sys.argv) > 3:  # a JSON tile table (as benchmarks/fp4_gemm.py --table takes)
        import json

        with open(sys.argv[3]) as f:
            rows = json.load(f)
    backend = fb.backend_with(parse_table(rows))
    for name in names:
        n, k = fb.SHAPES[name]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        for w, s, gs in fb.random_weights(n, k, 6, gen):
            backend.forward(x, w, s, gs, gs, n)
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
