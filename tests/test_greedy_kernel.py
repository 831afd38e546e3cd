"""The two-launch greedy kernel (`executor/greedy_kernel.py`) on the CPU, in Triton's interpreter
(tests/helpers/greedy_interp.py, a subprocess), against argmax / isfinite: one and many chunks per row, ties
inside and across blocks and chunks, NaN and +-inf rows; and its chunking arithmetic. On the GPU:
tests/gpu/test_greedy_gpu.py. Needs triton importable (README's test command installs it); skips without."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_chunking_covers_each_row_once():
    pytest.importorskip("triton", reason="triton is not installed (README's test command installs triton==3.6.0)")
    from pieceworks.executor import greedy_kernel as G

    for rows in (1, 2, 3, 8, 32, 64, 256, 4096):
        for vocab in (1, 1000, 1024, 1025, 32000, 128256, 129280):
            chunk, per_row = G.chunking(rows, vocab)
            assert chunk % G.BLOCK == 0 and 1 <= per_row <= G.MAX_CHUNKS
            assert (per_row - 1) * chunk < vocab <= per_row * chunk  # every chunk holds part of the row
    assert G.chunking(1, 128256)[1] >= 100  # batch 1 spreads one row over about a hundred programs


def test_greedy_kernel_matches_argmax_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (README's test command installs triton==3.6.0)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/greedy_interp.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["cases"] >= 20 and result["mismatches"] == [], result
