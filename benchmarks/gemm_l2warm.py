"""Is the decode GEMM limited by HBM or inside the SMs? The shipped table's calls at M = 1 and 16 on the
shapes of benchmarks/fp4_gemm.py, weights rotated through 400 MB (cold, as that script times them)
against one weight called again and again (L2-resident where it fits in L2).

    python benchmarks/gemm_l2warm.py      (needs a CUDA GPU; run as a scratch script on 2026-12-01,
                                           docs/benchmarks.md, eleventh session)
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import torch
import fp4_gemm as fb
from pieceworks.backends.fp4_gemm.k32 import repack_k32  # noqa

gen = torch.Generator(device="cuda"); gen.manual_seed(0)
backend = fb.TritonFp4GemmBackend(fb.BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
for m in (1, 16):
    for name, (n, k) in fb.SHAPES.items():
        ws = fb.weights_for(n, k, gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        cold = fb.graph_time(lambda i: backend.forward(x, *ws[i % len(ws)], ws[0][2], n), len(ws))
        warm = fb.graph_time(lambda i: backend.forward(x, *ws[0], ws[0][2], n), 20)
        mb = fb.fp4_bytes(m, n, k) / 1e6
        print(f"M={m:3d} {name:22s} {mb:6.1f} MB  cold {cold*1e6:6.2f} us  L2-warm {warm*1e6:6.2f} us  "
              f"ratio {cold/warm:4.2f}", flush=True)
