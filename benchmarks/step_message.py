"""What the leader's step message costs on the host: `send_step`'s work (build the message,
`ProcessGroups.broadcast(msg, wait=False)`) through the shared-memory queue against through the gloo
broadcast, with followers in processes of their own that receive every message (a group of one sends
no message), on the CPU.

    python benchmarks/step_message.py --world 2 --batch 1 32 --messages 4000

Two messages: "decode", a steady decode step's (one token, a cached length and a sequence id each; no
sequence gained a page), and "full", one that carries every sequence's `--pages` page ids (a sequence's
first step, and the format of a protocol without the followers' page lists). The two transports
alternate in rounds in one run (a loaded machine's noise falls on both); between two messages the
leader spins `--gap-us` (the step it runs meanwhile), and the previous gloo message has left before the
next send is timed (as after a step, which takes longer than a send). Per world size, batch and
message: the median and p90 microseconds of one send on the leader, and the pickle's size.
"""

from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch.multiprocessing as mp
from common import md_table

SWITCH = "switch transport"


def step_message(batch: int, pages: int, kind: str) -> Callable[[], tuple]:
    """What `send_step` does before it sends, for `batch` sequences of `pages` pages: "decode" builds a
    steady decode step's message (`SentPages.message`: no sequence gained a page); "full" one with every
    sequence's page list whole (each sequence's first step; the format of a protocol without the
    followers' page lists)."""
    from pieceworks.executor.distributed import SentPages

    seqs = [SimpleNamespace(id=i, pages=list(range(i * pages, (i + 1) * pages)), kv_len=1000 + i, freed=False)
            for i in range(batch)]
    tokens = [[100_000 + i] for i in range(batch)]
    if kind == "full":
        return lambda: (tokens, [s.kv_len for s in seqs], [s.id for s in seqs], [s.pages for s in seqs], [], False)
    sent = SentPages()
    sent.message(seqs, tokens, False)
    return lambda: sent.message(seqs, tokens, False)


def follower(rank: int, world: int, init_method: str) -> None:
    """Receive until None; `SWITCH` flips between the queue and gloo, as the leader does."""
    import torch

    from pieceworks.parallel.group import init_groups

    groups = init_groups(rank, world, torch.device("cpu"), init_method, 60.0)
    queue = groups.queue
    while (msg := groups.broadcast()) is not None:
        if msg == SWITCH:
            groups.queue = None if groups.queue is not None else queue
    groups.queue = queue
    groups.close()


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def measure(world: int, batches: list[int], pages: int, messages: int, rounds: int, gap_us: float) -> list[list]:
    import torch

    from pieceworks.parallel.group import init_groups

    init_method = (Path(tempfile.mkdtemp(prefix="pieceworks-bench-")) / "store").as_uri()
    procs = [mp.get_context("spawn").Process(target=follower, args=(r, world, init_method)) for r in range(1, world)]
    for p in procs:
        p.start()
    groups = init_groups(0, world, torch.device("cpu"), init_method, 60.0)
    queue = groups.queue
    assert queue is not None, "the shared-memory queue is not usable on this host"
    rows = []
    for batch, kind in itertools.product(batches, ("decode", "full")):
        build = step_message(batch, pages, kind)
        times: dict[str, list[float]] = {"queue": [], "gloo": []}
        for _ in range(rounds):
            for name in ("queue", "gloo"):
                for _ in range(messages // rounds):
                    groups.flush()  # gloo: the previous message is out, as after a step (longer than a send)
                    t0 = time.perf_counter_ns()
                    groups.broadcast(build(), wait=False)
                    times[name].append((time.perf_counter_ns() - t0) / 1e3)
                    spin(gap_us)
                groups.broadcast(SWITCH)
                groups.queue = None if groups.queue is not None else queue
        q, g = (sorted(times[k]) for k in ("queue", "gloo"))
        p90 = lambda xs: xs[int(0.9 * len(xs))]  # noqa: E731
        rows.append([world, batch, kind, len(pickle.dumps(build(), protocol=pickle.HIGHEST_PROTOCOL)),
                     f"{statistics.median(q):.1f}", f"{p90(q):.1f}", f"{statistics.median(g):.1f}", f"{p90(g):.1f}",
                     f"{statistics.median(g) / statistics.median(q):.1f}"])
    groups.broadcast(None)
    for p in procs:
        p.join(30)
    groups.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2], help="ranks, at least 2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--pages", type=int, default=64, help="page ids per sequence")
    ap.add_argument("--messages", type=int, default=4000, help="per transport, world size and batch")
    ap.add_argument("--rounds", type=int, default=20, help="alternations of the two transports")
    ap.add_argument("--gap-us", type=float, default=200.0, help="leader's spin between two messages")
    args = ap.parse_args()
    if min(args.world) < 2:
        ap.error(f"--world {min(args.world)}: a group of one sends no step message; use 2 or more ranks")
    rows = []
    for world in args.world:
        rows += measure(world, args.batch, args.pages, args.messages, args.rounds, args.gap_us)
    print(f"host {os.uname().nodename}, {os.cpu_count()} CPUs; {args.messages} messages per cell, "
          f"{args.pages} pages per sequence, {args.gap_us:.0f} us between messages")
    print(md_table(["world", "batch", "message", "pickle B", "queue us (median)", "p90", "gloo us (median)", "p90",
                    "gloo / queue"], rows))


if __name__ == "__main__":
    main()
