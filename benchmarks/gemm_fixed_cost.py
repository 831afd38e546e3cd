"""Where a decode GEMM's fixed time goes: the launch floor (empty and load/store Triton kernels in a
graph), and the M = 1 GEMM's time against K at N = 4096 and 28672 with the shipped plan and with each
K split count forced (the slope is the streaming rate, the intercept the fixed cost per call).

    python benchmarks/gemm_fixed_cost.py  (needs a CUDA GPU; run as a scratch script on 2026-12-01,
                                           docs/benchmarks.md, eleventh session)
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import torch, triton, triton.language as tl
import fp4_gemm as fb
from pieceworks.backends.fp4_gemm import triton_kernels
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors

@triton.jit
def _empty(p, n):
    pid = tl.program_id(0)
    if pid > n:
        tl.store(p, pid)

@triton.jit
def _touch(p, q, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(p + offs, mask=offs < n)
    tl.store(q + offs, v + 1, mask=offs < n)

buf = torch.zeros(1 << 20, device="cuda", dtype=torch.int32)
buf2 = torch.zeros(1 << 20, device="cuda", dtype=torch.int32)
for g in (1, 132, 264, 528):
    t = fb.graph_time(lambda i: _empty[(g,)](buf, 1 << 30, num_warps=4), 50)
    print(f"empty kernel grid {g}: {t*1e6:.2f} us per call", flush=True)
for n in (1024, 8192, 131072):
    t = fb.graph_time(lambda i: _touch[(triton.cdiv(n, 1024),)](buf, buf2, n, BLOCK=1024, num_warps=4), 50)
    print(f"load+store {n*4/1024:.0f} KB: {t*1e6:.2f} us per call", flush=True)
t = fb.graph_time(lambda i: buf2.copy_(buf), 50)
print(f"torch copy 4 MB: {t*1e6:.2f} us", flush=True)

gen = torch.Generator(device="cuda"); gen.manual_seed(0)
backend = fb.TritonFp4GemmBackend(fb.BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
sms = multiprocessors(torch.device("cuda"))
counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
for m in (1,):
    for n in (4096, 28672):
        for k in (512, 1024, 2048, 4096, 8192, 14336):
            ws = fb.weights_for(n, k, gen)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            kp = -(-k // 512) * 512
            tile, split = backend._plan(m, n, kp, sms)[:2]
            t = fb.graph_time(lambda i: backend.forward(x, *ws[i % len(ws)], ws[0][2], n), len(ws))
            res = []
            for s in (1, 2, 4, 8, 16):
                if s > kp // tile.block_k:
                    continue
                ts = fb.graph_time(lambda i: triton_kernels.fp4_gemm(x, ws[i % len(ws)][0], ws[i % len(ws)][1],
                                   ws[0][2], n, k, tile, s, counters), len(ws))
                res.append(f"s{s} {ts*1e6:.2f}")
            mb = fb.fp4_bytes(m, n, k) / 1e6
            print(f"N={n} K={k:5d} {mb:5.1f} MB plan split {split}: {t*1e6:6.2f} us ({mb/t/1e6/4.24:4.0%}) | "
                  + "  ".join(res), flush=True)
