"""The Triton NVFP4 GEMM's K loop on the CPU: `triton_k32.fp4_tile_loop` in Triton's interpreter on k32 weights
against x @ dequantize(W).T (tests/helpers/triton_interp_loop.py: float32 stand-ins for the interpreter's
missing bfloat16 dot and float8 bitcasts, so this checks the layout's index arithmetic; the kernels'
numerics run on the GPU in tests/gpu/test_triton_fp4.py). Needs triton importable (README's test command
installs it); skips without."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (README's test command installs triton==3.6.0)")

ROOT = Path(__file__).resolve().parents[1]

# (M, N, K, BLOCK_K, ONE_DOT, TWO_ACC, W_AS_A, seed[, PERM_K]): N never a multiple of the 32-row tile; K = 336 and
# 4112 leave x masked past K (EVEN_K off); BLOCK_K 128 and 256 step one and two storage tiles.
CASES = [
    (5, 48, 192, 128, False, False, True, 1),
    (9, 64, 336, 128, True, False, True, 2),
    (3, 40, 384, 128, False, True, True, 3),
    (16, 40, 512, 256, True, False, True, 4),
    (11, 56, 512, 256, False, False, False, 5),
    (7, 72, 4112, 256, False, True, True, 6),
    (6, 40, 768, 256, False, False, True, 7, True),  # perm_k: x gathered in quad_k's order
    (8, 64, 4112, 256, False, True, True, 8, True),
]


def test_k32_k_loop_matches_reference():
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/triton_interp_loop.py"), json.dumps(CASES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(CASES)
    for row in rows:
        # float32 products of exactly decoded values, summed in float32: ~1e-7 of the norm; a misplaced unit,
        # scale or x column gives O(1)
        assert row["k32"] < 1e-5, row
