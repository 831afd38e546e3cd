"""Worker processes of an in-process launch: started with torch.multiprocessing, watched, and stopped
without leaving a process behind.

Workers start from a fork server that has imported torch (forkserver where the platform has it, else
spawn): a spawned worker spends about 2 s importing torch before it builds its shard, a forked one
starts in milliseconds. Neither start method shares CUDA state (the server never touches CUDA), and
each worker takes the leader's environment as it is at the start (the server's is the one of its own
start), so a variable set between two launches reaches the second one's workers.

Each worker runs `target(rank, *args, status)`; it sends ("ready",) on `status` once built, or
("error", text) when it fails, then keeps serving steps until the leader says stop. The leader checks
before every step that all are alive (`check`), so a dead worker is reported at the next step with
its exit code; a worker that dies inside a step fails that step's collectives (gloo reports the
closed connection, NCCL after `parallel.timeout_s`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch.multiprocessing as mp

from pieceworks.environment import adopt_environment, leader_environment


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited or failed; the executor is closed (build a new one)."""


def _in_env(env: dict[str, str], target: Callable, *args: Any) -> None:
    """`target(*args)` in the leader's environment `env` (a forked worker has its server's)."""
    adopt_environment(env)
    target(*args)


class WorkerGroup:
    """Ranks 1..N-1 as child processes of the leader (rank 0)."""

    def __init__(self, target: Callable, size: int, args: tuple) -> None:
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        if ctx.get_start_method() == "forkserver":
            ctx.set_forkserver_preload(["torch"])  # no effect once this process's server runs
        self.procs: list[Any] = []
        self.status: list[Any] = []
        env = leader_environment()
        for rank in range(1, size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_in_env, args=(env, target, rank, *args, send), daemon=True,
                            name=f"pieceworks-tp{rank}")
            p.start()
            send.close()  # the child holds the write end: EOF here once it exits
            self.procs.append(p)
            self.status.append(recv)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker reported itself built.

        Raises:
            WorkerDied: a worker failed (its error text), exited, or took longer than `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        for rank, conn in enumerate(self.status, start=1):
            left = deadline - time.monotonic()
            if not conn.poll(max(left, 0)):
                raise WorkerDied(f"tensor-parallel worker rank {rank} did not report ready within {timeout_s:.0f} s "
                                 "(parallel.timeout_s)")
            try:
                msg = conn.recv()
            except EOFError:
                raise WorkerDied(self._describe(rank, "exited while building its shard")) from None
            if msg[0] != "ready":
                raise WorkerDied(f"tensor-parallel worker rank {rank} failed while building its shard:\n{msg[1]}")

    def failure(self, wait_s: float = 0.0) -> str | None:
        """What went wrong with the workers, or None when all are alive (after waiting up to `wait_s` for
        one to exit: a killed process is gone a moment after its connections): an error a worker
        reported, else the first one that exited and its exit code."""
        deadline = time.monotonic() + wait_s
        while all(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for rank, conn in enumerate(self.status, start=1):
            try:
                if conn.poll(0):
                    msg = conn.recv()
                    if msg[0] == "error":
                        return f"tensor-parallel worker rank {rank} failed:\n{msg[1]}"
            except (EOFError, OSError):
                pass
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                return self._describe(rank, "exited")
        return None

    def check(self) -> None:
        """Raises WorkerDied when a worker is gone."""
        for p in self.procs:
            if not p.is_alive():
                raise WorkerDied(self.failure() or "a tensor-parallel worker exited")

    def _describe(self, rank: int, what: str) -> str:
        p = self.procs[rank - 1]
        p.join(0.5)
        code = p.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"tensor-parallel worker rank {rank} (pid {p.pid}) {what} ({how})"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the workers to exit (after the leader told them to stop), then kill what is left."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.status:
            conn.close()
        self.procs, self.status = [], []
