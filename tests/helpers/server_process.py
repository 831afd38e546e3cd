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


class ServerProcess:
    """`pieceworks serve ARGS` on a free port of 127.0.0.1. `start()` returns at once, so the caller can
    load its own reference model while the server boots; `wait()` blocks until /health answers."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pieceworks-serve-", suffix=".log", delete=False)
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        cmd = [sys.executable, "-m", "pieceworks.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def log_tail(self) -> str:
        return Path(self.log.name).read_text()[-4000:]

    def wait(self, timeout: float = 180.0) -> str:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not up after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGINT (a graceful shutdown); once the server logs that its engine is shut down, or after
        15 s, SIGKILL spares the interpreter's teardown of torch (seconds of garbage collection)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + 15
            while self.proc.poll() is None and time.monotonic() < deadline:
                if "stopped: the engine is shut down" in self.log_tail():
                    break
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=15)
        self.log.close()
        os.unlink(self.log.name)


@contextmanager
def serve(args: list[str], env: dict[str, str] | None = None):
    """A started `ServerProcess` (`env`: variables added to this process's environment), stopped (SIGINT, then
    SIGKILL after 15 s) on exit."""
    server = ServerProcess(args, env)
    try:
        yield server
    finally:
        server.stop()


def wait_healthy(url: str, thread, deadline: float, what: str = "the server did not come up") -> None:
    """Poll `url`/health until it answers 200 (a server running in `thread` of this process); AssertionError with
    `what` once the thread died or `deadline` (time.monotonic) passed."""
    import httpx

    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), what
        time.sleep(0.1)
