"""A/B: the dequant path (M > 1024) in row chunks, dequantize of chunk c + 1 on a side stream under the matmul of
chunk c, against the shipped one-piece dequant + matmul. Alternated twice; us per call (graph timing)."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import SHAPES, time_bf16
from fp4_gemm import backend_with, check_once, time_fp4, weights_for
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

gen = torch.Generator("cuda").manual_seed(0)
variants = {"shipped": FP4_GEMM_TILES}
for c in [int(v) for v in sys.argv[2].split(",")]:
    variants[f"chunks{c}"] = [dict(t, dequant_chunks=c) if t["kind"] == "dequant" else dict(t) for t in FP4_GEMM_TILES]
backends = {k: backend_with(parse_table(v)) for k, v in variants.items()}
ms = [int(v) for v in sys.argv[1].split(",")]
print("shape M:", " | ".join(backends), "| bf16 | errs", flush=True)
for name, (n, k) in SHAPES.items():
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = weights_for(n, k, gen)[0]
        errs = [check_once(b, x, w, n) for b in backends.values()]
        ts = {kk: [] for kk in backends}
        for _ in range(2):
            for kk, b in backends.items():
                ts[kk].append(time_fp4(b, m, n, k, gen) * 1e6)
        t16 = time_bf16(m, n, k, gen) * 1e6
        print(f"{name:20s} {m:4d}: " + " | ".join(f"{v[0]:6.1f} {v[1]:6.1f}" for v in ts.values())
              + f" | {t16:6.1f} | " + " ".join(f"{e:.1e}" for e in errs) + "  ("
              + " / ".join(f"{t16 / min(v):.2f}x" for v in ts.values()) + ")", flush=True)
