"""A stage's shared-memory words (the 8 weight words and 2 scale pairs of a lane) loaded at the top of the stage
instead of before each k32 step q (asm volatile keeps them in program order, each after the last step's wgmma
fence): the shipped kernel and its skeleton (skel_parts.py), hoisted or not, through the backend; us per call,
alternated, min of 2; the hoisted kernel checked against dequantize + matmul first."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from common import SHAPES
from fp4_gemm import backend_with, time_fp4, weights_for, check_once
from pieceworks.backends import pdl
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES
import wgmma_skel_parts as sp

A = """            u32 sc0a, sc0b, sc1a, sc1b;
            lds64(sbase + r0 * 8, sc0a, sc0b);
            lds64(sbase + (r0 + 8) * 8, sc1a, sc1b);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 w0 = lds32(wbase + r0 * 64 + (q << 4) + 4 * t);
                const u32 w1 = lds32(wbase + (r0 + 8) * 64 + (q << 4) + 4 * t);"""
B = """            u32 sc0a, sc0b, sc1a, sc1b, ww0[4], ww1[4];
            lds64(sbase + r0 * 8, sc0a, sc0b);
            lds64(sbase + (r0 + 8) * 8, sc1a, sc1b);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                ww0[q] = lds32(wbase + r0 * 64 + (q << 4) + 4 * t);
                ww1[q] = lds32(wbase + (r0 + 8) * 64 + (q << 4) + 4 * t);
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const u32 w0 = ww0[q], w1 = ww1[q];"""


def hoisted(base):
    def src(bm):
        s = base(bm)
        assert s.count(A) == 1
        return s.replace(A, B)
    return src


pdl.configure("on", "cuda")
gen = torch.Generator("cuda").manual_seed(0)
backend = backend_with(parse_table(FP4_GEMM_TILES))
ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "32,64,128").split(",")]
kinds = (("shipped", sp.orig), ("hoisted", hoisted(sp.orig)), ("skeleton", sp.skel), ("skel hoisted", hoisted(sp.skel)))
print("shape M | " + " | ".join(k for k, _ in kinds) + "   (us, min of 2, alternated)", flush=True)
for name in SHAPES:
    n, k = SHAPES[name]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        cuda_wgmma.source = hoisted(sp.orig)
        err = check_once(backend, x, weights_for(n, k, gen)[0], n)
        assert err < 1e-2, (name, m, err)
        res = {}
        for rep in range(2):
            for kind, src in kinds:
                cuda_wgmma.source = src
                res.setdefault(kind, []).append(time_fp4(backend, m, n, k, gen) * 1e6)
        cuda_wgmma.source = sp.orig
        print(f"{name:20s} {m:4d} | " + " | ".join(f"{min(v):6.1f}" for v in res.values()) + f"   (err {err:.1e})", flush=True)
