"""PDL trigger experiments for the weight preload of `fp4_gemm.cuda` (`preload`): graphs.py with

  --early-enter               the short Triton kernels (norms, silu_mul, ...) let the next grid launch before
                              they wait for theirs (`pdl_kernels.EARLY_ENTER`), so a preloading GEMM after a
                              norm starts its weight copy during the GEMM before the norm;
  --attention-early-trigger   attention.triton's decode kernel lets the next grid (o_proj) launch as soon as
                              all its programs run (`triton_decode_kernel.EARLY_TRIGGER`), not after its
                              key loop, so o_proj's weight copy overlaps the whole attention;

  --gemm-early-trigger        the CUDA decode GEMMs let the next grid launch at their start, not after their
                              main loop (`cuda_decode.SOURCE` edited);

every other argument is graphs.py's. Correctness does not depend on where a kernel triggers: every kernel
waits (griddepcontrol.wait) before it reads what an earlier kernel wrote. Example:

    python benchmarks/preload_ab.py --early-enter --attention-early-trigger --quant nvfp4 \\
        --set cuda_graph.piecewise.enabled=off --extend '' --set backends.options.flashinfer.variant=fa2 \\
        --decode 1,8 --decode-sizes 1,8 --context 512 --set backends.fp4_gemm=cuda \\
        --set backends.options.cuda.preload=true --out $OUT/early.md
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import triton.language as tl

from pieceworks.backends import pdl_kernels
from pieceworks.backends.attention import triton_decode_kernel
from pieceworks.backends.fp4_gemm import cuda_decode

LATE_TRIGGER = "    PDL_TRIGGER();\n"
LOADS = "    // The weights are never written by an earlier kernel"


def early_trigger_source(source: str) -> str:
    """The decode GEMM's source with its one PDL trigger moved from after the main loop to its start."""
    if source.count(LATE_TRIGGER) != 1 or source.count(LOADS) != 1:
        raise RuntimeError("cuda_decode.SOURCE changed: its PDL trigger or first loads not found")
    return source.replace(LATE_TRIGGER, "").replace(LOADS, "    PDL_TRIGGER();\n" + LOADS)


def main() -> None:
    applied = []
    if "--early-enter" in sys.argv:
        sys.argv.remove("--early-enter")
        pdl_kernels.EARLY_ENTER = tl.constexpr(True)
        applied.append("short kernels trigger before their wait")
    if "--attention-early-trigger" in sys.argv:
        sys.argv.remove("--attention-early-trigger")
        triton_decode_kernel.EARLY_TRIGGER = tl.constexpr(True)
        applied.append("attention triggers at its start")
    if "--gemm-early-trigger" in sys.argv:
        sys.argv.remove("--gemm-early-trigger")
        cuda_decode.SOURCE = early_trigger_source(cuda_decode.SOURCE)
        applied.append("CUDA GEMMs trigger at their start")
    print(f"preload_ab: {', '.join(applied) or 'nothing changed'}", flush=True)
    sys.argv[0] = str(Path(__file__).with_name("graphs.py"))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
