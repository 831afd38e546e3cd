"""Probe (branch exp/wgmma-w4a16; runs against cuda_wgmma.py as of 25002f1, whose plain, swizzled and 256-row kernels the
branch head no longer has): where the wgmma GEMM's time goes (variants with the decode, the wgmmas or the x
copies left out) and the 256-row tile."""
import sys
sys.path.insert(0, "benchmarks")
import torch
from common import SHAPES, graph_time, time_bf16, rel_err
from fp4_gemm import weights_for
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.k32 import unpack_k32, unpack_scales_k32
from pieceworks.quant import nvfp4
gen = torch.Generator("cuda").manual_seed(0)
n, k = 6144, 4096
w, s, gs = weights_for(n, k, gen)[0]
wd = (nvfp4.e2m1_decode(unpack_k32(w, k, n)) * (unpack_scales_k32(s, n)[:, :k // 16].float() * gs).repeat_interleave(16, 1)).to(torch.bfloat16)
for m in (1, 100, 300):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    for bm, st in ((128, 4), (64, 6)):
        print("wide err", m, bm, rel_err(cuda_wgmma.gemm(x, w, s, gs, n, k, bm, st, variant="wide"), x.float() @ wd.float().t()))
for name, m in [("llama.gate_up", 2048), ("llama.gate_up", 512), ("llama.down", 2048), ("llama.down", 512), ("llama.o", 512), ("llama.qkv", 256), ("llama.gate_up", 256)]:
    n, k = SHAPES[name]
    ws = weights_for(n, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    line = f"{name} M={m} bf16 {time_bf16(m, n, k, gen)*1e6:.1f}"
    vs = [(256, 3, "1,0"), (256, 3, "1,2"), (256, 3, "1,3"), (256, 3, "1,4"), (128, 4, "wide"), (64, 6, "wide")]
    for bm, st, v in vs:
        t = graph_time(lambda i: cuda_wgmma.gemm(x, *ws[i % len(ws)], n, k, bm, st, variant=v), len(ws))
        line += f" | {bm}/{v}: {t*1e6:.1f}"
    print(line, flush=True)
