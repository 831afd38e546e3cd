"""A/B: the wgmma GEMM at M <= 64 with one CTA per SM (shipped) against two (ctas_per_sm=2: the plan sees
2 x SMs, stages cut to fit). Alternated twice; us per call (fp4_gemm.py's graph timing)."""
import contextlib, logging, os, sys, warnings
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
logging.basicConfig(level=logging.WARNING)
warnings.simplefilter("always")
from common import SHAPES, time_bf16
from fp4_gemm import backend_with, check_once, time_fp4, weights_for
from pieceworks.backends import nvrtc
nvrtc._OPTIONS = ("-std=c++17", "--ptxas-options=-v")
nvrtc.SERIALIZED_WGMMA = ""  # print every compile log
from pieceworks.backends.fp4_gemm import cuda_wgmma, triton_kernels
from pieceworks.backends.fp4_gemm import triton as tb
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

sms = torch.cuda.get_device_properties(0).multi_processor_count
orig_gemm, orig_mp_k, orig_mp_t = cuda_wgmma.gemm, triton_kernels.multiprocessors, tb.multiprocessors

def gemm2(x, weight, weight_scale, weight_scale_2, n, k, block_m=128, stages=None, **kw):
    if block_m <= 64:
        stages = min(stages or 8, cuda_wgmma.max_stages(block_m, 2))
        kw["ctas_per_sm"] = 2
    return orig_gemm(x, weight, weight_scale, weight_scale_2, n, k, block_m, stages, **kw)

@contextlib.contextmanager
def two_per_sm():
    cuda_wgmma.gemm, triton_kernels.multiprocessors, tb.multiprocessors = gemm2, (lambda d: 2 * sms), (lambda d: 2 * sms)
    try:
        yield
    finally:
        cuda_wgmma.gemm, triton_kernels.multiprocessors, tb.multiprocessors = orig_gemm, orig_mp_k, orig_mp_t

gen = torch.Generator("cuda").manual_seed(0)
A, B = backend_with(parse_table(FP4_GEMM_TILES)), backend_with(parse_table(FP4_GEMM_TILES))
ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [24, 32, 48, 64]
print("shape M: one CTA/SM us | two CTAs/SM us (x2 alternated) | bf16 us | err A, B")
for name, (n, k) in SHAPES.items():
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = weights_for(n, k, gen)[0]
        ea = check_once(A, x, w, n)
        with two_per_sm():
            eb = check_once(B, x, w, n)
        ta, tb_ = [], []
        for _ in range(2):
            ta.append(time_fp4(A, m, n, k, gen) * 1e6)
            with two_per_sm():
                tb_.append(time_fp4(B, m, n, k, gen) * 1e6)
        t16 = time_bf16(m, n, k, gen) * 1e6
        print(f"{name:20s} {m:4d}: {ta[0]:6.1f} {ta[1]:6.1f} | {tb_[0]:6.1f} {tb_[1]:6.1f} | {t16:6.1f} | {ea:.1e} {eb:.1e}"
              f"  ({t16 / min(ta):.2f}x / {t16 / min(tb_):.2f}x)", flush=True)
