"""An experiment for the fused norms of `fp4_gemm.cuda` (`fuse_norm`): graphs.py with the kernels that take a
fused norm's input (q/k/v, gate/up) launched without PDL, everything else as configured.

The sixteenth session measured the fused norms slower than the unfused step with PDL on (batch-1 replay
1.95-1.98 ms against 1.85-1.89) and faster with PDL off (1.883 against 1.902; docs/benchmarks.md). One
guess: a GEMM that PDL launches early behind another GEMM gets its CTAs placed unevenly as the first
grid's CTAs leave. Launching those GEMMs without PDL tests it. Same arguments as graphs.py:

    python benchmarks/norm_pdl_ab.py --quant nvfp4 --set cuda_graph.piecewise.enabled=off --extend '' \\
        --set backends.options.flashinfer.variant=fa2 --decode 1,8 --decode-sizes 1,8 --context 512 \\
        --set backends.fp4_gemm=cuda --set backends.options.cuda.fuse_norm=true --out $OUT/no_pdl.md
"""

from __future__ import annotations

import inspect
import runpy
import sys
from pathlib import Path

from pieceworks.backends.fp4_gemm import cuda_decode

launches = {"norm_consumers_without_pdl": 0}
_decode_gemm = cuda_decode.decode_gemm
_signature = inspect.signature(_decode_gemm)


def decode_gemm(*args, **kwargs):
    """cuda_decode.decode_gemm, with pdl off where it takes a fused norm's input (`prenormed`)."""
    bound = _signature.bind(*args, **kwargs)
    if bound.arguments.get("prenormed") is not None:
        launches["norm_consumers_without_pdl"] += 1
        bound.arguments["pdl"] = False
    return _decode_gemm(*bound.args, **bound.kwargs)


def main() -> None:
    cuda_decode.decode_gemm = decode_gemm
    sys.argv[0] = str(Path(__file__).with_name("graphs.py"))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        print(f"launches taking a fused norm's input made without PDL: {launches['norm_consumers_without_pdl']}")


if __name__ == "__main__":
    main()
