"""Experiments for the fused norms of `fp4_gemm.cuda` (`fuse_norm`) under PDL: graphs.py with one or both of

  --consumers-without-pdl   the kernels that take a fused norm's input (q/k/v, gate/up) launched without PDL;
  --late-trigger            the kernels that add the residual (o, down; EPI 3 / 4) not letting their
                            dependents launch after the main loop (they launch when the grid exits);

every other argument is graphs.py's. The sixteenth session measured the fused norms slower than the unfused
step with PDL on (batch-1 replay 1.95-1.98 ms against 1.85-1.89) and faster with PDL off (1.883 against
1.902; docs/benchmarks.md). The guess both flags test: a GEMM that PDL launches behind another GEMM gets
its CTAs placed on the SMs as the first grid's CTAs leave, unevenly (the unfused step's norm kernel waits
for the GEMM before it and only then lets the next GEMM launch, on an empty machine). Example:

    python benchmarks/norm_pdl_ab.py --late-trigger --quant nvfp4 --set cuda_graph.piecewise.enabled=off \\
        --extend '' --set backends.options.flashinfer.variant=fa2 --decode 1,8 --decode-sizes 1,8 \\
        --context 512 --set backends.fp4_gemm=cuda --set backends.options.cuda.fuse_norm=true --out $OUT/late.md
"""

from __future__ import annotations

import inspect
import runpy
import sys
from pathlib import Path

from pieceworks.backends.fp4_gemm import cuda_decode

EARLY_TRIGGER = "    PDL_TRIGGER();\n"
launches = {"norm consumers launched without PDL": 0}
_decode_gemm = cuda_decode.decode_gemm
_signature = inspect.signature(_decode_gemm)


def decode_gemm(*args, **kwargs):
    """cuda_decode.decode_gemm, with pdl off where it takes a fused norm's input (`prenormed`)."""
    bound = _signature.bind(*args, **kwargs)
    if bound.arguments.get("prenormed") is not None:
        launches["norm consumers launched without PDL"] += 1
        bound.arguments["pdl"] = False
    return _decode_gemm(*bound.args, **bound.kwargs)


def late_trigger_source(source: str) -> str:
    """The kernel source with the decode GEMM's early trigger skipped in the residual epilogues."""
    if source.count(EARLY_TRIGGER) != 1:
        raise RuntimeError("cuda_decode.SOURCE changed: its one early PDL_TRIGGER() not found")
    return source.replace(EARLY_TRIGGER, "    if (EPI < 3) PDL_TRIGGER();\n")


def main() -> None:
    applied = []
    if "--consumers-without-pdl" in sys.argv:
        sys.argv.remove("--consumers-without-pdl")
        cuda_decode.decode_gemm = decode_gemm
        applied.append("consumers without PDL")
    if "--late-trigger" in sys.argv:
        sys.argv.remove("--late-trigger")
        cuda_decode.SOURCE = late_trigger_source(cuda_decode.SOURCE)
        applied.append("late trigger in the residual epilogues")
    print(f"norm_pdl_ab: {', '.join(applied) or 'nothing changed (give --consumers-without-pdl or --late-trigger)'}")
    sys.argv[0] = str(Path(__file__).with_name("graphs.py"))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        print(f"norm_pdl_ab: {launches}")


if __name__ == "__main__":
    main()
