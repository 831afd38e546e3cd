"""The wgmma kernel of this tree against the one before it (.gpu/p3/cuda_wgmma_kernel_old.py), alternated in one
process: per call (through the backend, checked bit-equal first) at the given M, us, min of 2."""
import importlib.util, os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import SHAPES
from fp4_gemm import backend_with, time_fp4, weights_for
from pieceworks.backends import pdl
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.triton import parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

spec = importlib.util.spec_from_file_location("old_kernel", ".gpu/p3/cuda_wgmma_kernel_old.py")  # the parent commit's kernel file
old_mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(old_mod)
new, old = cuda_wgmma.source, old_mod.source
if __name__ == "__main__":
    pdl.configure("on", "cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    backend = backend_with(parse_table(FP4_GEMM_TILES))
    ms = [int(v) for v in sys.argv[1].split(",")]
    print("shape M | before | now   (us, min of 2, alternated)", flush=True)
    for name in SHAPES:
        n, k = SHAPES[name]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = weights_for(n, k, gen)[0]
            outs = []
            for src in (old, new):
                cuda_wgmma.source = src
                outs.append(backend.forward(x, w[0], w[1], w[2], w[2], n))
            same = torch.equal(outs[0], outs[1])
            res = {}
            for rep in range(2):
                for kind, src in (("old", old), ("new", new)):
                    cuda_wgmma.source = src
                    res.setdefault(kind, []).append(time_fp4(backend, m, n, k, gen) * 1e6)
            cuda_wgmma.source = new
            a, b = min(res["old"]), min(res["new"])
            print(f"{name:20s} {m:4d} | {a:6.1f} | {b:6.1f} ({a / b:.3f}x) bit-equal {same}", flush=True)
