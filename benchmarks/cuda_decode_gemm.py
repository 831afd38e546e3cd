"""The CUDA decode GEMM (backends/fp4_gemm/cuda_decode.py) per configuration, against the default
`fp4_gemm.triton` backend and bf16.

    python benchmarks/cuda_decode_gemm.py --out DIR --pdl --ms 1,8,16 --variants 8x2,16x2,2x2k,4x2k,8x2k,16x2k

Same method as fp4_gemm.py: CUDA-graph replays of back-to-back calls rotating over >= 400 MB of weight
copies, median of 7 replays, per call; both layouts made from the same random NVFP4 weights; every
configuration is checked against dequantize + bf16 matmul on each timed shape (ragged shapes and every M:
tests/gpu/test_cuda_fp4.py). Variants are WxD: warps per CTA x chunks in flight per lane on the r16c64 weights
(`fp4_gemm.cuda`); WxDk the same kernel on the Triton backend's k32 weights (`layout="k32"`: chunks of
128 elements, x loaded just before its chunk), which is what `fp4_gemm.triton` runs at M <= 16. --pdl
launches every call with programmatic dependent launch (as the decode step does), so a call's first
weight loads may start while the call before it ends. Prints one line per shape and M (every variant's
us, the best, its share of the copy rate and its speed-up over bf16) and writes DIR/cuda_decode_gemm.json.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re

import torch
from common import HBM, SHAPES, copies_for, fp4_bytes, graph_time, ints, random_nvfp4, rel_err, time_bf16

from pieceworks.backends.base import BackendSpec
from pieceworks.backends.fp4_gemm import cuda_decode, r16c64
from pieceworks.backends.fp4_gemm.base import Fp4Weight
from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend
from pieceworks.quant import nvfp4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--variants", default="2x2,4x2,8x2,16x2,32x2,8x1,16x1,8x3")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--pdl", action="store_true", help="launch the CUDA calls with PDL")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    variants = []
    for v in args.variants.split(","):
        found = re.fullmatch(r"(\d+)x(\d+)(k?)", v)
        if not found:
            raise SystemExit(f"variant {v!r}: expected WxD or WxDk")
        layout = "k32" if found[3] else "r16c64"
        variants.append((v, {"warps": int(found[1]), "depth": int(found[2]), "pdl": args.pdl, "layout": layout}))
    gen = torch.Generator(device="cuda").manual_seed(0)
    triton = TritonFp4GemmBackend(BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = copies_for(n * k * 0.5625)
        raw, tri, cud = [], [], []
        for _ in range(copies):
            w, s, gs = random_nvfp4(n, k, gen)
            if not raw:
                raw.append((w, s, gs))
            p = triton.prepare(Fp4Weight(w, s, gs, gs))
            tri.append((p.weight, p.weight_scale, p.weight_scale_2))
            cud.append((*r16c64.repack_decode(w, s), gs.float()))
        w, s, gs = raw[0]
        wd = (nvfp4.e2m1_decode(nvfp4.unpack(w)) * (s.float() * gs).repeat_interleave(16, 1)).to(torch.bfloat16)
        for m in ints(args.ms):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = x @ wd.t()
            row = {"shape": name, "m": m, "n": n, "k": k, "bytes": fp4_bytes(m, n, k)}
            y = triton.forward(x, tri[0][0], tri[0][1], tri[0][2], gs, n)
            row["triton_err"] = rel_err(y, ref)
            row["triton_us"] = graph_time(lambda i: triton.forward(x, *tri[i % copies], gs, n), copies) * 1e6
            row["bf16_ref_us"] = time_bf16(m, n, k, gen) * 1e6  # cuBLAS x @ W.t() (not an fp4 candidate)
            for v, kw in variants:
                key = f"cuda_{v}"
                ws = cud if kw["layout"] == "r16c64" else tri
                y = cuda_decode.decode_gemm(x, *ws[0], n, **kw)
                row[key + "_err"] = rel_err(y, ref)
                if not row[key + "_err"] < 1e-2:
                    print(f"{name} M={m} {key}: relative error {row[key + '_err']:.3g}", flush=True)
                    continue
                row[key + "_us"] = graph_time(
                    lambda i: cuda_decode.decode_gemm(x, *ws[i % copies], n, **kw), copies) * 1e6
            best = min((v, kk) for kk, v in row.items() if kk.endswith("_us") and kk != "bf16_ref_us")
            cells = " ".join(f"{kk[:-3]}={v:.1f}" for kk, v in row.items() if kk.endswith("_us"))
            print(f"{name} M={m}: {cells}  best {best[1][:-3]} {best[0]:.1f} us "
                  f"({row['bytes'] / (best[0] * 1e-6) / HBM:.0%} of copy, {row['bf16_ref_us'] / best[0]:.2f}x bf16)",
                  flush=True)
            rows.append(row)
    with open(os.path.join(args.out, "cuda_decode_gemm.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
