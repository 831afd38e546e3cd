"""Full CUDA graphs for decode: the whole forward plus logits, one graph per batch-size bucket.

The runner owns static inputs (token ids, positions, KV slots, page table) sized for the largest
bucket. A step fills them, pads the batch up to its bucket (padding rows decode a dummy token whose
KV goes to the reserved slot), lets the attention backend plan on the host, and replays. It knows
nothing about kernels: the plan/run contract of the attention backends is all it relies on.
"""

from __future__ import annotations

import bisect
import gc
import time
from typing import TYPE_CHECKING

import torch

from pieceworks.config import ConfigError
from pieceworks.executor.batch import ForwardMode, GraphMode, Sequence, StepMetadata
from pieceworks.executor.context import ForwardContext, StepKernels, forward_context
from pieceworks.executor.runner import page_table

if TYPE_CHECKING:
    from pieceworks.executor.runner import Executor


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


class DecodeGraphRunner:
    def __init__(self, ex: "Executor", batch_sizes: list[int] | None, progress: bool = True) -> None:
        self.ex = ex
        capacity = ex.kv.allocator.capacity
        check_batch_sizes(batch_sizes, capacity, ex.page_size)
        self.sizes = list(batch_sizes) if batch_sizes else [b for b in default_batch_sizes() if b <= capacity]
        max_bs = self.sizes[-1]
        self.width = -(-ex.max_context // ex.page_size)  # pages per sequence in the static table
        dev = ex.device
        self.ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_bs,), ex.kv.reserved_slot, dtype=torch.int64, device=dev)
        self.table = torch.zeros(max_bs, self.width, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.report: dict[str, float] = {}
        self._capture_all(progress)

    def covers(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def _meta(self, bs: int, seq_lens: list[int], prefix_lens: list[int]) -> StepMetadata:
        return StepMetadata(
            mode=ForwardMode.DECODE, graph_mode=GraphMode.FULL, extend_lens=[1] * len(seq_lens),
            prefix_lens=prefix_lens, page_size=self.ex.page_size, page_table=self.table[:bs],
            slot_mapping=self.slots[:bs], positions=self.positions[:bs], graph_batch_size=bs,
        )

    def _plan(self, kernels: StepKernels, meta: StepMetadata) -> None:
        for backend in (kernels.attention, kernels.mla):
            if backend is not None:
                backend.plan(meta)

    def _capture_all(self, progress: bool) -> None:
        from pieceworks.util import progress_bar

        ex = self.ex
        kernels = ex.table.step(ForwardMode.DECODE, GraphMode.FULL)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(ex.device)
        t0 = time.perf_counter()
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            with progress_bar(progress, "capturing decode graphs", total=len(self.sizes)) as advance:
                for bs in reversed(self.sizes):
                    self.ids[:bs].zero_()
                    self.positions[:bs].fill_(1)  # a dummy second token of each sequence
                    self.slots[:bs].fill_(ex.kv.reserved_slot)
                    self.table[:bs].fill_(ex.kv.reserved_slot // ex.page_size)
                    meta = self._meta(bs, [1] * bs, [1] * bs)
                    self._plan(kernels, meta)
                    with forward_context(ForwardContext(kernels, meta, ex.kv)):
                        ex.model.compute_logits(ex.model(self.ids[:bs], self.positions[:bs]))  # warm-up
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self.pool):
                            hidden = ex.model(self.ids[:bs], self.positions[:bs])
                            self.logits[bs] = ex.model.compute_logits(hidden)
                    self.graphs[bs] = graph
                    advance()
        finally:
            if was_enabled:
                gc.enable()
        torch.cuda.synchronize(ex.device)
        torch.cuda.empty_cache()  # drop warm-up leftovers; what stays reserved is the graphs' pool
        self.report = {"capture_s": time.perf_counter() - t0,
                       "pool_bytes": torch.cuda.memory_reserved(ex.device) - reserved_before}

    def run(self, seqs: list[Sequence], tokens: list[list[int]], kernels: StepKernels) -> torch.Tensor:
        """Replay the bucket for this decode batch; returns float32 logits [len(seqs), V]."""
        ex = self.ex
        n = len(seqs)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        ps = ex.page_size
        positions = [s.kv_len for s in seqs]
        slots = [s.pages[p // ps] * ps + p % ps for s, p in zip(seqs, positions)]
        reserved_page = ex.kv.reserved_slot // ps
        table = page_table(seqs, self.width, fill=reserved_page)
        pad = bs - n
        self.ids[:bs].copy_(torch.tensor([t[0] for t in tokens] + [0] * pad))
        self.positions[:bs].copy_(torch.tensor(positions + [1] * pad))
        self.slots[:bs].copy_(torch.tensor(slots + [ex.kv.reserved_slot] * pad))
        self.table[:n].copy_(table)
        self.table[n:bs].fill_(reserved_page)
        self._plan(kernels, self._meta(bs, [p + 1 for p in positions], positions))
        self.graphs[bs].replay()
        return self.logits[bs][:n].clone()

    def describe(self) -> dict:
        return {"batch_sizes": self.sizes, "graphs": len(self.graphs), **self.report}
