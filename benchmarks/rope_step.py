"""graphs.py with the rope in the wgmma reduction ('new') or the reduction + rope kernel ('old')."""
import os, runpy, sys
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
kind = sys.argv.pop(1)
if kind == "old":
    from pieceworks.backends.fp4_gemm import triton_kernels
    triton_kernels._wgmma_splits_all = lambda *a: False
print("rope:", kind, flush=True)
sys.argv[0] = "benchmarks/graphs.py"
runpy.run_path("benchmarks/graphs.py", run_name="__main__")
