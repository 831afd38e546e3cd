"""Probe (branch exp/wgmma-w4a16, not on main): the wgmma w4a16 GEMM variants of cuda_wgmma.py against bf16 and
the shipped path. python benchmarks/wgmma_w4a16.py MS VARIANTS [SHAPES]; VARIANTS BMxSTAGESxSWZxOVL (OVL 2 = the
warp-specialized kernel). Results: docs/benchmarks.md on main, Tried and not adopted."""
import sys, os, time, json
sys.path.insert(0, "benchmarks")
import torch
from common import SHAPES, graph_time, time_bf16, rel_err, random_nvfp4
from fp4_gemm import weights_for, backend_with
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES
from pieceworks.backends.fp4_gemm import cuda_wgmma, triton_kernels
from pieceworks.backends.fp4_gemm.triton import TileConfig


def run(x, w, s, gs, n, k, bm, st, sz, ov):
    if ov in (6, 7):  # the "wgmma" tile kind as the backend calls it (split-K where the grid is small); 7: CTA pairs
        return triton_kernels.fp4_gemm(x, w, s, gs, n, k, TileConfig(kind="wgmma", block_m=bm, num_stages=st,
                                                                     cluster=ov - 5), 1)
    return cuda_wgmma.gemm(x, w, s, gs, n, k, bm, st, variant={2: "ws", 5: "tma"}.get(ov, f"{sz},{ov}"))
from pieceworks.backends.fp4_gemm.k32 import unpack_k32, unpack_scales_k32
from pieceworks.quant import nvfp4

gen = torch.Generator("cuda").manual_seed(0)
ms = [int(v) for v in sys.argv[1].split(",")]
variants = [tuple(int(a) for a in v.split("x")) for v in sys.argv[2].split(",")]
shapes = sys.argv[3].split(",") if len(sys.argv) > 3 else list(SHAPES)
backend = backend_with(parse_table(FP4_GEMM_TILES))
# correctness first
bad = 0
for name in shapes:
    n, k = SHAPES[name]
    w, s, gs = weights_for(n, k, gen)[0]
    codes = unpack_k32(w, k, n)
    sc = unpack_scales_k32(s, n)[:, : k // 16].float()
    wd = (nvfp4.e2m1_decode(codes) * (sc * gs).repeat_interleave(16, 1)).to(torch.bfloat16)
    for m in sorted(set(ms[:2] + [1, 200])):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = (x.float() @ wd.float().t())
        for bm, st, sz, ov in variants:
            y = run(x, w, s, gs, n, k, bm, st, sz, ov)
            e = rel_err(y, ref)
            if not e < 1e-2:
                bad += 1
                print(f"BAD {name} m={m} v={bm},{st},{sz},{ov} err={e:.3e}", flush=True)
    del wd
print("correctness: bad", bad, flush=True)
rows = []
for name in shapes:
    n, k = SHAPES[name]
    ws = weights_for(n, k, gen)
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        t_bf = time_bf16(m, n, k, gen)
        t_cur = graph_time(lambda i: backend.forward(x, *ws[i % len(ws)], ws[0][2], n), len(ws))
        line = f"{name:20s} M={m:5d} bf16 {t_bf*1e6:8.1f} cur {t_cur*1e6:8.1f} ({t_bf/t_cur:4.2f}x)"
        r = dict(shape=name, m=m, bf16=t_bf*1e6, cur=t_cur*1e6)
        for bm, st, sz, ov in variants:
            t = graph_time(lambda i: run(x, *ws[i % len(ws)], n, k, bm, st, sz, ov), len(ws))
            line += f" | {bm}x{st}x{sz}x{ov} {t*1e6:7.1f} ({t_bf/t:4.2f}x)"
            r[f"{bm}x{st}x{sz}x{ov}"] = t * 1e6
        rows.append(r)
        print(line, flush=True)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "wgmma.json"), "w"), indent=1)

# A tile table from these results: the shipped buckets up to 64 rows, then per range (tuning M) the fastest of
# the shipped bucket and the wgmma tiles by geometric mean over the shapes.
if os.environ.get("TABLE_OUT"):
    import math
    names = [f"{bm}x{st}x{sz}x{ov}" for bm, st, sz, ov in variants]
    table = [dict(b) for b in FP4_GEMM_TILES if b["max_m"] is not None and b["max_m"] <= 64]
    bounds = [(128, 128), (256, 256), (512, 512), (1024, 1024), (2048, None)]
    shipped = parse_table(FP4_GEMM_TILES)
    from pieceworks.backends.fp4_gemm.triton import select_tile
    import dataclasses
    for m_tune, max_m in bounds:
        rs = [r for r in rows if r["m"] == m_tune]
        if not rs:
            continue
        gm = {c: math.exp(sum(math.log(r[c]) for r in rs) / len(rs)) for c in ["cur"] + names}
        best = min(gm, key=gm.get)
        print(f"M {m_tune}: geomean us", {c: round(v, 1) for c, v in gm.items()}, "->", best, flush=True)
        if best == "cur":
            entry = {k: v for k, v in dataclasses.asdict(select_tile(shipped, m_tune)).items()}
        else:
            bm, st, _, ov = (int(v) for v in best.split("x"))
            entry = dict(kind="wgmma", block_m=bm, num_stages=st, cluster=ov - 5)
        entry["max_m"] = max_m
        table.append(entry)
    json.dump(table, open(os.environ["TABLE_OUT"], "w"), indent=1)
    print("table:", json.dumps(table), flush=True)
