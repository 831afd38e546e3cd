"""Full CUDA graphs for decode: the whole forward plus logits and greedy token ids, one graph per
batch-size bucket.

The runner owns static inputs (token ids, positions, KV slots, page table) sized for the largest
bucket. A step fills them, pads the batch up to its bucket (padding rows decode a dummy token whose
KV goes to the reserved slot), lets the attention backend plan on the host, and replays. It knows
nothing about kernels: the plan/run contract of the attention backends is all it relies on.

Bucket `bs` reads its ids, positions and slots from the first 3 * bs entries of one int64 buffer
([3, bs] row-major) and its page table from the first bs rows of another, so a step sends its inputs
with at most two asynchronous copies from pinned staging buffers that live as long as the runner
(`HostStaging`; a step waits for the previous step's copies before refilling them). Only the page-table
rows that changed are rewritten and copied: in decode a sequence gains a page once every page_size tokens.
Each graph also writes every row's greedy token (`greedy_token_ids`) into a static buffer, so a step
whose rows are all greedy needs no kernel after the replay but the copy of the ids to the host (the
Engine's sampler reads them through `Executor.greedy_ids`). A negative input id -(r + 1) (the Engine's
async steps, `scheduler.async_steps`) stands for row r's token of the previous replay, its greedy id or
the id the sampler drew for it (`feed_ids`), gathered on the device before this replay, so a step can launch before the previous step's ids reach the host.
`EagerDecodeRunner` runs the same host path with an eager forward in place of each replay (CPU tests,
host-time measurements without CUDA).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import importlib.util
import math
import time
from typing import TYPE_CHECKING, Iterator

import torch

from pieceworks.config import ConfigError
from pieceworks.core.batch import ForwardMode, GraphMode, Sequence, StepMetadata
from pieceworks.core.context import ForwardContext, StepKernels, forward_context
from pieceworks.executor.inputs import take_previous_ids

if TYPE_CHECKING:
    from pieceworks.backends.registry import KernelTable
    from pieceworks.executor.kv_cache import KVPool


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: whether row i of [B, V] float `logits` holds neither NaN nor +-inf (as
    `isfinite(logits).all(-1)`, in one reading of the logits: aminmax propagates NaN, and NaN fails
    both comparisons)."""
    lo, hi = torch.aminmax(logits, dim=-1)
    return (hi < math.inf) & (lo > -math.inf)


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's argmax of [B, V] float `logits` (the first index on a tie), or -1 for a
    row that is not all finite. The decode graphs compute it inside the replay, the sampler eagerly:
    the same kernels on the same logits, so both give the same ids. CUDA float32 logits take the
    two Triton launches of `greedy_kernel` (where triton imports), the rest argmax and aminmax."""
    if _triton_greedy() and greedy_kernel_supported(logits):
        from pieceworks.executor import greedy_kernel

        return greedy_kernel.greedy_token_ids(logits)
    return torch.where(finite_rows(logits), logits.argmax(dim=-1), -1)


@functools.lru_cache(maxsize=None)
def _triton_greedy() -> bool:
    return importlib.util.find_spec("triton") is not None


def greedy_kernel_supported(logits: torch.Tensor) -> bool:
    """Whether `greedy_kernel` takes these logits: CUDA, 2-D float32 with unit column stride."""
    return (logits.is_cuda and logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
            and 0 < logits.shape[1] < 2**31 - 1)


def default_batch_sizes() -> list[int]:
    return [1, 2, 4, 8, 16] + list(range(24, 257, 8))


def check_batch_sizes(batch_sizes: list[int] | None, capacity_pages: int, page_size: int) -> None:
    """Every decode sequence holds at least one page: a bucket larger than the pool is a config error."""
    if batch_sizes and batch_sizes[-1] > capacity_pages:
        raise ConfigError(
            f"cuda_graph.decode.batch_sizes: {batch_sizes[-1]} sequences can't be in the KV pool at "
            f"once (it has {capacity_pages} pages of {page_size} tokens); lower the batch sizes or "
            "enlarge kv_cache.num_tokens"
        )


class HostStaging:
    """Host side of a decode step's inputs: pinned buffers the size of the largest bucket, filled in
    place, and the page-table rows the device table last received.

    `fill(bs, ids, positions, slots, pad_slot)` writes the [3, bs] int64 inputs of bucket `bs`
    (padding rows: id 0, position 1, `pad_slot`) and returns the host slice to copy. `table_rows(rows,
    fill)` brings the host table's first len(rows) rows to `rows` (one page list per bucket row) and
    returns `(start, host rows)`, the span of rows to copy to the device table's rows from `start` on,
    or None when the device table already holds them. Only the rows that changed are rewritten: in
    decode a sequence gains a page once every page_size tokens, so most steps change no row, and a
    step changes the few sequences that crossed a page boundary. The caller must not refill the
    buffers before the copies that read them have run (`DecodeGraphRunner.run` waits on an event).
    """

    def __init__(self, max_bs: int, width: int, pin: bool) -> None:
        self.inputs = torch.zeros(3 * max_bs, dtype=torch.int64, pin_memory=pin)
        self.table = torch.zeros(max_bs, width, dtype=torch.int32, pin_memory=pin)
        self.width = width
        self._inputs_np = self.inputs.numpy()
        self._table_np = self.table.numpy()
        self._rows: list[list[int]] = []  # what the device table's leading rows hold (and the host's)
        self._dirty = [width] * max_bs  # per host row: entries past it hold the fill value

    def fill(self, bs: int, ids: list[int], positions: list[int], slots: list[int],
             pad_slot: int) -> torch.Tensor:
        pad = bs - len(ids)
        # one list -> array conversion: cheaper than six slice stores at every batch size
        flat = ids + [0] * pad + positions + [1] * pad + slots + [pad_slot] * pad if pad else ids + positions + slots
        self._inputs_np[: 3 * bs] = flat
        return self.inputs[: 3 * bs]

    def table_rows(self, rows: list[list[int]], fill: int) -> tuple[int, torch.Tensor] | None:
        held = self._rows
        changed = [i for i, r in enumerate(rows) if i >= len(held) or r != held[i]]
        if not changed:
            return None
        table, dirty = self._table_np, self._dirty
        for i in changed:
            row = rows[i]
            n = len(row)
            if n > self.width:
                raise ValueError(f"a sequence has {n} pages, more than the table's width {self.width}")
            table[i, :n] = row
            if dirty[i] > n:
                table[i, n : dirty[i]] = fill
            dirty[i] = n
            if i < len(held):
                held[i] = list(row)
            else:
                held.append(list(row))  # rows are visited in order: i == len(held)
        start, stop = changed[0], changed[-1] + 1
        return start, self.table[start:stop]

    def forget_table(self) -> None:
        """The device table was written behind this object's back (graph capture)."""
        self._rows = []


@contextlib.contextmanager
def capture_session(device: torch.device, report: dict) -> Iterator[None]:
    """The frame of a runner's captures: the garbage collector paused (a collection inside a capture can run
    finalizers that free or allocate CUDA memory), then warm-up leftovers dropped; `report` gets the time taken
    and the memory left reserved (the graphs' pool)."""
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)
    t0 = time.perf_counter()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    report.update(capture_s=time.perf_counter() - t0, pool_bytes=torch.cuda.memory_reserved(device) - reserved_before)


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, table: "KernelTable", kv: "KVPool", max_context: int,
                 batch_sizes: list[int] | None, progress: bool = True) -> None:
        self.model, self.kernel_table, self.kv = model, table, kv
        self.page_size = kv.page_size
        capacity = kv.allocator.capacity
        check_batch_sizes(batch_sizes, capacity, kv.page_size)
        self.sizes = list(batch_sizes) if batch_sizes else [b for b in default_batch_sizes() if b <= capacity]
        max_bs = self.sizes[-1]
        self.width = -(-max_context // kv.page_size)  # pages per sequence in the static table
        dev = kv.device
        self.inputs = torch.zeros(3 * max_bs, dtype=torch.int64, device=dev)  # bucket bs: [3, bs]
        self.table = torch.zeros(max_bs, self.width, dtype=torch.int32, device=dev)
        self.staging = HostStaging(max_bs, self.width, pin=dev.type == "cuda")
        self._padding_row = [kv.reserved_slot // kv.page_size]  # padding sequences hold the reserved page
        # every step reads its bucket's views: made once (slicing and unbinding cost a few us a step)
        self._views = {bs: (*self.inputs[: 3 * bs].view(3, bs).unbind(), self.table[:bs]) for bs in self.sizes}
        self._copied: torch.cuda.Event | None = None  # recorded after a step's input copies
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> [bs, V] float32, static
        self.greedy: dict[int, torch.Tensor] = {}  # bucket -> [bs] int64 greedy_token_ids, static
        self._prev: torch.Tensor | None = None  # the last replay's greedy ids [n] (placeholder rows read them)
        self.report: dict[str, float] = {}
        self._capture_all(progress)

    def covers(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, slots) of bucket `bs`: rows of the first 3 * bs input entries."""
        return self._views[bs][:3]

    def _meta(self, bs: int, n: int, prefix_lens: list[int],
              page_lists: list[list[int]] | None = None) -> StepMetadata:
        """A decode step of `n` real sequences in bucket `bs`."""
        _, positions, slots, table = self._views[bs]
        return StepMetadata(
            mode=ForwardMode.DECODE, graph_mode=GraphMode.FULL, extend_lens=[1] * n,
            prefix_lens=prefix_lens, page_size=self.page_size, page_table=table,
            slot_mapping=slots, positions=positions, graph_batch_size=bs, page_lists=page_lists,
        )

    def _plan(self, kernels: StepKernels, meta: StepMetadata) -> None:
        for backend in (kernels.attention, kernels.mla):
            if backend is not None:
                backend.plan(meta)

    def _capture_all(self, progress: bool) -> None:
        from pieceworks.util import progress_bar

        model, kv = self.model, self.kv
        kernels = self.kernel_table.step(ForwardMode.DECODE, GraphMode.FULL)
        self.pool = torch.cuda.graph_pool_handle()
        self.report = {}
        with capture_session(kv.device, self.report):
            with progress_bar(progress, "capturing decode graphs", total=len(self.sizes)) as advance:
                for bs in reversed(self.sizes):
                    ids, positions, slots = self.views(bs)
                    ids.zero_()
                    positions.fill_(1)  # a dummy second token of each sequence
                    slots.fill_(kv.reserved_slot)
                    self.table[:bs].fill_(kv.reserved_slot // kv.page_size)
                    meta = self._meta(bs, bs, [1] * bs)
                    self._plan(kernels, meta)
                    with forward_context(ForwardContext(kernels, meta, kv)):
                        greedy_token_ids(model.compute_logits(model(ids, positions)))  # warm-up
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self.pool):
                            hidden = model(ids, positions)
                            self.logits[bs] = model.compute_logits(hidden)
                            self.greedy[bs] = greedy_token_ids(self.logits[bs])
                    self.graphs[bs] = graph
                    advance()
        self.staging.forget_table()

    def run(self, seqs: list[Sequence], tokens: list[list[int]],
            kernels: StepKernels) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket for this decode batch; returns (float32 logits [len(seqs), V], int64
        greedy token ids [len(seqs)]). The logits are the caller's; the ids are a view of the graph's
        static output, overwritten by the next replay."""
        n = len(seqs)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        ps = self.page_size
        reserved_slot = self.kv.reserved_slot
        positions = [len(s.tokens) for s in seqs]  # kv_len, without a property call per sequence
        rows = [s.pages for s in seqs]
        slots = [pages[p // ps] * ps + p % ps for pages, p in zip(rows, positions)]
        if bs > n:
            rows += [self._padding_row] * (bs - n)
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free once the last step's copies ran
        ids = [t[0] for t in tokens]
        host = self.staging.fill(bs, ids, positions, slots, reserved_slot)
        self.inputs[: 3 * bs].copy_(host, non_blocking=True)
        table = self.staging.table_rows(rows, reserved_slot // ps)
        if table is not None:
            start, host_rows = table
            self.table[start : start + host_rows.shape[0]].copy_(host_rows, non_blocking=True)
        if self._copied is None and self.kv.device.type == "cuda":
            self._copied = torch.cuda.Event()
        if self._copied is not None:
            self._copied.record()
        if self._prev is not None and min(ids) < 0:
            take_previous_ids(self.views(bs)[0], self._prev)
        meta = self._meta(bs, n, positions, rows)
        self._plan(kernels, meta)
        self.replay(bs, kernels, meta)
        self._prev = self.greedy[bs][:n]
        if n == bs:
            return self.logits[bs].clone(), self.greedy[bs]
        return self.logits[bs][:n].clone(), self.greedy[bs][:n]

    def feed_ids(self, ids: torch.Tensor) -> None:
        """The ids the next step's placeholder rows take (int64 [n] on the device, row r for the last
        step's row r): the sampler's tokens, in place of the replay's greedy ids (`Executor.feed_ids`)."""
        self._prev = ids

    def replay(self, bs: int, kernels: StepKernels, meta: StepMetadata) -> None:
        """Run bucket `bs` on the static inputs (planned with `meta`), leaving its logits in
        `self.logits[bs]` and its greedy ids in `self.greedy[bs]`."""
        self.graphs[bs].replay()

    def describe(self) -> dict:
        return {"batch_sizes": self.sizes, "graphs": len(self.graphs), **self.report}


class EagerDecodeRunner(DecodeGraphRunner):
    """The decode-graph runner's host path with an eager forward in place of each replay: the same
    buckets, static inputs, staging, padding and plans, on any device (CPU included), nothing captured.
    It lets CPU tests check that host path against plain eager steps, and `benchmarks/serving.py
    --host-overhead` measure the host time around a replay on a machine without CUDA."""

    def _capture_all(self, progress: bool) -> None:
        self.report = {"capture_s": 0.0, "pool_bytes": 0}

    def replay(self, bs: int, kernels: StepKernels, meta: StepMetadata) -> None:
        ids, positions, _ = self.views(bs)
        with forward_context(ForwardContext(kernels, meta, self.kv)):
            self.logits[bs] = self.model.compute_logits(self.model(ids, positions))
        self.greedy[bs] = greedy_token_ids(self.logits[bs])
