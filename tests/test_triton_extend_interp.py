"""attention.triton's extend kernel on the CPU, in Triton's interpreter (tests/helpers/triton_interp_extend.py):
sequences of any query length over cached prefixes, decode rows beside prompt chunks, query blocks that start
mid-block in the step's token layout. Needs triton importable (README's test command installs it); skips without."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (README's test command installs triton==3.6.0)")

ROOT = Path(__file__).resolve().parents[1]

# (query lengths, cached prefixes, Hq, Hkv, BLOCK_Q, seed)
CASES = [
    ([16], [0], 8, 2, 16, 1),                         # one whole block
    ([5], [0], 4, 4, 16, 2),                          # MHA, a partial block
    ([37], [20], 8, 2, 16, 3),                        # over a cached prefix
    ([1, 1, 1], [7, 30, 64], 8, 2, 16, 4),            # decode rows only
    ([40, 1, 1, 17], [0, 50, 3, 33], 8, 2, 16, 5),    # blocks starting mid-block after a 40-token chunk
    ([3, 70], [100, 0], 8, 1, 32, 6),                 # one KV head, 32-query blocks
    ([21, 1], [9, 40], 12, 1, 16, 7),                 # 12 query heads per KV head (GLM-4.5-Air): rows masked to 16
    ([19, 2, 1], [0, 17, 5], 6, 2, 16, 8),            # groups of 3 (Llama 3.2 3B's 24 / 8)
    ([12], [30], 14, 2, 16, 9),                       # groups of 7 (Qwen2.5-7B's 28 / 4)
    ([40], [3], 64, 2, 16, 10),                       # groups of 32: 4-query blocks (128 rows a program)
]


def test_extend_kernel_matches_reference():
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/triton_interp_extend.py"), json.dumps(CASES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(CASES)
    for case, row in zip(CASES, rows):
        assert row["err"] < 1e-4, (case, row)
        assert row["tail_untouched"], (case, row)


# (query lengths, cached prefixes, bucket rows, max_seqs, seed[, Hq, Hkv])
BACKEND_CASES = [([5, 17, 1], [0, 0, 0], 32, 4, 1), ([9, 1, 1], [20, 40, 3], 16, 4, 2), ([16], [0], 16, 1, 3),
                 ([9, 1], [20, 3], 16, 4, 4, 12, 1)]  # GLM-4.5-Air's group of 12


def test_backend_in_a_full_graph_plan_matches_the_torch_backend():
    """attention.triton_all planned as a full extend graph plans (max_seqs sequences, padding ones empty, bucket
    rows): the torch backend's eager results, padding rows zero, the same K/V written."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests/helpers/triton_interp_extend.py"),
                           json.dumps(BACKEND_CASES), "backend"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(BACKEND_CASES)
    for case, row in zip(BACKEND_CASES, rows):
        assert row["err"] < 1e-4 and row["padding_zero"] and row["kv_equal"], (case, row)
