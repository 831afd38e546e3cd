"""Time to get the CUDA decode GEMM's kernels of a Llama-3.1-8B-shaped decode step ready, NVRTC against the
on-disk cubin cache (backends/nvrtc.py).

    python benchmarks/nvrtc_cache.py --cache-dir DIR     # run it twice: compile, then load

Gets the three k32 instances `fp4_gemm.triton` launches at batch 1 (q/k/v with rope, o and down, gate/up
with SwiGLU, at `cuda_launch.plan`'s warps for the H200) and prints the seconds each took and whether the cache
held it before. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import time

import common  # noqa: F401  (puts the repository root on sys.path)
import torch

from pieceworks.backends import nvrtc
from pieceworks.backends.fp4_gemm.cuda_decode_kernel import SOURCE

INSTANCES = {  # name: template instance (W, D, NT, EPI, NORM, MOE, MINB, L)
    "qkv + rope": "nvfp4_decode_gemm<8, 2, 1, 2, 0, 0, 0, 1>",
    "o, down": "nvfp4_decode_gemm<16, 2, 1, 0, 0, 0, 0, 1>",
    "gate_up + swiglu": "nvfp4_decode_gemm<2, 2, 1, 1, 0, 0, 0, 1>",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", help="the kernel cache directory (as <runtime.cache_dir>/nvrtc; default: "
                    "the default cache_dir's)")
    args = ap.parse_args()
    if args.cache_dir:
        nvrtc.configure_cache(args.cache_dir)
    where = nvrtc.cache_dir()
    print(f"cache: {where}", flush=True)
    before = set(os.listdir(where)) if where and where.is_dir() else set()
    device = torch.device("cuda")
    torch.cuda.init()
    total = 0.0
    for what, name in INSTANCES.items():
        t0 = time.perf_counter()
        nvrtc.kernel(SOURCE, name, device)
        dt = time.perf_counter() - t0
        total += dt
        print(f"{what:18s} {name}: {dt:.3f} s", flush=True)
    after = set(os.listdir(where)) if where and where.is_dir() else set()
    print(f"total {total:.3f} s; cache files before {len(before)}, added {len(after - before)}")


if __name__ == "__main__":
    main()
