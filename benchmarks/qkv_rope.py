"""The rope fused into the NVFP4 q/k/v GEMM (Triton backend) against the GEMM followed by the rope kernel:

    python benchmarks/qkv_rope.py            # Llama-3.1-8B's qkv (4096 -> 32 q + 8 kv heads of 128)

Per M: "GEMM + rope_qk" (the model's path before: the GEMM, then `pieceworks::rope_qk` out of place,
rotate-half), "GEMM only", and `forward_qkv_rope` (8-row tiles: rope in the GEMM's epilogue; larger
tiles: the GEMM, then the rope kernel in place in its interleaved mode); then the rope kernel alone in
its four modes (rotate-half / interleaved, out of place / in place). Timed as fp4_gemm.py times (CUDA
graph replays of back-to-back calls over rotating weight copies; here 24 copies, 350 MB). Needs a CUDA
GPU and triton; correctness is tests/gpu/test_triton_fp4.py's (`-k rope`: same bits as GEMM + rope_qk).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import graph_time, random_weights  # noqa: E402

from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm.base import Fp4Weight  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend  # noqa: E402
from pieceworks.models import fused, fused_kernels  # noqa: E402

HQ, HKV, D, K = 32, 8, 128, 4096
N = (HQ + 2 * HKV) * D


def main() -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    backend = TritonFp4GemmBackend(BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
    ws = [backend.prepare_qkv_rope(Fp4Weight(w, s, g, g), HQ, HKV, D) for w, s, g in random_weights(N, K, 24, gen)]
    print("| M | GEMM + rope_qk us | GEMM only us | forward_qkv_rope us |\n|---:|---:|---:|---:|")
    for m in (1, 8, 16, 32, 64):
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        cos, sin = (torch.rand(m, D // 2, device="cuda", generator=gen) for _ in range(2))

        def gemm(i):
            return backend.forward(x, *ws[i % len(ws)], N)

        def gemm_rope(i):
            y = gemm(i)
            return fused.rope_qk(y[:, : HQ * D].view(m, HQ, D), y[:, HQ * D : (HQ + HKV) * D].view(m, HKV, D),
                                 cos, sin, False)

        def fused_call(i):
            return backend.forward_qkv_rope(x, *ws[i % len(ws)], cos, sin, HQ, HKV, D)

        times = [graph_time(f, len(ws)) * 1e6 for f in (gemm_rope, gemm, fused_call)]
        print(f"| {m} | " + " | ".join(f"{t:.2f}" for t in times) + " |", flush=True)

    print("\n| M | rotate-half | rotate-half in place | interleaved | interleaved in place |\n|---:|---:|---:|---:|---:|")
    for m in (1, 16, 64):
        ys = [torch.randn(m, N, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(64)]
        cos, sin = (torch.rand(m, D // 2, device="cuda", generator=gen) for _ in range(2))
        row = []
        for interleaved in (False, True):
            for in_place in (False, True):
                def call(i, inter=interleaved, inplace=in_place):
                    y = ys[i % len(ys)]
                    return fused_kernels.rope_qk(y[:, : HQ * D].view(m, HQ, D), y[:, HQ * D : (HQ + HKV) * D].view(m, HKV, D),
                                                 cos, sin, inter, in_place=inplace)

                row.append(graph_time(call, len(ys)) * 1e6)
        print(f"| {m} | " + " | ".join(f"{t:.2f}" for t in row) + " |", flush=True)


if __name__ == "__main__":
    main()
