"""graphs.py with `fp4_gemm.cuda`'s plan held at two chunks in flight (`--ring2`, the plan before the
eighteenth session) or as shipped (no flag): the end-to-end A/B of the deeper ring. Every other argument
is graphs.py's, e.g.

    python benchmarks/plan_ab.py --ring2 --quant nvfp4 --set cuda_graph.piecewise.enabled=off --extend '' \\
        --set backends.options.flashinfer.variant=fa2 --decode 1,8 --decode-sizes 1,8 --context 512 \\
        --set backends.fp4_gemm=cuda --out $OUT/ring2.md
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from pieceworks.backends.fp4_gemm import cuda

if "--ring2" in sys.argv:
    sys.argv.remove("--ring2")
    shipped = cuda.plan
    cuda.plan = lambda m, n_rows, sms, k=0: (shipped(m, n_rows, sms, k)[0], 2)
    print("plan: two chunks in flight everywhere", flush=True)
sys.argv[0] = str(Path(__file__).with_name("graphs.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
