"""A benchmark script (graphs.py, timeline.py, ...) with kernels launched differently under PDL than the
library launches them, to measure the library's choices against the alternatives:

  --attention-pdl-launch    attention.triton's decode kernel launched with PDL, early behind the q/k/v GEMM
                            (the library launches it in stream order; its trigger still lets the o GEMM
                            launch before its merge);
  --attention-no-pdl        attention.triton launched in stream order and without its trigger;
  --attention-late-trigger  attention.triton launched with PDL but without its early trigger (the o GEMM
                            launches when it exits);
  --norm-weight-after-wait  the RMSNorm kernels load their weight after the PDL wait, not before it.

Every other kernel launches as the library launches it. Example:

    python benchmarks/pdl_ab.py --attention-pdl-launch benchmarks/graphs.py --quant nvfp4 \\
        --set cuda_graph.piecewise.enabled=off --extend '' --set backends.options.flashinfer.variant=fa2 \\
        --decode 1,8 --decode-sizes 1,8 --context 512 --out $OUT/pdl.md
"""

from __future__ import annotations

import runpy
import sys
import types

import common  # noqa: F401  (puts the repository root on sys.path)

args = sys.argv[1:]
if not args or args[0] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0 if args else 2)

from pieceworks.backends.attention import triton_decode_kernel as tdk  # noqa: E402  (imports triton)
from pieceworks.models import fused_kernels  # noqa: E402

if "--attention-pdl-launch" in args:
    args.remove("--attention-pdl-launch")
    tdk.PDL_LAUNCH = True
    print("attention.triton: launched with PDL", flush=True)
if "--attention-no-pdl" in args:
    args.remove("--attention-no-pdl")
    tdk.pdl = types.SimpleNamespace(launch_options=lambda device, early=True: (False, {}))
    print("attention.triton: launched without PDL, no trigger", flush=True)
if "--attention-late-trigger" in args:
    args.remove("--attention-late-trigger")
    tdk.PDL_LAUNCH, tdk.EARLY_TRIGGER = True, False
    print("attention.triton: launched with PDL, no early trigger", flush=True)
if "--norm-weight-after-wait" in args:
    args.remove("--norm-weight-after-wait")
    fused_kernels.NORM_WEIGHT_EARLY = False
    print("norm kernels: weight loaded after the PDL wait", flush=True)
sys.argv = args
runpy.run_path(args[0], run_name="__main__")
