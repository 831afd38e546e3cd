"""The `cuda` fp4_gemm backend at 17..64 rows: its wgmma kernel (cuda_wgmma.py) against its 16-row slices
of the decode kernel (`wgmma: false`), the Triton backend and bf16 (cuBLAS), on the Llama-3.1-8B and
DeepSeek-V3 expert shapes.

    python benchmarks/cuda_wgmma.py [--ms 17,24,32,48,64] [--shapes llama.qkv,...] [--pdl]

Same method as fp4_gemm.py: CUDA-graph replays of back-to-back `forward` calls rotating over >= 400 MB of
weight copies, median of 7 replays, us per call; every configuration is first checked against
dequantize + bf16 matmul (relative error < 1e-2). --pdl launches the calls with programmatic dependent
launch (runtime.pdl on), as the executor's graphs do. Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import SHAPES, copies_for, graph_time, time_bf16  # noqa: E402
from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm.base import Fp4Weight  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda import CudaDecodeOptions, CudaFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="17,24,32,48,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--pdl", action="store_true", help="runtime.pdl on (default off)")
    args = ap.parse_args()
    print("pdl:", pdl.configure("on" if args.pdl else "off", "cuda"), flush=True)
    spec = BackendSpec.for_device("cuda", fp4_numerics="w4a16")
    wgmma, slices = CudaFp4GemmBackend(spec), CudaFp4GemmBackend(spec, CudaDecodeOptions(wgmma=False))
    triton = TritonFp4GemmBackend(spec)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| shape | M | bf16 | triton | cuda slices | cuda wgmma | wgmma vs triton |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = copies_for(n * k * 0.5625)
        raw = []
        for _ in range(copies):
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
            s = (torch.rand(n, k // 16, device="cuda", generator=gen) * 2 + 0.05).to(torch.float8_e4m3fn)
            raw.append(Fp4Weight(w, s, torch.tensor(0.01, device="cuda"), torch.ones((), device="cuda")))
        cu = [wgmma.prepare(w) for w in raw]
        tr = [triton.prepare(w) for w in raw]
        wd = nvfp4.dequantize(raw[0].weight, raw[0].weight_scale, raw[0].weight_scale_2, torch.bfloat16)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = (x @ wd.t()).float()
            times = []
            for backend, ws in ((triton, tr), (slices, cu), (wgmma, cu)):
                err = float((backend.forward(x, *ws[0], n).float() - ref).norm() / ref.norm())
                if not err < 1e-2:
                    raise SystemExit(f"{name} M={m}: relative error {err:.3g}")
                times.append(graph_time(lambda i: backend.forward(x, *ws[i % copies], n), copies) * 1e6)
            bf16 = time_bf16(m, n, k, gen) * 1e6
            print(f"| {name} | {m} | {bf16:.1f} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | "
                  f"{times[2] / times[0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
