"""Launching an Executor over several ranks, and the followers' step loop.

`launch` (called by `Executor.from_config` when `parallel.tensor_parallel_size` N > 1) checks the
parallel layout on the meta device (a `ConfigError` before any process starts or any memory is
taken), then either joins the torchrun run this process belongs to, or starts ranks 1..N-1 itself as
worker processes (`parallel.workers`). Every rank builds its own shard with the same code as a single
process. Rank 0, the leader, returns its Executor; each of its steps is broadcast to the other ranks
(new tokens, cached lengths and page lists per sequence: all a rank needs to run the same step on its
shard, `follow`), and the leader alone keeps the page allocator and the sequences.

A step message carries, per sequence, only the pages it gained since the leader's last message about it
(a decode step: a page every `page_size` tokens), and the ids of sequences freed since: each follower
keeps every live sequence's page list (`follow`), the leader what it has sent (`SentPages`, its
`ex.sent_pages`). A decode step's message stays about 15 bytes per sequence at any context length.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import traceback
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pieceworks.config import Config, ConfigError
from pieceworks.core.batch import ForwardMode
from pieceworks.parallel.group import init_groups, torchrun_rank
from pieceworks.parallel.layout import TPLayout
from pieceworks.parallel.workers import WorkerDied, WorkerGroup


@dataclass
class StepSeq:
    """A follower's view of one sequence of a step: its pages and cached length (the leader owns the
    real `Sequence`)."""

    pages: list[int]
    kv_len: int
    tokens: list[int] = field(default_factory=list)


class SentPages:
    """The leader's record of what its step messages told the followers: the pages sent per live
    sequence id. A sequence's pages grow between steps (`Executor._reserve_pages`; a step that fails
    closes a tensor-parallel executor), so the pages past that count are all a step must add; a sequence
    cut back (`Executor.truncate` calls `cut`) is sent as gone, then whole again: its follower copy starts
    over. (Counting pages can't tell a cut: the cut sequence may have gained as many back by its next step.)"""

    PRUNE_EVERY = 64  # steps between looks for freed sequences (ids are never reused: a stale entry costs memory only)

    def __init__(self) -> None:
        self.seqs: dict[int, Any] = {}  # id -> the Sequence (to see `freed`)
        self.counts: dict[int, int] = {}  # id -> pages the followers have
        self.steps = 0
        self.cut_ids: list[int] = []  # cut back since the last message: the next one sends them as gone

    def cut(self, seq_id: int) -> None:
        """Record that the sequence lost pages: the followers drop their copy with the next message."""
        if self.counts.pop(seq_id, None) is not None:
            del self.seqs[seq_id]
            self.cut_ids.append(seq_id)

    def message(self, seqs: list, tokens: list[list[int]], all_logits: bool | list[bool]) -> tuple:
        """(tokens, cached lengths, ids, new pages per sequence, freed ids, all_logits) of one step,
        recorded as sent (a message that fails to go out closes the executor)."""
        counts = self.counts
        ids = [s.id for s in seqs]
        lens = [len(s.pages) for s in seqs]
        new_pages: list = [()] * len(seqs)
        gone, self.cut_ids = self.cut_ids, []  # a follower applies `gone` first, then this step's pages
        if list(map(counts.get, ids)) != lens:  # a sequence is new or gained pages (a decode step: rarely)
            for k, s in enumerate(seqs):
                n = counts.get(s.id)
                if n != lens[k]:
                    if n is None:
                        self.seqs[s.id], n = s, 0
                    new_pages[k] = s.pages[n:]
                    counts[s.id] = lens[k]
        self.steps += 1
        if self.steps % self.PRUNE_EVERY == 0:
            freed = [i for i, s in self.seqs.items() if s.freed]
            for i in freed:
                del counts[i], self.seqs[i]
            gone += freed
        return tokens, [s.kv_len for s in seqs], ids, new_pages, gone, all_logits


def rank_device(cfg: Config, local_rank: int) -> torch.device:
    """GPU `local_rank` on CUDA, else the CPU."""
    from pieceworks.core.devices import resolve_device

    device = resolve_device(cfg.runtime.device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def check_layout(cfg: Config, device: torch.device, model_dir: Path | None = None) -> None:
    """ConfigError unless N ranks fit: GPUs for every rank, and a model N splits as its sharding needs
    (`check_parallel` of the model's args, run on the meta device)."""
    from pieceworks.models.loader import model_facts

    n = cfg.parallel.tensor_parallel_size
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise ConfigError(f"parallel.tensor_parallel_size: {n} ranks need {n} GPUs, but {torch.cuda.device_count()} "
                          "are visible; lower tensor_parallel_size or make more GPUs visible")
    tp = TPLayout(0, n, None, cfg.parallel.expert_parallel)
    model_cfg = replace(cfg.model, path=str(model_dir)) if model_dir else cfg.model
    model_facts(model_cfg, cfg.quantization, cfg.kv_cache.page_size, tp=tp)


def launch(cls: type, cfg: Config, progress: bool) -> Any:
    """Build the leader's Executor of an N-rank run (see the module docstring). On a follower rank of a
    torchrun launch this serves the leader's steps and exits the process when the leader closes."""
    n = cfg.parallel.tensor_parallel_size
    under_torchrun = torchrun_rank(n)
    if under_torchrun is not None:
        rank, local_rank = under_torchrun
        device = rank_device(cfg, local_rank)
        groups = init_groups(rank, n, device, "env://", cfg.parallel.timeout_s)
        try:  # a failure leaves the group (its shared-memory queue included) on every rank
            if rank != 0:  # a demo model is converted once, by the leader, before the others read it
                groups.barrier()
            model_dir = cls.resolve_model_dir(cfg, progress and rank == 0)
            if rank == 0:
                groups.barrier()
            check_layout(cfg, device, model_dir)  # every rank raises the same ConfigError
            ex = cls.build(cfg, progress and rank == 0, device, model_dir, groups)
        except BaseException:
            groups.close()
            raise
        if rank == 0:
            return _lead(ex)
        follow(ex)
        groups.close()
        raise SystemExit(0)
    device = rank_device(cfg, 0)
    model_dir = cls.resolve_model_dir(cfg, progress)
    check_layout(cfg, device, model_dir)
    rendezvous = tempfile.mkdtemp(prefix="pieceworks-tp-")
    init_method = (Path(rendezvous) / "store").as_uri()
    workers = WorkerGroup(worker_main, n, (cls, cfg, model_dir, init_method))
    groups = None
    try:
        groups = init_groups(0, n, device, init_method, cfg.parallel.timeout_s)
        ex = cls.build(cfg, progress, device, model_dir, groups)
        workers.wait_ready(cfg.parallel.timeout_s)
    except BaseException as exc:
        failure = workers.failure() or _timed_out(exc, cfg.parallel.timeout_s)
        workers.stop(timeout_s=1.0)
        if groups is not None:
            groups.close()
        shutil.rmtree(rendezvous, ignore_errors=True)
        if failure is not None and not isinstance(exc, WorkerDied):
            raise WorkerDied(failure) from exc
        raise
    ex.workers = workers
    ex.rendezvous = rendezvous
    return _lead(ex)


def one_rank(cls: type, cfg: Config, progress: bool = True, collectives: bool = False) -> Any:
    """An executor of the whole model on one rank that still takes the distributed path: a process group
    of one, the TP layout of rank 0 of 1 and the leader's step (`send_step`, which has no follower to
    tell: no message, no queue), as the leader of N ranks runs them. A group of one skips the models'
    collectives (each would be a copy); `collectives=True` keeps them, so the collectives' capture into
    the CUDA graphs runs on one GPU (tests/gpu/test_parallel_gpu.py) and their cost shows
    (benchmarks/tp_overhead.py). `parallel.tensor_parallel_size` must be 1."""
    if cfg.parallel.tensor_parallel_size != 1:
        raise ConfigError("one_rank: parallel.tensor_parallel_size must be 1")
    import torch.distributed as dist

    device = rank_device(cfg, 0)
    model_dir = cls.resolve_model_dir(cfg, progress)
    rendezvous = tempfile.mkdtemp(prefix="pieceworks-tp-")
    try:
        groups = init_groups(0, 1, device, (Path(rendezvous) / "store").as_uri(), cfg.parallel.timeout_s)
    except BaseException:
        shutil.rmtree(rendezvous, ignore_errors=True)
        raise
    if collectives:
        groups = replace(groups, device_group=dist.group.WORLD.group_name)
    try:
        ex = cls.build(cfg, progress, device, model_dir, groups)
    except BaseException:
        groups.close()
        shutil.rmtree(rendezvous, ignore_errors=True)
        raise
    ex.rendezvous = rendezvous
    return _lead(ex)


def worker_main(rank: int, cls: type, cfg: Config, model_dir: Path | None, init_method: str, status: Any) -> None:
    """A worker process: build rank `rank`'s shard, report it on `status`, follow the leader's steps. Ctrl-C in a
    terminal reaches the whole process group: a worker leaves it to the leader, which stops the run (and its
    workers) as one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups = None
    try:
        device = rank_device(cfg, rank)
        groups = init_groups(rank, cfg.parallel.tensor_parallel_size, device, init_method, cfg.parallel.timeout_s)
        ex = cls.build(cfg, False, device, model_dir, groups)
        status.send(("ready",))
        follow(ex)
    except BaseException:
        try:
            status.send(("error", traceback.format_exc()))
        except OSError:  # the leader is gone
            pass
        raise SystemExit(1)
    finally:
        if groups is not None:
            groups.close()


def follow(ex: Any) -> None:
    """Run the leader's steps on this rank's shard until it sends stop (None)."""
    pages: dict[int, list[int]] = {}
    while True:
        msg = ex.groups.broadcast()
        if msg is None:
            return
        tokens, prefix_lens, _, _, _, all_logits = msg
        mode = ForwardMode.classify([len(t) for t in tokens], prefix_lens)
        ex.run_step(mode, step_seqs(pages, msg), tokens, all_logits)


def step_seqs(pages: dict[int, list[int]], msg: tuple) -> list[StepSeq]:
    """A follower's sequences of the step `msg` (`SentPages.message`), after applying its page news to
    `pages` (live sequence id -> its pages, as the leader's messages built them)."""
    _, prefix_lens, ids, new_pages, gone, _ = msg
    for i in gone:
        del pages[i]
    seqs = []
    for i, new, kv_len in zip(ids, new_pages, prefix_lens):
        held = pages.get(i)
        if held is None:
            held = pages[i] = []
        if new:
            held.extend(new)
        seqs.append(StepSeq(held, kv_len))
    return seqs


def send_step(ex: Any, seqs: list, tokens: list[list[int]], all_logits: bool | list[bool]) -> None:
    """The leader's half of `follow`: broadcast one step (after its pages are reserved). The leader does
    not wait for the followers: the message is in the shared-memory ring when this returns, or (through
    gloo, across hosts) goes out while the leader runs the same step. A group of one has no follower:
    no message is built or sent, so world size 1 runs the plain executor's step."""
    groups = ex.groups
    if groups.size > 1:
        groups.broadcast(ex.sent_pages.message(seqs, tokens, all_logits), wait=False)


def forward_leader(ex: Any, mode: ForwardMode, seqs: list, tokens: list[list[int]],
                   all_logits: bool | list[bool]) -> torch.Tensor:
    """`ex.run_step` on every rank: the step's inputs go to the followers first. A worker that is gone, or a
    step that fails on any rank, closes the executor (the ranks' states may differ now)."""
    try:
        if ex.workers is not None:
            ex.workers.check()
        send_step(ex, seqs, tokens, all_logits)
        return ex.run_step(mode, seqs, tokens, all_logits)
    except BaseException as exc:
        failure = ex.workers.failure(wait_s=2.0) if ex.workers is not None else None
        ex.close(graceful=False)
        failure = failure or _timed_out(exc, ex.cfg.parallel.timeout_s)
        if failure is not None and not isinstance(exc, WorkerDied):
            raise WorkerDied(f"{failure}; the executor is closed, build a new one") from exc
        raise


def _timed_out(exc: BaseException, timeout_s: float) -> str | None:
    """What a collective's timeout means (a rank that stopped answering, not a bug), or None for other errors."""
    text = str(exc)
    if type(exc) is RuntimeError or type(exc).__name__ == "DistBackendError":
        if "timed out" in text.lower() or "timeout" in text.lower():
            first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
            return (f"a rank did not answer within parallel.timeout_s = {timeout_s:g} s (stopped, or too slow: "
                    f"raise parallel.timeout_s) ({first[:200]})")
    return None


def shutdown(ex: Any, graceful: bool = True) -> None:
    """Stop the followers and leave the process group (the leader's `Executor.close`). Not graceful
    (after a failed step, when followers may wait in a collective that will not come): the workers are
    killed at once instead of being told to stop."""
    finalizer = getattr(ex, "leader_finalizer", None)
    if finalizer is not None:
        finalizer.detach()
    groups, workers = ex.groups, ex.workers
    ex.groups = ex.workers = None
    _stop(groups, workers, ex.rendezvous, graceful)


def _stop(groups: Any, workers: Any, rendezvous: str | None, graceful: bool = True) -> None:
    try:
        if graceful and groups is not None and (workers is None or workers.failure() is None):
            groups.broadcast(None)
    except RuntimeError:  # a follower is gone: nothing to tell it
        pass
    finally:
        if workers is not None:
            workers.stop(timeout_s=10.0 if graceful else 0.0)
        if groups is not None:
            groups.close()
        if rendezvous is not None:
            shutil.rmtree(rendezvous, ignore_errors=True)


def _lead(ex: Any) -> Any:
    """`ex` as the leader: it records what its step messages sent, and an executor never closed still stops
    its followers, when it is collected or at interpreter exit (a finalizer holding the process group,
    the workers and the rendezvous directory, not the executor; `shutdown` detaches it)."""
    ex.sent_pages = SentPages()
    ex.leader_finalizer = weakref.finalize(ex, _stop, ex.groups, ex.workers, ex.rendezvous)
    return ex


__all__ = ["launch", "one_rank", "worker_main", "follow", "send_step", "shutdown", "WorkerDied", "StepSeq", "SentPages",
           "step_seqs"]
