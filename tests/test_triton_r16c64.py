"""The Triton GEMM's r16c64 mode (the CUDA backend's weights above its decode rows), on the CPU: the K loop
`triton_k32.fp4_tile_loop` in Triton's interpreter against x @ dequantize(W).T, next to the k32 layout
of the same weights (tests/helpers/triton_interp_loop.py: float32 stand-ins for the interpreter's missing
bfloat16 dot and float8 bitcasts, so this checks the layouts' index arithmetic; the kernels' numerics run
on the GPU in tests/gpu/test_cuda_fp4.py). Needs triton importable; CI installs none and skips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (the CI test extra has none)")

ROOT = Path(__file__).resolve().parents[1]

# (M, N, K, BLOCK_K, ONE_DOT, TWO_ACC, W_AS_A, seed): N never a multiple of the 32-row tile; K = 336 pads
# to 384 (x masked, EVEN_K off); BLOCK_K 64 is the r16c64-only step for K padded to an odd multiple of 64.
CASES = [
    (5, 48, 192, 64, False, False, True, 1),
    (5, 40, 320, 64, True, False, False, 2),
    (9, 72, 336, 64, True, False, True, 3),
    (9, 64, 256, 128, True, False, True, 4),
    (3, 40, 384, 128, False, True, True, 5),
    (16, 40, 512, 256, True, False, True, 6),
    (11, 56, 512, 256, False, False, False, 7),
]


def test_r16c64_k_loop_matches_reference_and_k32():
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/triton_interp_loop.py"), json.dumps(CASES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(CASES)
    for row in rows:
        # float32 products of exactly decoded values, summed in float32: ~1e-7 of the norm; a misplaced unit,
        # scale or x column gives O(1)
        assert row["r16c64"] < 1e-5, row
        if "k32" in row:
            assert row["k32"] < 1e-5, row
