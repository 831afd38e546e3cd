"""Where the wgmma kernel's K-tile time goes at M = 32 / 64: the shipped kernel against copies of it with the
decode replaced by a register move (nodec), with the wgmmas replaced by an xor of the A registers (nomma), and
both (neither). Results of the variants are wrong; only their time counts. us per call."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import SHAPES, time_bf16
from fp4_gemm import backend_with, time_fp4
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

orig = cuda_wgmma.source
DEC = "decode_q(a[q & 1], w0, w1, h0, h1);"
NODEC = "{ u32* aa = a[q & 1]; aa[0] = w0; aa[1] = w1; aa[2] = w0 ^ h0; aa[3] = w1 ^ h1; aa[4] = w0 + h1; aa[5] = w1 + h0; aa[6] = w0 - h0; aa[7] = w1 - h1; }"
MMA = """                wgmma_bm(acc, a[q & 1][0], a[q & 1][1], a[q & 1][2], a[q & 1][3],
                         desc(base + q * 32, 16, 1024) | (1ull << 62));
                wgmma_bm(acc, a[q & 1][4], a[q & 1][5], a[q & 1][6], a[q & 1][7],
                         desc(base + BM * 128 + q * 32, 16, 1024) | (1ull << 62));"""
NOMMA = """                acc[q] += __int_as_float((a[q & 1][0] ^ a[q & 1][1] ^ a[q & 1][2] ^ a[q & 1][3] ^ a[q & 1][4] ^ a[q & 1][5] ^ a[q & 1][6] ^ a[q & 1][7]) & 0x3FFFFF);"""

def variant(kind):
    def src(bm):
        s = orig(bm)
        assert DEC in s and MMA in s
        if kind in ("nodec", "neither", "neither_nox"):
            s = s.replace(DEC, NODEC)
        if "nox" in kind:
            a = """        expect_tx(full, STAGE);
        tma2d(base, &tm, kt * 128, ml, full);
        tma2d(base + BM * 128, &tm, kt * 128 + 64, ml, full);"""
            assert a in s
            s = s.replace(a, "        expect_tx(full, STAGE - XB);")
        if kind in ("nomma", "neither", "neither_nox"):
            s = s.replace(MMA, NOMMA)
        return s
    return src

gen = torch.Generator("cuda").manual_seed(0)
backend = backend_with(parse_table(FP4_GEMM_TILES))
kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["shipped", "nodec", "nomma", "neither"]
ms = [int(v) for v in sys.argv[1].split(",")]
print("shape M:", " | ".join(kinds), "| bf16", flush=True)
for name, (n, k) in SHAPES.items():
    for m in ms:
        ts = {}
        for rep in range(2):
            for kind in kinds:
                cuda_wgmma.source = orig if kind == "shipped" else variant(kind)
                ts.setdefault(kind, []).append(time_fp4(backend, m, n, k, gen) * 1e6)
        cuda_wgmma.source = orig
        t16 = time_bf16(m, n, k, gen) * 1e6
        print(f"{name:20s} {m:4d}: " + " | ".join(f"{min(v):6.1f}" for v in ts.values()) + f" | {t16:6.1f}", flush=True)
