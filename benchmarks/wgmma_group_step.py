"""graphs.py with the wgmma kernel of this tree ('new') or the one before it ('old')."""
import os, runpy, sys
sys.path.insert(0, os.path.join(os.getcwd(), ".gpu", "p3"))
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
kind = sys.argv.pop(1)
if kind == "old":
    import wgmma_group_ab as group_ab
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    cuda_wgmma.source = group_ab.old
print("wgmma kernel:", kind, flush=True)
sys.argv[0] = "benchmarks/graphs.py"
runpy.run_path("benchmarks/graphs.py", run_name="__main__")
