"""A benchmark script (graphs.py, timeline.py, ...) with attention.triton's decode kernel launched
differently under PDL:

  --attention-no-pdl        launched without PDL (it starts when the q/k/v GEMM has finished, and lets
                            the o GEMM launch only when it exits);
  --attention-late-trigger  launched with PDL, but letting the o GEMM launch only when it exits (not
                            before its merge);
  --attention-normal-launch launched without PDL (in stream order: it starts when the q/k/v GEMM has
                            finished; its PDL wait returns at once) but still letting the o GEMM launch
                            before its merge.

The eighteenth session's timeline (benchmarks/timeline.py, batch 1) showed the attention kernel adding
8.3 us per layer to the step with PDL on against 6.5 us with PDL off. Example:

    python benchmarks/attention_pdl_ab.py --attention-no-pdl benchmarks/graphs.py --quant nvfp4 \\
        --set cuda_graph.piecewise.enabled=off --extend '' --set backends.options.flashinfer.variant=fa2 \\
        --decode 1,8 --decode-sizes 1,8 --context 512 --set backends.fp4_gemm=cuda --out $OUT/nopdl.md
"""

from __future__ import annotations

import runpy
import sys
import types

from pieceworks.backends import pdl
from pieceworks.backends.attention import triton_decode_kernel as tdk

args = sys.argv[1:]
if "--attention-no-pdl" in args:
    args.remove("--attention-no-pdl")
    tdk.pdl = types.SimpleNamespace(launch_options=lambda device: (False, {}))
    print("attention.triton: launched without PDL", flush=True)
if "--attention-late-trigger" in args:
    args.remove("--attention-late-trigger")
    tdk.EARLY_TRIGGER = False
    print("attention.triton: no early trigger", flush=True)
if "--attention-normal-launch" in args:
    args.remove("--attention-normal-launch")
    tdk.pdl = types.SimpleNamespace(launch_options=lambda device: (pdl.enabled(device), {}))
    print("attention.triton: launched in stream order, early trigger kept", flush=True)
assert pdl.launch_options  # the shipped module stays as it is for every other kernel
sys.argv = args
runpy.run_path(args[0], run_name="__main__")
