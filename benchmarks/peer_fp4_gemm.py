"""pieceworks' NVFP4 GEMM (w4a16, the default `fp4_gemm.triton`) against a peer library's weight-only NVFP4
kernel (gemlite's `A16W4_NVFP`: Triton, `tl.dot_scaled` of bf16 x by e2m1 weights with e4m3 group-16 scales)
and bf16 cuBLAS, on the Llama-3.1-8B and DeepSeek-V3 expert shapes.

    python benchmarks/peer_fp4_gemm.py --ms 32,64,128,256,512,1024 --pdl on --out DIR [--gemlite-autotune fast]

gemlite is not a dependency: put its source on PYTHONPATH (`pip download gemlite`; pure Python + Triton).
Timing as fp4_gemm.py: CUDA-graph replays rotating over >= 400 MB of weight copies, median of 7, per call;
gemlite autotunes each (shape, M bucket) before its graph is captured. Each gemlite row is checked against
dequantize + bf16 matmul of the same codes and scales (both nibble orders tried; the better one is printed).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from common import SHAPES, add_pdl_option, configure_pdl, copies_for, graph_time, md_table, random_nvfp4, rel_err, time_bf16
from fp4_gemm import backend_with, check_once, time_fp4, weights_for

from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES
from pieceworks.quant import nvfp4


def reference(x, codes_packed, scales, gs, low_first: bool) -> torch.Tensor:
    """x @ dequant(W).T in float32, W's codes nibble-packed [N, K/2] (`low_first`: element 2i in the low nibble)."""
    lo, hi = codes_packed & 0xF, codes_packed >> 4
    codes = torch.stack((lo, hi) if low_first else (hi, lo), dim=-1).flatten(1)
    s = scales.float().repeat_interleave(16, 1) * gs
    wd = (nvfp4.e2m1_decode(codes) * s).to(torch.bfloat16)
    return (x @ wd.t()).float()


def gemlite_layers(n: int, k: int, gen, copies: int) -> list:
    from gemlite.helper import A16W4_NVFP

    out = []
    for _ in range(copies):
        w, s, gs = random_nvfp4(n, k, gen)
        layer = A16W4_NVFP(device="cuda", dtype=torch.bfloat16).from_packed_weights(w, scales=s, meta_scale=1.0 / gs)
        out.append((layer, w, s, gs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--ms", default="32,64,128,256,512,1024")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gemlite-autotune", default="fast", choices=("default", "fast", "max"))
    add_pdl_option(parser)
    args = parser.parse_args()
    configure_pdl(args)
    os.makedirs(args.out, exist_ok=True)
    import gemlite

    gemlite.set_autotune(args.gemlite_autotune)
    gen = torch.Generator("cuda").manual_seed(0)
    ours = backend_with(FP4_GEMM_TILES)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, gemlite {gemlite.__version__}",
          flush=True)
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        layers = gemlite_layers(n, k, gen, copies_for(n * k * 0.5625))
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            layer, w, s, gs = layers[0]
            y = layer(x).float()
            errs = {order: rel_err(y, reference(x, w, s, gs, order)) for order in (True, False)}
            err_ours = check_once(ours, x, weights_for(n, k, gen)[0], n)
            t_gl = graph_time(lambda i: layers[i % len(layers)][0](x), len(layers))
            t_ours = time_fp4(ours, m, n, k, gen)
            t_bf16 = time_bf16(m, n, k, gen)
            row = dict(shape=name, m=m, ours_us=t_ours * 1e6, gemlite_us=t_gl * 1e6, bf16_us=t_bf16 * 1e6,
                       gemlite_err=min(errs.values()), gemlite_low_nibble_first=errs[True] <= errs[False],
                       ours_err=err_ours)
            rows.append(row)
            print(f"{name:22s} M={m:5d} ours {row['ours_us']:8.1f} us  gemlite {row['gemlite_us']:8.1f} us  "
                  f"bf16 {row['bf16_us']:8.1f} us  err ours {err_ours:.1e} gemlite {row['gemlite_err']:.1e}",
                  flush=True)
        del layers
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "peer_gemm.json"), "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name(), autotune=args.gemlite_autotune), f, indent=1)
    md = md_table(["shape", "M", "ours us", "gemlite us", "bf16 us", "ours / bf16", "gemlite / bf16"],
                  [[r["shape"], r["m"], f"{r['ours_us']:.1f}", f"{r['gemlite_us']:.1f}", f"{r['bf16_us']:.1f}",
                    f"{r['bf16_us'] / r['ours_us']:.2f}x", f"{r['bf16_us'] / r['gemlite_us']:.2f}x"] for r in rows])
    with open(os.path.join(args.out, "peer_gemm.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
