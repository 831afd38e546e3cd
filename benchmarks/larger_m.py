"""The `cuda` fp4_gemm backend above its decode rows (M > 16): the Triton GEMM on its r16c64 weights
(`larger_m: triton`, the default) against the Triton backend on its k32 weights, 16-row slices of the
CUDA decode kernel (`decode_max_m: 64`) and dequantize + matmul (`larger_m: dequant`).

    python benchmarks/larger_m.py --out DIR [--ms 17,24,32,48,64,128,256] [--shapes llama.qkv,...] [--pdl]
                                  [--tables shipped,bn128]

--tables: the r16c64 tile tables to time (`larger_tiles`): "shipped" (triton_tiles.R16C64_TILES), "bnN"
(the shipped table with block_n N in every fused bucket), or a JSON file's path.

Same method as fp4_gemm.py: CUDA-graph replays of back-to-back `forward` calls rotating over >= 400 MB of
weight copies, median of 7 replays, per call; both layouts made from the same random NVFP4 weights. Each
configuration is first checked against dequantize + bf16 matmul (relative error), and the first r16c64
output is compared bit for bit with the k32 one (equal only where both run the same K order). --pdl
launches the calls with programmatic dependent launch, as the executor's graphs do. Needs a CUDA GPU and
triton.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import HBM, SHAPES, copies_for, fp4_bytes, graph_time  # noqa: E402
from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm.base import Fp4Weight  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda import CudaDecodeOptions, CudaFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.triton_tiles import R16C64_TILES  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="17,24,32,48,64,128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--pdl", action="store_true", help="launch the calls with PDL (runtime.pdl on; default off)")
    ap.add_argument("--tables", default="shipped")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ms = [int(m) for m in args.ms.split(",")]
    spec = BackendSpec.for_device("cuda", fp4_numerics="w4a16")
    backends = {"triton.k32": TritonFp4GemmBackend(spec)}
    for table in args.tables.split(","):
        path = None
        if re.fullmatch(r"bn\d+", table):
            rows = [dict(r, block_n=int(table[2:])) if r["kind"] == "fused" else r for r in R16C64_TILES]
            path = os.path.join(args.out, f"r16c64_{table}.json")
            with open(path, "w") as f:
                json.dump(rows, f)
        elif table != "shipped":
            path = table
        backends[f"cuda.triton.{table}" if table != "shipped" else "cuda.triton"] = CudaFp4GemmBackend(
            spec, CudaDecodeOptions(larger_tiles=path))
    backends["cuda.slices"] = CudaFp4GemmBackend(spec, CudaDecodeOptions(decode_max_m=64))
    backends["cuda.dequant"] = CudaFp4GemmBackend(spec, CudaDecodeOptions(larger_m="dequant"))
    first_r16 = next(label for label in backends if label.startswith("cuda.triton"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print("pdl:", pdl.configure("on" if args.pdl else "off", "cuda"), flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = copies_for(n * k * 0.5625)
        raw = []
        for _ in range(copies):
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
            s = (torch.rand(n, k // 16, device="cuda", generator=gen) * 2 + 0.05).to(torch.float8_e4m3fn)
            raw.append(Fp4Weight(w, s, torch.tensor(0.01, device="cuda"), torch.ones((), device="cuda")))
        prepared = {"k32": [backends["triton.k32"].prepare(w) for w in raw],
                    "r16c64": [backends["cuda.triton"].prepare(w) for w in raw]}
        ref_w = nvfp4.dequantize(raw[0].weight, raw[0].weight_scale, raw[0].weight_scale_2, torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = (x @ ref_w.t()).float()
            row = {"shape": name, "m": m, "n": n, "k": k}
            outs = {}
            for label, backend in backends.items():
                if label == "cuda.slices" and m > 64:
                    continue
                ws = prepared["k32" if label == "triton.k32" else "r16c64"]
                y = backend.forward(x, *ws[0], n)
                torch.cuda.synchronize()
                outs[label] = y
                err = float((y.float() - ref).norm() / ref.norm())
                us = graph_time(lambda i: backend.forward(x, *ws[i % copies], n), copies * 2) * 1e6
                row[label] = {"us": round(us, 2), "rel_err": err,
                              "hbm": round(fp4_bytes(m, n, k) / (us * 1e-6) / HBM, 3)}
            row["r16c64_bits_equal_k32"] = bool(torch.equal(outs[first_r16], outs["triton.k32"]))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "larger_m.json"), "w") as f:
        json.dump(rows, f, indent=1)
    labels = list(backends)
    lines = ["| shape | M | " + " | ".join(labels) + " | r16c64 = k32 bits |",
             "|---|---:|" + "---:|" * len(labels) + "---|"]
    for r in rows:
        cells = [f"{r[lb]['us']:.1f}" if lb in r else "-" for lb in labels]
        lines.append(f"| {r['shape']} | {r['m']} | " + " | ".join(cells) + f" | {r['r16c64_bits_equal_k32']} |")
    with open(os.path.join(args.out, "larger_m.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
