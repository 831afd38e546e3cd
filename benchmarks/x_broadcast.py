"""Does the CUDA decode GEMM pay for reading x? Each shape and M timed with x as usual and with x one row
broadcast to M rows (stride 0: every lane group reads the same address, so x costs L1 one wavefront per
load instead of up to 8); the same instructions and registers otherwise.

    python benchmarks/x_broadcast.py                      # graph timing, PDL on, cuda.plan's config (+8x2, 16x2 at M > 8)
    ncu --kernel-name regex:nvfp4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats python benchmarks/x_broadcast.py --ncu llama.gate_up,llama.qkv 8,16

Same timing as benchmarks/fp4_gemm.py (CUDA-graph replays rotating over >= 400 MB of weights, median of
7, per call). --ncu launches each case once (plan's config), for Nsight Compute. Needs a CUDA GPU.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import SHAPES, copies_for, graph_time, random_weights  # noqa: E402
from pieceworks.backends.fp4_gemm import cuda, cuda_decode, r16c64  # noqa: E402


def main() -> None:
    ncu = len(sys.argv) > 1 and sys.argv[1] == "--ncu"
    shapes = sys.argv[2].split(",") if ncu else list(SHAPES)
    ms = [int(v) for v in sys.argv[3].split(",")] if ncu else [1, 8, 9, 12, 16]
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in shapes:
        n, k = SHAPES[name]
        copies = 2 if ncu else copies_for(n * k * 0.5625)
        weights = [(*r16c64.repack_decode(w, s), gs) for w, s, gs in random_weights(n, k, copies, gen)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            xs = {"x": x, "broadcast": x[:1].expand(m, k)}
            cfgs = [cuda.plan(n, sms)] + ([(8, 2), (16, 2)] if m > 8 and not ncu else [])
            cells = []
            for kind, xx in xs.items():
                for warps, depth in dict.fromkeys(cfgs):
                    def call(i, xx=xx, warps=warps, depth=depth):
                        cuda_decode.decode_gemm(xx, *weights[i % copies], n, warps, depth, pdl=True)
                    if ncu:
                        call(0)
                        torch.cuda.synchronize()
                        continue
                    cells.append(f"{kind}/{warps}x{depth}={graph_time(call, copies) * 1e6:.2f}")
            if not ncu:
                print(f"{name} M={m}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
