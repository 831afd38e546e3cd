"""Async steps (`scheduler.async_steps`): one decode step in flight.

The Engine launches step k before step k - 1's token ids reach the host. Step k's rows don't know
their input ids yet: each running request's output ends in the placeholder -(row + 1) of its token in
the step in flight (`mark_pending`), and the decode runner takes that row's id from the previous step
on the device (the replay's greedy id, or the id the sampler drew there). `AsyncSteps` decides when a
step may run this way (`ready`), launches it with the copy of its ids into pinned host memory behind
an event (`launch`), and hands the ids over once they arrived (`await_ids`); the Engine accepts them in
place of the placeholders (`Engine._complete`).
The rules are in docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pieceworks.core.batch import ForwardBatch
from pieceworks.engine.logprobs import logprob_table, read_logprobs

if TYPE_CHECKING:
    from pieceworks.engine.request import Request
    from pieceworks.engine.sampler import Sampler
    from pieceworks.engine.scheduler import Scheduler
    from pieceworks.executor.runner import Executor


class InFlight:
    """A launched async decode step: its requests by row, their token ids (int64 [rows]) and, where a row
    asked for logprobs, the step's `logprob_table` (else None), on the host once `done` (a CUDA event;
    None on the CPU, where they are ready) has completed."""

    __slots__ = ("reqs", "ids", "logprobs", "done")

    def __init__(self, reqs: list[Request], ids: torch.Tensor, logprobs: torch.Tensor | None,
                 done: torch.cuda.Event | None) -> None:
        self.reqs, self.ids, self.logprobs, self.done = reqs, ids, logprobs, done


class AsyncSteps:
    """The Engine's pipeline: the step in flight and two pinned host buffers for its ids (and two for its
    logprob tables), used in turn."""

    def __init__(self) -> None:
        self.inflight: InFlight | None = None  # the decode step launched, ids not yet on the host
        self._pinned: list[torch.Tensor] = []
        self._pinned_lp: list[torch.Tensor | None] = [None, None]

    @staticmethod
    def ready(ex: Executor, s: Scheduler) -> bool:
        """Whether the next step may run asynchronously: every running request decodes one token, nothing
        waits, no request needs preempting, world size 1 and a decode graph covers the batch."""
        running = s.running
        if s.waiting or not running or ex.groups is not None or ex.decode_graphs is None:
            return False
        if not ex.decode_graphs.covers(min(len(running), s.cfg.max_num_seqs)):
            return False
        ps, need = ex.page_size, 0
        for req in running:
            seq = req.seq
            if seq is None or seq.kv_len != req.num_tokens - 1:
                return False
            need += seq.kv_len + 1 > len(seq.pages) * ps
        return need <= s.alloc.num_free

    def launch(self, ex: Executor, scheduled: list[tuple[Request, list[int]]], sampler: Sampler) -> InFlight:
        """Run a decode step whose rows' ids may be placeholders of the in-flight step (the decode runner
        takes those from the device), sample its rows on the device (greedy rows: the replay's ids; the
        next step's placeholders read the sampled ids) and start the copy of its ids to the host."""
        reqs = [r for r, _ in scheduled]
        logits = ex.forward(ForwardBatch([r.seq for r in reqs], [t for _, t in scheduled]), validate=False)
        ids = ex.greedy_ids
        if ids is None:
            raise RuntimeError("an async decode step did not replay a decode graph (Executor.greedy_ids is None)")
        states = [r.state for r in reqs]
        table = None
        if not all([s.plain for s in states]):
            ids = sampler.sample_ids(logits, states, ids)
            ex.decode_graphs.feed_ids(ids)
            params = [s.params for s in states]
            if any([p.logprobs is not None for p in params]):
                table = logprob_table(logits, ids, params)
        if ids.device.type != "cuda":
            return InFlight(reqs, ids, table, None)
        if not self._pinned or self._pinned[0].numel() < ids.numel():
            n = ex.decode_graphs.sizes[-1]
            self._pinned = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        # the other buffers: the in-flight step's copies may still write these
        self._pinned.reverse()
        self._pinned_lp.reverse()
        host = self._pinned[0][: ids.numel()]
        host.copy_(ids, non_blocking=True)
        if table is not None:
            buf = self._pinned_lp[0]
            if buf is None or buf.numel() < table.numel():
                buf = self._pinned_lp[0] = torch.empty(table.numel(), dtype=torch.float64, pin_memory=True)
            host_table = buf[: table.numel()].view(table.shape)
            host_table.copy_(table, non_blocking=True)
            table = host_table
        done = torch.cuda.Event()
        done.record()
        return InFlight(reqs, host, table, done)

    def await_ids(self, step: InFlight) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """The in-flight step's ids, and its rows' logprobs where any row asked for them (else None), once
        on the host (its own method: benchmarks/serving.py times it)."""
        if step.done is not None:
            step.done.synchronize()
        ids = step.ids.numpy().tolist()  # host memory (pinned, or the CPU's ids)
        if step.logprobs is None:
            return ids, None
        return ids, read_logprobs(step.logprobs.tolist(), [r.params for r in step.reqs]).logprobs


def mark_pending(reqs: list[Request]) -> bool:
    """Give each unfinished request of a launched step the placeholder -(row + 1) of its token there;
    whether any got one (else nothing of the step is awaited)."""
    any_left = False
    for row, req in enumerate(reqs):
        if req.finish_reason is None:
            req.output.append(-1 - row)
            req.pending = any_left = True
    return any_left
