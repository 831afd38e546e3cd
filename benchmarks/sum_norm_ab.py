"""o / down at M = 17..128 (wgmma, split over K): the split-K sum kernel + add_rms_norm (shipped) against one kernel
that sums the partials, adds the residual and normalizes. Bits compared; us per (GEMM + norm), min of 2, alternated."""
import os, sys
import torch, triton, triton.language as tl
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import graph_time
from fp4_gemm import backend_with, weights_for
from pieceworks.backends import pdl, pdl_kernels
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm import triton_kernels as tk
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES
from pieceworks.models import fused_kernels as fk
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors

@triton.jit
def _sum_add_rms_norm_kernel(part_ptr, numel, r_ptr, w_ptr, out_ptr, sum_ptr, H, eps, SPLIT_K: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_kernels.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    acc = tl.load(part_ptr + row * H + cols, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * numel + row * H + cols, mask=mask, other=0.0)
    x = acc.to(sum_ptr.dtype.element_ty).to(tl.float32)
    r = tl.load(r_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    s = (r + x).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * H + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rs = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    y = (sf * rs).to(s.dtype).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

def fused_call(backend, x, w, ws_, gs, n, k, res, normw, warps):
    M = x.shape[0]
    cfg = backend.plan(x, n, k)[0]
    bm, stages, split, (tail, _), ctas = cuda_wgmma.plan(M, n, k, cfg.block_m, cfg.num_stages, cfg.narrow_block_m,
                                                          multiprocessors(x.device))
    assert split > 1 and not tail and not ctas, (split, tail, ctas)
    part = cuda_wgmma.gemm(x, w, ws_, gs, n, k, bm, stages, split=split, row_blocks=(0, triton.cdiv(n, cuda_wgmma.ROWS)))
    s = torch.empty((M, n), dtype=x.dtype, device=x.device)
    out = torch.empty_like(s)
    use_pdl, launch = pdl.launch_options(x.device)
    _sum_add_rms_norm_kernel[(M,)](part, M * n, res, normw, out, s, n, 1e-5, SPLIT_K=split, BLOCK=triton.next_power_of_2(n),
                                   PDL=use_pdl, num_warps=warps, enable_fp_fusion=False, **launch)
    return out, s

if __name__ == "__main__":
    pdl.configure("on", "cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    backend = backend_with(parse_table(FP4_GEMM_TILES))
    for name, n, k in (("o", 4096, 4096), ("down", 4096, 14336)):
        ws = weights_for(n, k, gen)
        normw = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
        for m in [int(v) for v in sys.argv[1].split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
            cfg = backend.plan(x, n, k)[0]
            bm, stages, split, (tail, _), ctas = cuda_wgmma.plan(m, n, k, cfg.block_m, cfg.num_stages, cfg.narrow_block_m, 132)
            if not (split > 1 and not tail and not ctas):
                print(f"{name} M={m}: plan split {split} tail {tail} stream-K {ctas}: skipped", flush=True)
                continue
            def old(i):
                y = backend.forward(x, *ws[i % len(ws)], ws[0][2], n)
                return fk.add_rms_norm(y, res, normw, 1e-5)
            news = {wp: (lambda i, wp=wp: fused_call(backend, x, *ws[i % len(ws)], n, k, res, normw, wp)) for wp in (4, 8)}
            a = old(0); b = news[4](0); c = news[8](0)
            eq = all(torch.equal(u, v) for u, v in zip(a, b)) and all(torch.equal(u, v) for u, v in zip(a, c))
            t = {}
            for rep in range(2):
                for kind, f in (("old", old), ("w4", news[4]), ("w8", news[8])):
                    t.setdefault(kind, []).append(graph_time(f, len(ws)) * 1e6)
            o, n4, n8 = min(t["old"]), min(t["w4"]), min(t["w8"])
            print(f"{name} M={m} split {split}: shipped {o:.2f} | fused w4 {n4:.2f} ({o/n4:.3f}x) w8 {n8:.2f} ({o/n8:.3f}x) | bit-equal {eq}", flush=True)
