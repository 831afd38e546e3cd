"""The wgmma kernel's skeleton (decode, wgmmas and x loads replaced, as wgmma_ablate.py of 63b95f4) and the shipped
kernel at M = 32 with 4, 8 and 12 stages: is the weight stream alone bound by the stages in flight? us per call."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import SHAPES
from fp4_gemm import backend_with, time_fp4
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

orig = cuda_wgmma.source
cuda_wgmma.max_stages = lambda bm: cuda_wgmma.MAX_SHARED // (cuda_wgmma.stage_bytes(bm) + 16)
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

def skeleton(bm):
    s = orig(bm)
    for a, b in ((DEC, NODEC), (MMA, NOMMA), (X, "        expect_tx(full, STAGE - XB);")):
        assert s.count(a) == 1
        s = s.replace(a, b)
    return s

gen = torch.Generator("cuda").manual_seed(0)
stages = (4, 8, 12)
backends = {}
for st in stages:
    t = [dict(x) for x in FP4_GEMM_TILES]
    t[2].update(num_stages=st)
    backends[st] = backend_with(parse_table(t))
print("shape M=32: shipped S=4/8/12 | skeleton S=4/8/12 (min of 2)", flush=True)
for name in ("llama.qkv", "llama.gate_up", "llama.down", "dsv3.expert.down"):
    n, k = SHAPES[name]
    res = {}
    for rep in range(2):
        for kind, src in (("shipped", orig), ("skeleton", skeleton)):
            cuda_wgmma.source = src
            for st in stages:
                res.setdefault((kind, st), []).append(time_fp4(backends[st], 32, n, k, gen) * 1e6)
    cuda_wgmma.source = orig
    print(f"{name:20s} " + " / ".join(f"{min(res[('shipped', s)]):6.1f}" for s in stages) + " | "
          + " / ".join(f"{min(res[('skeleton', s)]):6.1f}" for s in stages), flush=True)
