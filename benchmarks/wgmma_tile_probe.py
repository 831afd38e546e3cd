"""Probe: M between multiples of 256, the whole wgmma call with only 256-token tiles against only 128-token tiles; args: the M list."""
import sys, torch
sys.path.insert(0, "benchmarks")
from common import SHAPES, graph_time
import fp4_gemm as fb
from pieceworks.backends.fp4_gemm.triton import parse_table
gen = torch.Generator(device="cuda").manual_seed(0)
b256 = fb.backend_with(parse_table([dict(max_m=None, kind="wgmma", block_m=256, num_stages=3)]))
b128 = fb.backend_with(parse_table([dict(max_m=None, kind="wgmma", block_m=128, num_stages=5)]))
ms = [int(a) for a in sys.argv[1].split(",")]
for rnd in range(2):
    for name, (n, k) in SHAPES.items():
        ws = fb.weights_for(n, k, gen)
        row = []
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            t = [graph_time(lambda i: b.forward(x, *ws[i % len(ws)], ws[0][2], n), len(ws)) * 1e6 for b in (b256, b128)]
            row.append(f"{m}:{t[0]:.1f}/{t[1]:.1f}")
        print(f"r{rnd} {name:20s} 256/128 us " + "  ".join(row), flush=True)
