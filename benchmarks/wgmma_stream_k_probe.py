"""The wgmma GEMM's launch without stream-K (K splits and tail launches: `triton_kernels.fp4_gemm` without a
workspace) against the shipped plan (`cuda_wgmma.plan`, stream-K where `stream_k_ctas` picks it) and stream-K
forced on every call, per shape and M, in one process; each checked against dequantize + bf16 matmul, the
forced one for repeating its own bits and leaving the flags zero. H200 only (sm_90a).

    python benchmarks/wgmma_stream_k_probe.py [M,M,...] [shape,shape,...]   # writes $OUT/sk.json
"""
import sys, os, json
sys.path.insert(0, "benchmarks")
import torch
from common import SHAPES, graph_time, copies_for, random_nvfp4, rel_err, time_bf16
from pieceworks.backends import pdl
from pieceworks.backends.base import BackendSpec
from pieceworks.backends.fp4_gemm import cuda_wgmma as W
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend
from pieceworks.backends.fp4_gemm.k32 import unpack_k32, unpack_scales_k32
from pieceworks.quant import nvfp4

print("pdl", pdl.configure("on", "cuda"), flush=True)
gen = torch.Generator(device="cuda"); gen.manual_seed(0)
be = TritonFp4GemmBackend(BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
sms = multiprocessors(torch.device("cuda"))
work = torch.zeros(W.workspace_floats(sms, 256), device="cuda")
flags = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
MS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "32,64,128,256,288,416,512,640,768,1024").split(",")]
shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
rows = []
for name in shapes:
    n, k = SHAPES[name]
    ws = [random_nvfp4(n, k, gen) for _ in range(copies_for(n * k * 0.5625))]
    w0, s0, gs = ws[0]
    wd = (nvfp4.e2m1_decode(unpack_k32(w0, k, n)) * (unpack_scales_k32(s0, n)[:, :k // 16].float() * gs).repeat_interleave(16, 1)).to(torch.bfloat16)
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = (x @ wd.t()).float()
        tile, _ = be._plan(m, n, k)
        bm, st, split, tail, _ = W.plan(m, n, k, tile.block_m, tile.num_stages, tile.narrow_block_m, sms)
        gx, gy = -(-m // bm), -(-n // W.ROWS)
        T, nkt = gx * gy, k // 128
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        r = dict(shape=name, m=m, bm=bm, tiles=T, split=split, tail=tail)
        r["bf16"] = time_bf16(m, n, k, gen) * 1e6
        from pieceworks.backends.fp4_gemm import triton_kernels as TK
        r["cur_err"] = rel_err(TK.fp4_gemm(x, w0, s0, gs, n, k, tile, 1), ref)
        r["cur"] = graph_time(lambda i: TK.fp4_gemm(x, *ws[i % len(ws)], n, k, tile, 1), len(ws)) * 1e6
        r["new_err"] = rel_err(be.forward(x, w0, s0, gs, gs, n), ref)
        r["new"] = graph_time(lambda i: be.forward(x, *ws[i % len(ws)], gs, n), len(ws)) * 1e6
        r["policy"] = W.plan(m, n, k, tile.block_m, tile.num_stages, tile.narrow_block_m, sms)[4]
        def sk(i, G, bm=bm, st=st):
            w = ws[i % len(ws)]
            W.gemm(x, w[0], w[1], w[2], n, k, bm, st, out=out, stream_k=G, workspace=(work, flags))
        variants = {"sk": dict(G=sms)}
        for v, kw in variants.items():
            sk(0, **kw); torch.cuda.synchronize()
            e = rel_err(out, ref); a = out.clone(); sk(0, **kw); same = torch.equal(a, out)
            assert flags.abs().sum().item() == 0, "flags left set"
            r[v] = graph_time(lambda i: sk(i, **kw), len(ws)) * 1e6
            r[v + "_err"] = e; r[v + "_det"] = same
        rows.append(r)
        best = min((r[v], v) for v in ["cur", "new", *variants])
        print(f"{name:20s} M={m:5d} bm={bm} T={T:4d} split={split} tail={tail} bf16 {r['bf16']:7.1f} old {r['cur']:7.1f} new {r['new']:7.1f} (sk={r['policy']}, err {r['new_err']:.1e}) " +
              " ".join(f"{v} {r[v]:7.1f} (err {r[v+'_err']:.1e}{'' if r[v+'_det'] else ' NONDET'})" for v in variants) +
              f"  best {best[1]} x{r['bf16']/best[0]:.2f} (old x{r['bf16']/r['cur']:.2f} new x{r['bf16']/r['new']:.2f})", flush=True)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "sk.json"), "w"), indent=1)
