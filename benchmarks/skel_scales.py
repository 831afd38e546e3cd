"""The wgmma kernel's skeleton (decode, wgmmas and x loads replaced) with and without its two 512-byte scale copies
per stage, at M = 32: do the small copies cap the weight stream? us per call (min of 2)."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import SHAPES
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
X = """        expect_tx(full, STAGE);
        tma2d(base, &tm, kt * 128, ml, full);
        tma2d(base + BM * 128, &tm, kt * 128 + 64, ml, full);"""
SC = """        bulk(base + XB + 8192, scales + ((size_t)rb0 * nkt + kt) * 512, 512, full);
        bulk(base + XB + 8192 + 512, scales + ((size_t)rb1 * nkt + kt) * 512, 512, full);"""

def variant(noscale):
    def src(bm):
        s = orig(bm)
        reps = [(DEC, NODEC), (MMA, NOMMA), (X, "        expect_tx(full, STAGE - XB%s);" % (" - 1024" if noscale else ""))]
        if noscale:
            reps.append((SC, ""))
        for a, b in reps:
            assert s.count(a) == 1
            s = s.replace(a, b)
        return s
    return src

gen = torch.Generator("cuda").manual_seed(0)
backend = backend_with(parse_table(FP4_GEMM_TILES))
print("shape M=32: shipped | skeleton | skeleton without scale copies (min of 2)", flush=True)
for name in ("llama.qkv", "llama.gate_up", "llama.down", "dsv3.expert.down"):
    n, k = SHAPES[name]
    res = {}
    for rep in range(2):
        for kind, src in (("shipped", orig), ("skel", variant(False)), ("noscale", variant(True))):
            cuda_wgmma.source = src
            res.setdefault(kind, []).append(time_fp4(backend, 32, n, k, gen) * 1e6)
    cuda_wgmma.source = orig
    print(f"{name:20s} " + " | ".join(f"{min(v):6.1f}" for v in res.values()), flush=True)
