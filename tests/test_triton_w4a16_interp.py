"""The w4a16 tile for 17..512 rows (`triton_w4a16.w4a16_gemm`) on the CPU, in Triton's interpreter, against
x @ dequantize(W).T (tests/helpers/triton_interp_w4a16.py; float32 stand-ins for the interpreter's missing bfloat16
dot and float8 bitcasts, so this checks the k32 index arithmetic, the M tiles, the K splits and both reductions; the
numerics and the TMA lowering need the GPU: `python benchmarks/fp4_gemm.py --w4a16` checks each call there). Needs
triton importable; CI installs none and skips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the CI test extra has none)")

ROOT = Path(__file__).resolve().parents[1]

# (M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, x dtype, tma_x, target_ctas, counters, seed): N never a multiple of BLOCK_N;
# K = 336 and 1040 leave x masked (pointers) or zero-filled (TMA) past K; M = 70 takes two M tiles; target_ctas
# above the tile count splits K (counters: the last split reduces, else the second kernel).
CASES = [
    (20, 96, 512, 32, 64, 128, "bfloat16", True, 0, False, 1),
    (20, 96, 512, 32, 64, 128, "float32", False, 0, False, 2),
    (17, 200, 1024, 32, 128, 128, "float32", False, 8, True, 3),
    (33, 136, 336, 64, 64, 128, "bfloat16", True, 12, False, 4),
    (33, 136, 336, 64, 64, 128, "float32", False, 12, True, 5),
    (70, 200, 1040, 64, 128, 256, "float32", False, 12, True, 6),
    (70, 200, 1040, 64, 128, 256, "bfloat16", True, 12, True, 7),
]


def test_w4a16_gemm_matches_reference():
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/triton_interp_w4a16.py"), json.dumps(CASES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(CASES)
    for case, row in zip(CASES, rows):
        m, n, _, _, _, _, x_dtype, _, target, counters, _ = case
        assert row["shape"] == [m, n] and row["dtype"] == f"torch.{x_dtype}", row
        assert (row["split"] > 1) == (target > 0), row  # the split cases split
        assert row["counters_zero"], row  # the fused reduction leaves its counters zero for the next call
        # float32 products of exactly decoded values summed in float32: ~1e-7 of the norm; bfloat16 output: the
        # interpreter truncates float32 -> bfloat16 (under one ulp, at most 2^-7 relative per element); a misplaced
        # unit, scale, x column, M tile or split gives O(1e-2) to O(1)
        assert row["err"] < (1e-5 if x_dtype == "float32" else 2 ** -7), row
