"""forward_qkv_rope on wgmma calls split over K: the reduction applying the rope (this tree) against the
reduction + rope kernel (`_wgmma_splits_all` patched to False), per call through the backend, checked
bit-equal; us, alternated, min of 2. Llama-3.1-8B q/k/v (32 / 8 heads of 128)."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import graph_time
from fp4_gemm import backend_with, weights_for
from pieceworks.backends import pdl
from pieceworks.backends.fp4_gemm import triton_kernels as tk
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

fused = tk._wgmma_splits_all
if __name__ == "__main__":
    pdl.configure("on", "cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    backend = backend_with(parse_table(FP4_GEMM_TILES))
    n, k = 6144, 4096
    ws = weights_for(n, k, gen)
    print("M | reduce + rope kernel | rope in the reduction   (us, min of 2)", flush=True)
    for m in [int(v) for v in sys.argv[1].split(",")]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ang = torch.rand(m, 64, device="cuda", generator=gen) * 6
        cos, sin = ang.cos(), ang.sin()
        call = lambda i: backend.forward_qkv_rope(x, *ws[i % len(ws)][:3], ws[0][2], cos, sin, 32, 8, 128)
        used = fused(x, n, k, backend.plan(x, n, k)[0])
        outs = []
        for f in (lambda *a: False, fused):
            tk._wgmma_splits_all = f
            outs.append(call(0).clone())
        res = {}
        for rep in range(2):
            for kind, f in (("old", lambda *a: False), ("new", fused)):
                tk._wgmma_splits_all = f
                res.setdefault(kind, []).append(graph_time(call, len(ws)) * 1e6)
        tk._wgmma_splits_all = fused
        a, b = min(res["old"]), min(res["new"])
        print(f"{m:4d} | {a:6.1f} | {b:6.1f} ({a / b:.3f}x)  fused here: {used}, bit-equal {torch.equal(outs[0], outs[1])}",
              flush=True)
