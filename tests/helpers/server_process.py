"""A `pieceworks serve` subprocess on 127.0.0.1 for tests: a free port, a bounded wait for /health,
and always killed at the end (its log is printed when it dies early)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(args: list[str], startup_timeout: float = 180.0):
    """Start `pieceworks serve ARGS --port P`; yield its base URL; terminate it on exit."""
    import httpx

    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="pieceworks-serve-", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pieceworks.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{Path(log.name).read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not up after {startup_timeout} s:\n{Path(log.name).read_text()[-4000:]}")
            time.sleep(0.25)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        log.close()
        os.unlink(log.name)


