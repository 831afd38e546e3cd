"""Where the M = 32 wgmma call's time goes beyond a bare weight stream: the shipped kernel and its skeleton
(decode, wgmmas, x loads replaced, as skel_scales.py) timed through the backend (GEMM + split-K reduction)
and as the GEMM launch alone (the plan's tile, stages and splits), PDL on and off. us per call, min of 2."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from common import SHAPES, graph_time
from fp4_gemm import backend_with, time_fp4, weights_for
from pieceworks.backends import pdl
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


def skel(bm):
    s = orig(bm)
    for a, b in ((DEC, NODEC), (MMA, NOMMA), (X, "        expect_tx(full, STAGE - XB);")):
        assert s.count(a) == 1
        s = s.replace(a, b)
    return s


if __name__ == "__main__":
    gen = torch.Generator("cuda").manual_seed(0)
    backend = backend_with(parse_table(FP4_GEMM_TILES))
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    print(f"M = {M}: backend call (GEMM + reduction) | GEMM launch alone, PDL on | alone, PDL off   (us, min of 2)")
    for name in ("llama.qkv", "llama.o", "llama.down", "dsv3.expert.gate_up", "dsv3.expert.down"):
        n, k = SHAPES[name]
        ws = weights_for(n, k, gen)
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        bm, st, split, tail, sk = cuda_wgmma.plan(M, n, k, 64, 8)
        part = torch.empty(split, M, n, dtype=torch.float32, device="cuda") if split > 1 else None
        row = []
        for kind, src in (("shipped", orig), ("skeleton", skel)):
            cuda_wgmma.source = src
            res = {"call": [], "on": [], "off": []}
            for rep in range(2):
                pdl.configure("on", "cuda")
                res["call"].append(time_fp4(backend, M, n, k, gen) * 1e6)
                for mode in ("on", "off"):
                    pdl.configure(mode, "cuda")
                    res[mode].append(graph_time(lambda i: cuda_wgmma.gemm(
                        x, ws[i % len(ws)][0], ws[i % len(ws)][1], ws[0][2], n, k, block_m=bm, stages=st, split=split,
                        out=part), len(ws)) * 1e6)
            row.append(f"{kind} {min(res['call']):5.1f} | {min(res['on']):5.1f} | {min(res['off']):5.1f}")
        cuda_wgmma.source = orig
        print(f"{name:20s} (tile {bm}, {st} stages, split {split}, {-(-n // 128) * split} CTAs): " + " || ".join(row), flush=True)
