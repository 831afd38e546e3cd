"""tests/conftest.py's PIECEWORKS_FAILURE_LOG: each failure written to the file as it happens (a GPU run cut at its
time limit keeps its failures' tracebacks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_failures_are_appended_as_they_happen(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "def test_fails():\n    assert 1 + 1 == 3, 'the sum is off'\n\n\ndef test_passes():\n    pass\n")
    log = tmp_path / "failures.txt"
    env = {**os.environ, "PIECEWORKS_FAILURE_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_sample.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    text = log.read_text()
    assert "=== test_sample.py::test_fails (call)" in text and "the sum is off" in text
    assert "test_passes" not in text
