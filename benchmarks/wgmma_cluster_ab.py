"""Cluster-summed K splits in the wgmma GEMM (SPLIT == 2) against float32 partials + the reduction kernel:
compile logs, how many clusters fit at once, bit equality, then an A/B of the shipped table against it with
cluster_split on. us per call (fp4_gemm.py's graph timing)."""
import ctypes, os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import SHAPES, time_bf16, random_nvfp4
from fp4_gemm import backend_with, check_once, time_fp4, weights_for
from pieceworks.backends import nvrtc
from pieceworks.backends.fp4_gemm import cuda_wgmma, triton_kernels
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

mode = sys.argv[1]
if mode in ("compile", "all"):
    opts = nvrtc._OPTIONS
    nvrtc._OPTIONS = ("-std=c++17", "--ptxas-options=-v")
    for bm in (32, 64, 128, 256):
        for sw in (0, 1):
            name = f"fp4_wgmma_tma<{bm}, {cuda_wgmma.max_stages(bm)}, {sw}, 2, 0>"
            _, _, text = nvrtc._compile(cuda_wgmma.source(bm), name, "sm_90a")
            lines = [l for l in text.splitlines() if "registers" in l or "spill" in l or "serialized" in l]
            print(name, "|", " / ".join(l.strip() for l in lines)[:300], flush=True)
    nvrtc._OPTIONS = opts
    # clusters that fit at once
    lib = ctypes.CDLL("libcuda.so.1")
    for bm in (32, 64, 128):
        st = cuda_wgmma.max_stages(bm)
        k = nvrtc.kernel(cuda_wgmma.source(bm), f"fp4_wgmma_tma<{bm}, {st}, 0, 2, 0>", torch.device("cuda"), suffix="a")
        shared = st * cuda_wgmma.stage_bytes(bm) + 16 * st
        lib.cuFuncSetAttribute(k._func, 8, ctypes.c_int(shared))
        for ns in (2, 3, 4):
            cfg = k._config((1, 1, ns), (384, 1, 1), False, shared, (1, 1, ns))
            n = ctypes.c_int()
            err = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), k._func, ctypes.byref(cfg))
            print(f"BM {bm} cluster {ns}: max active clusters {n.value} (err {err}) = {n.value * ns} CTAs", flush=True)

if mode in ("check", "all"):
    gen = torch.Generator("cuda").manual_seed(1)
    bad = 0
    for (n, k) in [(6144, 4096), (28672, 4096), (4096, 14336), (7168, 2048), (4096, 7168)]:
        weight, scale, gs = random_nvfp4(n, k, gen)
        blocks = -(-n // 128)
        for m in (17, 32, 45, 64, 100, 128, 200):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            for bm in (32, 64, 128):
                if m > 2 * bm and bm < 128:
                    continue
                for split in (2, 3, 4):
                    for sw in (False, True):
                        for rb in (None, (blocks - 5, 5)):
                            first = rb[0] if rb else 0
                            part = cuda_wgmma.gemm(x, weight, scale, gs, n, k, bm, split=split, row_blocks=rb)
                            cols = part.shape[-1]
                            ref = torch.empty((m, cols // 2 if sw else cols), dtype=torch.bfloat16, device="cuda")
                            triton_kernels._sum_splits(part, ref, sw)
                            out = torch.full((m, n // 2 if sw else n), float("nan"), dtype=torch.bfloat16, device="cuda")
                            cuda_wgmma.gemm(x, weight, scale, gs, n, k, bm, split=split, row_blocks=rb, swiglu=sw,
                                            out=out, cluster=True)
                            c0 = first * 128 // (2 if sw else 1)
                            got = out[:, c0:c0 + ref.shape[1]]
                            if not torch.equal(got, ref):
                                bad += 1
                                d = (got.float() - ref.float()).abs().max().item()
                                print("DIFF", n, k, m, bm, split, sw, rb, d, torch.isnan(got).sum().item(), flush=True)
        torch.cuda.synchronize()
        print("shape", n, k, "checked; differing so far", bad, flush=True)

if mode in ("ab", "all"):
    gen = torch.Generator("cuda").manual_seed(0)
    c = [dict(t, cluster_split=True) if t["kind"] == "wgmma" else dict(t) for t in FP4_GEMM_TILES]
    backends = {"shipped": backend_with(parse_table(FP4_GEMM_TILES)), "cluster": backend_with(parse_table(c))}
    ms = [int(v) for v in sys.argv[2].split(",")]
    print("shape M: shipped x2 | cluster x2 | bf16 | errs", flush=True)
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
