"""The CUDA decode GEMM on both weight layouts (r16c64 and the Triton backend's k32), for Nsight Compute.

    ncu --kernel-name regex:nvfp4_decode --launch-skip 4 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
        python benchmarks/ncu_decode_layouts.py llama.qkv 8

Arguments: a shape name of benchmarks/fp4_gemm.py and M. Calls the r16c64 kernel and then the k32 kernel
(each at `cuda.plan`'s warps, PDL off) on the same random weights, alternating, three times each, so
with --launch-skip 4 --launch-count 2 ncu profiles the third call of each. Needs a CUDA GPU.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import SHAPES  # noqa: E402
from pieceworks.backends.fp4_gemm import cuda_decode, k32, r16c64  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors, plan  # noqa: E402


def main() -> None:
    name, m = sys.argv[1], int(sys.argv[2])
    n, k = SHAPES[name]
    gen = torch.Generator("cuda").manual_seed(0)
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s = (torch.rand(n, k // 16, device="cuda", generator=gen) * 2 + 0.05).to(torch.float8_e4m3fn)
    gs = torch.tensor(0.01, device="cuda")
    rc, rs = r16c64.repack_decode(w, s)
    kc, ks = k32.repack_k32(w, s)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    sms = multiprocessors(x.device)
    for _ in range(3):
        cuda_decode.decode_gemm(x, rc, rs, gs, n, *plan(rc.shape[0] * 16, sms))
        cuda_decode.decode_gemm(x, kc, ks, gs, n, *plan(kc.shape[0], sms), layout="k32")
    torch.cuda.synchronize()
    print(name, "M =", m, "r16c64 / k32 at", plan(rc.shape[0] * 16, sms), plan(kc.shape[0], sms))


if __name__ == "__main__":
    main()
