"""Probe: M = 288..640, the wgmma GEMM on x[M] against x zero-padded to a 256 multiple (preallocated, and padded by a copy in the call), with bf16 cuBLAS; args: the M list."""
import sys, torch
sys.path.insert(0, "benchmarks")
from common import SHAPES, graph_time, time_bf16
import fp4_gemm as fb
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES
from pieceworks.backends.fp4_gemm.triton import parse_table
gen = torch.Generator(device="cuda").manual_seed(0)
be = fb.backend_with(parse_table(FP4_GEMM_TILES))
ms = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [288, 320, 384, 448, 512, 640]
for rnd in range(2):
    for name, (n, k) in SHAPES.items():
        ws = fb.weights_for(n, k, gen)
        for m in ms:
            mp = -(-m // 256) * 256
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            xp = torch.zeros(mp, k, device="cuda", dtype=torch.bfloat16); xp[:m] = x
            t0 = graph_time(lambda i: be.forward(x, *ws[i % len(ws)], ws[0][2], n), len(ws))
            t1 = graph_time(lambda i: be.forward(xp, *ws[i % len(ws)], ws[0][2], n), len(ws))
            def padc(i):
                xp[:m].copy_(x)
                return be.forward(xp, *ws[i % len(ws)], ws[0][2], n)
            t2 = graph_time(padc, len(ws))
            tb = time_bf16(m, n, k, gen)
            print(f"r{rnd} {name:20s} M={m:4d} Mp={mp:4d} plain {t0*1e6:7.1f} padded {t1*1e6:7.1f} "
                  f"pad+copy {t2*1e6:7.1f} bf16 {tb*1e6:7.1f} us  x{tb/t0:4.2f} -> x{tb/t2:4.2f}", flush=True)
