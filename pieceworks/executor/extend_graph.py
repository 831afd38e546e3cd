"""Full CUDA graphs for extend and mixed steps: the whole forward of a step of up to T tokens over up to
`max_seqs` sequences replayed from one graph per token bucket T (`cuda_graph.extend`).

A piecewise step replays the pieces between attention calls and runs attention eagerly, after a plan on
the host; its host work at the step's head leaves the GPU idle (docs/benchmarks.md, "where the piecewise -
whole gap goes"). Here nothing runs between replays: the step's inputs go into static buffers in one copy
(token ids, positions, KV slots, the rows whose logits it returns, each sequence's query offsets and KV lengths
for the attention backend, `StepMetadata.extend_index`, and the page table), and one replay runs every layer.
That needs an attention backend whose kernels take any layout of up to T tokens over up to `max_seqs` sequences
from device buffers with a launch fixed at capture (`full_extend`; attention.triton_all: its extend kernel finds
each query block's sequence on the device). The registry picks the kernel table's (extend / mixed, FULL) entries
among the backends that declare themselves safe there, so `auto` takes attention.triton_all for these graphs and
FlashInfer for piecewise and eager steps.

Padded tokens (past the step's own) belong to no sequence: their K/V go to the reserved slot, their attention
rows are zeroed by the backend, and their logits are never read. The graphs return each sequence's last
token's logits, or as many rows as the bucket computes (min(t, max_seqs)) for steps that ask for every token's
of some sequences (speculative verification, prompt logprobs of short prompts); steps asking for more run
piecewise. `EagerExtendRunner` runs the same host path with an eager forward in place of each replay (CPU tests).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pieceworks.config import Switch
from pieceworks.core.batch import ForwardMode, GraphMode, Sequence, StepMetadata, extend_index
from pieceworks.core.context import ForwardContext, forward_context
from pieceworks.executor.inputs import logit_rows, page_table, take_previous_ids, token_rows

if TYPE_CHECKING:
    from pieceworks.backends.registry import KernelTable
    from pieceworks.executor.kv_cache import KVPool


def default_sizes(max_tokens: int) -> list[int]:
    return [t for t in (16, 32, 64, 128, 256, 512) if t <= max_tokens] or [max_tokens]


def unsupported(table: "KernelTable") -> str | None:
    """Why extend steps can't run in full graphs with this kernel table, or None. The registry fills the table's
    (extend / mixed, FULL) entries with backends safe there (attention and mla: `full_extend`)."""
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        if not table.graph_mode_ok(mode, GraphMode.FULL):
            return (f"{table.graph_unavailable[(mode, GraphMode.FULL)]} (attention.triton_all is, on bf16 / fp16 KV "
                    "pools; MLA has none)")
    if table.step(ForwardMode.EXTEND, GraphMode.FULL) != table.step(ForwardMode.MIXED, GraphMode.FULL):
        return "extend and mixed steps have different backends"
    return None


def why_off(ext: Any, cuda: bool, tensor_parallel: bool, table: "KernelTable | None") -> str | None:
    """Why `cuda_graph.extend` (`ext`, not switched off) builds no graphs here, or None: the executor's build and the
    graph report ask the same."""
    if tensor_parallel and ext.enabled is Switch.auto:
        return "auto leaves them off under tensor parallelism (on switches them on)"
    if not cuda:
        return "need CUDA"
    return unsupported(table) if table is not None else None


class ExtendGraphRunner:
    GRAPH = GraphMode.FULL  # the kernel table's entries it runs

    def __init__(self, model: torch.nn.Module, table: "KernelTable", kv: "KVPool", max_context: int,
                 sizes: list[int], max_seqs: int, progress: bool = True) -> None:
        self.model, self.kv = model, kv
        self.kernels = table.step(ForwardMode.EXTEND, self.GRAPH)
        self.page_size = kv.page_size
        self.sizes, self.max_seqs = sorted(sizes), max_seqs
        self.width = -(-max_context // kv.page_size)
        # One int64 buffer on each side, a step's inputs sent in one copy: token rows [3, top] (ids, positions, slots),
        # the rows whose logits the step returns [max_seqs], the attention backend's index (int32 query offsets then KV
        # lengths, `StepMetadata.extend_index`) and the page table (int32 [max_seqs, width]) last, so that a step
        # copies only its own sequences' rows of it.
        top, s, w = self.sizes[-1], max_seqs, self.width
        self._at_index = 3 * top + s
        self._at_table = self._at_index + -(-(2 * s + 1) // 2)
        size = self._at_table + -(-s * w // 2)
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=kv.device.type == "cuda")
        self._dev = torch.zeros(size, dtype=torch.int64, device=kv.device)
        self.inputs, self.last, self.index, self.table = self._views(self._dev)
        self._bucket_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._h_rows, self._h_last, self._h_index, self._h_table = (t.numpy() for t in self._views(self._host))
        self._copied: torch.cuda.Event | None = None  # recorded after a step's copy: the staging buffer is free again
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.report: dict[str, float] = {}
        self._capture_all(progress)

    def covers(self, num_seqs: int, num_tokens: int, num_rows: int | None = None) -> bool:
        """Whether a step fits: at most max_seqs sequences and the largest bucket's tokens, and its logits rows (each
        sequence's last, or `num_rows` where it wants more) within those its bucket computes (`seqs`)."""
        if num_seqs > self.max_seqs or num_tokens > self.sizes[-1]:
            return False
        return num_rows is None or num_rows <= self.seqs(self.padded_size(num_tokens))

    def padded_size(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def takes(self, num_seqs: int, num_tokens: int, piecewise_size: int | None, num_rows: int | None = None) -> bool:
        """Whether a step runs here: it fits (`covers`), and piecewise graphs (padding it to `piecewise_size`, None
        where they don't take it) would not pad it less."""
        return self.covers(num_seqs, num_tokens, num_rows) and (piecewise_size is None
                                                                or self.padded_size(num_tokens) <= piecewise_size)

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token rows [3, top], last rows [max_seqs], index int32 [2 max_seqs + 1], table int32 [max_seqs, width])."""
        top, s, w = self.sizes[-1], self.max_seqs, self.width
        return (buf[: 3 * top].view(3, top), buf[3 * top: self._at_index],
                buf[self._at_index: self._at_table].view(torch.int32)[: 2 * s + 1],
                buf[self._at_table:].view(torch.int32)[: s * w].view(s, w))

    def seqs(self, t: int) -> int:
        """Sequences the bucket of t tokens holds, and the logits rows it computes: each sequence has a token of the
        step, so at most t (fewer logits rows and attention programs in the small buckets)."""
        return min(t, self.max_seqs)

    def _bucket(self, t: int) -> tuple[torch.Tensor, ...]:
        """The bucket's views of the device inputs (ids, positions, slots, page table, extend index, logits rows),
        made once. With them (and no numpy call on a bool `all_logits`) a step's host work, its plan and replay left
        out, takes 26.5 us against 40 for one 16-token sequence on the CPU machine, 74-77 against 91-92 for 33
        sequences (256 + 32 tokens), alternated."""
        views = self._bucket_views.get(t)
        if views is None:
            s = self.seqs(t)
            views = self._bucket_views[t] = (*self.inputs[:, :t], self.table[:s], self.index[: 2 * s + 1],
                                             self.last[:s])
        return views

    def _meta(self, mode: ForwardMode, t: int, extend_lens: list[int], prefix_lens: list[int]) -> StepMetadata:
        _, positions, slots, table, index, _ = self._bucket(t)
        return StepMetadata(mode=mode, graph_mode=GraphMode.FULL, extend_lens=extend_lens, prefix_lens=prefix_lens,
                            page_size=self.page_size, page_table=table, slot_mapping=slots,
                            positions=positions, graph_batch_size=self.seqs(t), extend_index=index)

    def _plan(self, meta: StepMetadata) -> None:
        self.kernels.attention.plan(meta)

    def _forward(self, t: int, meta: StepMetadata) -> torch.Tensor:
        ids, positions, _, _, _, last = self._bucket(t)
        with forward_context(ForwardContext(self.kernels, meta, self.kv)):
            hidden = self.model(ids, positions)
            return self.model.compute_logits(hidden.index_select(0, last))

    def _dummy(self, t: int) -> StepMetadata:
        """Capture inputs: one sequence of t tokens over the reserved page (every write and read lands there)."""
        kv = self.kv
        self.inputs[0, :t].zero_()
        self.inputs[1, :t].copy_(torch.arange(t, device=kv.device))
        self.inputs[2, :t].fill_(kv.reserved_slot)
        self.table.fill_(kv.reserved_slot // kv.page_size)
        self.last.fill_(t - 1)
        s = self.seqs(t)
        self.index[: 2 * s + 1].copy_(extend_index([t], [t], s))
        return self._meta(ForwardMode.EXTEND, t, [t], [0])

    def _capture_all(self, progress: bool) -> None:
        from pieceworks.executor.cuda_graph import capture_session
        from pieceworks.util import progress_bar

        self.pool = torch.cuda.graph_pool_handle()
        self.report = {}
        with capture_session(self.kv.device, self.report):
            with progress_bar(progress, "capturing extend graphs", total=len(self.sizes)) as advance:
                for t in reversed(self.sizes):
                    meta = self._dummy(t)
                    self._plan(meta)
                    self._forward(t, meta)  # warm-up
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self.logits[t] = self._forward(t, meta)
                    self.graphs[t] = graph
                    advance()

    def run(self, mode: ForwardMode, seqs: list[Sequence], tokens: list[list[int]],
            prev_ids: torch.Tensor | None, all_logits: bool | list[bool] = False) -> torch.Tensor:
        """float32 logits [len(seqs), V] of each sequence's last new token, or with `all_logits` the rows
        `inputs.logit_rows` names (every token's of the sequences it marks; as many as `covers` allows);
        `prev_ids`: the ids that placeholder tokens -(r + 1) stand for (the Engine's async steps)."""
        b = len(seqs)
        counts = np.fromiter(map(len, tokens), dtype=np.int64, count=b)
        ends = np.cumsum(counts)
        n = int(ends[-1])
        t = self.padded_size(n)
        s = self.seqs(t)  # >= b: every sequence has a token of the step
        kv_lens = [q.kv_len for q in seqs]
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the staging buffer
        table = self._h_table[:b]
        page_table([q.pages for q in seqs], self.width, out=table)
        token_rows(tokens, kv_lens, table, self.page_size, t, self.kv.reserved_slot, out=self._h_rows[:, :t])
        every = all_logits if isinstance(all_logits, bool) else any(all_logits)
        rows = logit_rows(tokens, all_logits, torch.device("cpu")).numpy() if every else ends - 1
        r = len(rows)  # <= s (`covers`)
        self._h_last[:r] = rows
        self._h_last[r:s] = 0  # rows past the step's read row 0 (an earlier, larger bucket's rows may not exist)
        index = self._h_index  # the bucket's layout: query offsets [s + 1], then KV lengths [s]
        index[0] = 0
        index[1: b + 1] = ends
        index[b + 1: s + 1] = n
        index[s + 1: s + 1 + b] = counts + kv_lens
        index[s + 1 + b: 2 * s + 1] = 0
        stop = self._at_table + -(-b * self.width // 2)
        self._dev[:stop].copy_(self._host[:stop], non_blocking=True)
        if self.kv.device.type == "cuda":
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()
        if prev_ids is not None and any(tk and tk[-1] < 0 for tk in tokens):
            take_previous_ids(self.inputs[0, :t], prev_ids)
        meta = self._meta(mode, t, counts.tolist(), kv_lens)
        self._plan(meta)
        self.replay(t, meta)
        return self.logits[t][:r].clone()

    def replay(self, t: int, meta: StepMetadata) -> None:
        self.graphs[t].replay()

    def describe(self) -> dict:
        return {"sizes": self.sizes, "max_seqs": self.max_seqs, "graphs": len(self.graphs), **self.report}


class EagerExtendRunner(ExtendGraphRunner):
    """The extend-graph runner's host path with an eager forward in place of each replay: the same buckets,
    static inputs, padding and plans, on any device and with the piecewise entries' backends (CPU tests)."""

    GRAPH = GraphMode.PIECEWISE

    def _capture_all(self, progress: bool) -> None:
        self.report = {"capture_s": 0.0, "pool_bytes": 0}

    def replay(self, t: int, meta: StepMetadata) -> None:
        self.logits[t] = self._forward(t, meta)


__all__ = ["ExtendGraphRunner", "EagerExtendRunner", "default_sizes", "unsupported"]
