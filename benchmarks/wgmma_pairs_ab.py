"""Consumer pairs in the wgmma GEMM: compile logs (registers, spills, serialized wgmmas), correctness of pairs=2
against pairs=1 and the reference on every launch form, then an A/B of the shipped table against tables with
consumer_pairs=2 in the 32- and 64-token buckets. us per call (fp4_gemm.py's graph timing)."""
import os, sys, json
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import SHAPES, time_bf16, random_nvfp4
from fp4_gemm import backend_with, check_once, time_fp4, weights_for
from pieceworks.backends import nvrtc
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

mode = sys.argv[1]
if mode == "compile":
    nvrtc._OPTIONS = ("-std=c++17", "--ptxas-options=-v")
    for bm in (32, 64):
        for sw, sp, sk in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1)):
            name = f"fp4_wgmma_tma<{bm}, {cuda_wgmma.max_stages(bm, 2)}, {sw}, {sp}, {sk}, 2>"
            _, _, text = nvrtc._compile(cuda_wgmma.source(bm), name, "sm_90a")
            lines = [l for l in text.splitlines() if "registers" in l or "spill" in l or "serialized" in l]
            print(name, "|", " / ".join(l.strip() for l in lines)[:400], flush=True)
    sys.exit(0)

if mode == "check":
    gen = torch.Generator("cuda").manual_seed(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    worst = 0.0
    for (n, k) in [(6144, 4096), (28672, 4096), (4096, 14336), (7168, 2048), (4096, 7168)]:
        weight, scale, gs = random_nvfp4(n, k, gen)
        for m in (17, 32, 45, 64, 100, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            for bm in (32, 64):
                if m > 2 * bm and bm == 32:
                    continue
                st2 = cuda_wgmma.max_stages(bm, 2)
                forms = [dict(), dict(swiglu=True), dict(split=2), dict(split=3, row_blocks=(3, 5))]
                ctas = min(sms, -(-m // bm) * -(-n // 128) * (k // 128))
                work = (torch.zeros(cuda_wgmma.workspace_floats(sms, bm), device="cuda"),
                        torch.zeros(4096, dtype=torch.int32, device="cuda"))
                forms.append(dict(stream_k=ctas, workspace=work))
                forms.append(dict(stream_k=ctas, workspace=work, swiglu=True))
                for f in forms:
                    a = cuda_wgmma.gemm(x, weight, scale, gs, n, k, bm, **f).float()
                    b = cuda_wgmma.gemm(x, weight, scale, gs, n, k, bm, st2, pairs=2, **f).float()
                    if f.get("split"):
                        a, b = a.sum(0), b.sum(0)
                    err = ((a - b).abs().max() / a.abs().max().clamp_min(1e-6)).item()
                    worst = max(worst, err)
                    if err > 2e-2 or not torch.isfinite(b).all():
                        print("MISMATCH", n, k, m, bm, {kk: v for kk, v in f.items() if kk != "workspace"}, err, flush=True)
                torch.cuda.synchronize()
        print("shape", n, k, "ok so far, worst rel diff", worst, flush=True)
    sys.exit(0)

# A/B
if mode == "stages":
    _ms = cuda_wgmma.max_stages
    cuda_wgmma.max_stages = lambda bm, pairs=1: (cuda_wgmma.MAX_SHARED - cuda_wgmma.reduce_bytes(bm, pairs)) // (cuda_wgmma.stage_bytes(bm) + 16) // pairs * pairs
    import pieceworks.backends.fp4_gemm.triton as _tb
variants = {}
base = [dict(t) for t in FP4_GEMM_TILES]
variants["shipped"] = base
p = [dict(t) for t in FP4_GEMM_TILES]
p[2].update(consumer_pairs=2, num_stages=8); p[3].update(consumer_pairs=2, num_stages=6)
if mode == "stages":
    p[2].update(consumer_pairs=1, num_stages=12); p[3].update(consumer_pairs=1, num_stages=9)
    q = [dict(t) for t in FP4_GEMM_TILES]
    q[2].update(num_stages=4); q[3].update(num_stages=4)
    variants["s4"] = q
variants["pairs"] = p
if len(sys.argv) > 3:
    c = [dict(t) for t in FP4_GEMM_TILES]
    c[3].update(num_stages=6)
    variants["st6"] = c
gen = torch.Generator("cuda").manual_seed(0)
backends = {k: backend_with(parse_table(v)) for k, v in variants.items()}
ms = [int(v) for v in sys.argv[2].split(",")]
print("shape M:", " | ".join(f"{k} us x2" for k in backends), "| bf16 us | errs", flush=True)
for name, (n, k) in SHAPES.items():
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = weights_for(n, k, gen)[0]
        errs = [check_once(b, x, w, n) for b in backends.values()]
        ts = {kk: [] for kk in backends}
        for _ in range(2):
            for kk, b in backends.items():
                ts[kk].append(time_fp4(b, m, n, k, gen) * 1e6)
        t16 = time_bf16(m, n, k, gen) * 1e6
        print(f"{name:20s} {m:4d}: " + " | ".join(f"{v[0]:6.1f} {v[1]:6.1f}" for v in ts.values())
              + f" | {t16:6.1f} | " + " ".join(f"{e:.1e}" for e in errs) + "  ("
              + " / ".join(f"{t16 / min(v):.2f}x" for v in ts.values()) + ")", flush=True)
