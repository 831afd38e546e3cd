"""Async steps (`scheduler.async_steps`): one step in flight.

The Engine launches step k before step k - 1's token ids reach the host. Step k's rows don't know
their input ids yet: each request that step k - 1 sampled ends its output in the placeholder -(row + 1)
of its token there (`mark_pending`), and the executor takes that row's id from the previous step on the
device (a decode graph's greedy id, or the id the sampler drew: `Executor.feed_ids`). `AsyncSteps` decides
when a step may run this way (`ready`; the scheduler's `preempt=False`); the Engine runs it
(`Engine._forward`); `sample` samples on the device the rows that computed all their known tokens and starts
the copy of their ids into pinned host memory behind an event; `await_ids` hands them over once they
arrived, and the Engine accepts them in place of the placeholders (`Engine._complete`). Decode steps and
steps with prompt chunks alike. A step with structured outputs samples after step k - 1's ids are accepted
(its grammar mask needs them), while the GPU runs its forward; a step whose rows give prompt logprobs reads
them on the host before sampling. The rules are in docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pieceworks.engine.logprobs import logprob_table, read_logprobs

if TYPE_CHECKING:
    from pieceworks.engine.request import Request
    from pieceworks.engine.rows import TokenMask
    from pieceworks.engine.sampler import Sampler
    from pieceworks.engine.scheduler import Scheduler
    from pieceworks.executor.runner import Executor


class InFlight:
    """A launched async step: the requests it samples, by row, their token ids (int64 [rows]) and, where a
    row asked for logprobs, the step's `logprob_table` (else None), on the host once `done` (a CUDA event;
    None on the CPU, where they are ready) has completed."""

    __slots__ = ("reqs", "ids", "logprobs", "done")

    def __init__(self, reqs: list[Request], ids: torch.Tensor, logprobs: torch.Tensor | None,
                 done: torch.cuda.Event | None) -> None:
        self.reqs, self.ids, self.logprobs, self.done = reqs, ids, logprobs, done


class AsyncSteps:
    """The Engine's pipeline: the step in flight and two pinned host buffers for its ids (and two for its
    logprob tables), used in turn."""

    def __init__(self) -> None:
        self.inflight: InFlight | None = None  # the step launched, ids not yet on the host
        self._pinned: list[torch.Tensor] = []
        self._pinned_lp: list[torch.Tensor | None] = [None, None]

    @staticmethod
    def ready(ex: Executor, s: Scheduler) -> bool:
        """Whether the next step may run asynchronously, if the scheduler needs no preemption for it
        (`Scheduler.schedule(preempt=False)`): something runs or waits, and world size is 1."""
        return ex.groups is None and bool(s.running or s.waiting)

    def sample(self, ex: Executor, reqs: list[Request], logits: torch.Tensor, ids: torch.Tensor | None,
               sampler: Sampler, token_mask: TokenMask | None = None) -> InFlight:
        """Sample `reqs`' rows of `logits` on the device (greedy rows of a decode graph: the replay's `ids`;
        structured outputs' `token_mask`, computed once the previous step's ids were accepted), hand the
        ids to the executor for the next step's placeholders and start their copy to the host."""
        states = [r.state for r in reqs]
        table = None
        if ids is None or token_mask is not None or not all([s.plain for s in states]):
            ids = sampler.sample_ids(logits, states, ids, token_mask)
            ex.feed_ids(ids)
            params = [s.params for s in states]
            if any([p.logprobs is not None for p in params]):
                table = logprob_table(logits, ids, params)
        if ids.device.type != "cuda":
            return InFlight(reqs, ids, table, None)
        if not self._pinned or self._pinned[0].numel() < ids.numel():
            n = max(ids.numel(), ex.decode_graphs.sizes[-1] if ex.decode_graphs is not None else 0)
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
