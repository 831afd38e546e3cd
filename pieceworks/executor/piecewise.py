"""Piecewise CUDA graphs for extend and mixed steps.

The model's forward is traced once by `torch.compile(fullgraph=True)` with the token dimension dynamic
and handed to `PiecewiseBackend` (`piecewise_split.py`), which splits the FX graph at the splitting ops
(`attention`, `mla`) keeping order. Every other piece is wrapped in a `PieceRunner`: on CUDA it holds one
CUDA graph per capture size (captured largest first, all pieces and sizes in one memory pool); on CPU it
runs the piece directly, so CI exercises the same split and dispatch. Attention runs eagerly between pieces
on the real tokens. A step's token count is padded up to the next capture size; padded tokens write
their KV to the pool's reserved slot and their outputs are dropped.

On CUDA, after capturing a size, a dummy step of that size replays through the traced code (Dynamo's
entry, the split graph's Python, each `PieceRunner`'s input check) and records what it called: every
piece's `graph.replay` and every attention call with its argument tensors, which are the captured pieces'
outputs and so the same objects on every replay. Steps of that size run the recording, a flat list of
bound calls; the host then spends per piece one replay call and, between pieces, the attention backend's
`forward` (K/V write and kernel launch).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from pieceworks.backends import driver
from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata
from pieceworks.core.context import ForwardContext, forward_context
from pieceworks.executor.piecewise_split import PiecewiseBackend

if TYPE_CHECKING:
    from pieceworks.backends.registry import KernelTable
    from pieceworks.config import PiecewiseConfig
    from pieceworks.executor.kv_cache import KVPool


def default_sizes(max_tokens: int) -> list[int]:
    """Dense at small sizes, sparser above: steps of 4 to 32, 16 to 256, 32 to 512, 64 to 1024,
    256 beyond; always ending at max_tokens."""
    sizes, size = [], 0
    for step, upto in ((4, 32), (16, 256), (32, 512), (64, 1024), (256, 1 << 30)):
        while size + step <= min(upto, max_tokens):
            size += step
            sizes.append(size)
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


_entries = itertools.count()


def _own_code_object(model: torch.nn.Module) -> Callable:
    """`model.forward` behind a function with a code object of its own.

    Dynamo caches compiled graphs per code object. Compiling `model.forward` directly would put every
    executor of a process (tests build many) on one code object, each one a recompile of the last, up
    to Dynamo's limit of 8; and skipping guard evaluation (see `_run`) is only safe when a code object
    has a single graph.
    """
    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.forward(input_ids, positions)

    # A copy of the code object (same file and lines, so Dynamo traces it as it is, without the
    # shared wrapper frame torch 2.11 puts around functions it has no source file for).
    forward.__code__ = forward.__code__.replace(co_name=f"piecewise_forward_{next(_entries)}")
    return forward


def _program(calls: list[tuple[Callable, tuple]], output: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A recorded step: the calls in order, then the step's output (the last piece's, at a fixed address)."""
    def run() -> torch.Tensor:
        for fn, args in calls:
            fn(*args)
        return output

    return run


class PiecewiseRunner:
    """Owns the compiled model, the capture sizes, the static inputs and the graph pool."""

    def __init__(self, model: torch.nn.Module, table: "KernelTable", kv: "KVPool", cfg: "PiecewiseConfig",
                 max_context: int, progress: bool = True) -> None:
        self.model, self.table, self.kv = model, table, kv
        # positions of the warm-up and capture steps stay below it: a capture size may exceed the
        # model's rope table (several sequences share a step), one sequence's positions may not
        self.max_context = max_context
        dev = kv.device
        self.sizes = list(cfg.sizes) if cfg.sizes else default_sizes(cfg.max_tokens)
        self.max_tokens = min(cfg.max_tokens, self.sizes[-1])
        self.sizes = [s for s in self.sizes if s <= self.max_tokens]
        self.use_graphs = dev.type == "cuda"
        self.phase = "direct"
        self.current_size = 0
        self.num_graphs = 0
        # size -> the recorded replay of a step of that size (see the module docstring)
        self.programs: dict[int, Callable[[], torch.Tensor]] = {}
        self.recording: list[tuple[Callable, tuple]] | None = None
        self.recordable = True
        self.backend = PiecewiseBackend(self)
        self.compiled = torch.compile(_own_code_object(model), backend=self.backend, fullgraph=True,
                                      dynamic=False)
        # token ids and positions, rows of one buffer: a step's two rows (`step_inputs` puts them side by
        # side) arrive in one copy
        self.static = torch.zeros(2, self.max_tokens, dtype=torch.int64, device=dev)
        self.static_ids, self.static_pos = self.static[0], self.static[1]
        self._static_rows: dict[int, torch.Tensor] = {}  # size -> static[:, :size]
        self._raw_rows: dict[int, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # weights never move: replays need not check their addresses
        self.fixed_ptrs = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.report: dict[str, float] = {}
        self._compile_and_capture(progress)

    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def release(self) -> None:
        """Drop the graphs, the pool, the recordings and every reference to the model and KV pool.
        torch.compile keeps each backend (and Dynamo the split graph it returned) for the life of the
        process, so the backend and the split graph's pieces must let go of them (`Executor.close`)."""
        self.backend.release()
        self.programs.clear()
        self.recording = None
        self.compiled = self.model = self.table = self.kv = self.pool = None
        self.static = self.static_ids = self.static_pos = None
        self._static_rows.clear()
        self._raw_rows.clear()
        self.fixed_ptrs = set()

    def padded_size(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the padded step (len(input_ids) is a capture size, the attention backends planned); returns
        hidden [size, H]."""
        size = input_ids.shape[0]
        if (positions.data_ptr() == input_ids.data_ptr() + 8 * size
                and input_ids.dtype == positions.dtype == torch.int64
                and input_ids.is_contiguous() and positions.is_contiguous()):
            if driver.LEAN and self.static.is_cuda:
                pair = self._raw_rows.get(size)
                if pair is None:
                    pair = self._raw_rows[size] = (driver.Copy(self.static_ids, None, 8 * size),
                                                   driver.Copy(self.static_pos, None, 8 * size))
                stream, src = driver.raw_stream(self.static.device), input_ids.data_ptr()
                pair[0](stream, src)
                pair[1](stream, src + 8 * size)
            else:
                rows = self._static_rows.get(size)
                if rows is None:
                    rows = self._static_rows[size] = self.static[:, :size]
                rows.copy_(input_ids.as_strided((2, size), (size, 1)))
        else:
            self.static_ids[:size].copy_(input_ids)
            self.static_pos[:size].copy_(positions)
        program = self.programs.get(size)
        if program is not None:
            return program()
        self.current_size = size
        if not self.use_graphs:
            self.phase = "direct"
            return self._run(size)
        return self._record(size)

    def _record(self, size: int) -> torch.Tensor:
        """Replay a step of `size` through the traced code, keeping its calls as that size's program."""
        self.phase = "replay"
        self.recording, self.recordable = [], self.backend.recordable
        try:
            hidden = self._run(size)
        finally:
            calls, self.recording = self.recording, None
        if self.recordable and self.backend.num_compiles == 1:
            self.programs[size] = _program(calls, hidden)
        return hidden

    def _run(self, size: int) -> torch.Tensor:
        ids, pos = self.static_ids[:size], self.static_pos[:size]
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        if self.backend.num_compiles == 0:
            return self.compiled(ids, pos)
        # Traced once, always called the same way (static buffers, the same weights): only the guards
        # that tell compiled graphs apart need to run, and there is one graph: the weights' guards are
        # not evaluated on every step.
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self.compiled(ids, pos)

    # ------------------------------------------------------------------ build
    def _compile_and_capture(self, progress: bool) -> None:
        """Trace once (a dummy step at the smallest size), then on CUDA capture every size, largest
        first, each after one warm-up run, and record its program (so that no request pays the
        recording step's host time, about 5 ms on the H200 machine for the Llama-3.1-8B shape), with the
        garbage collector paused."""
        t0 = time.perf_counter()
        self._dummy_step(self.sizes[0], "direct")
        self.report["compile_s"] = time.perf_counter() - t0
        if not self.use_graphs:
            return
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.kv.device)
        t1 = time.perf_counter()
        from pieceworks.util import progress_bar

        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with progress_bar(progress, "capturing piecewise graphs", total=len(self.sizes)) as advance:
                for size in reversed(self.sizes):
                    self._dummy_step(size, "direct")  # warm-up
                    self._dummy_step(size, "capture")
                    self._dummy_step(size, "record")
                    advance()
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize(self.kv.device)
        self.report["capture_s"] = time.perf_counter() - t1
        torch.cuda.empty_cache()  # drop warm-up leftovers; what stays reserved is the graphs' pool
        self.report["pool_bytes"] = torch.cuda.memory_reserved(self.kv.device) - reserved_before

    def _dummy_step(self, size: int, phase: str) -> None:
        """A one-sequence extend of `size` tokens whose KV all goes to the reserved page, run `phase`
        "direct" (the pieces as code), "capture" (into the size's graphs) or "record" (`_record`)."""
        kv = self.kv
        ps = kv.page_size
        reserved = kv.reserved_slot // ps
        dev = kv.device
        meta = StepMetadata(
            mode=ForwardMode.EXTEND, graph_mode=GraphMode.PIECEWISE, extend_lens=[size], prefix_lens=[0],
            page_size=ps, page_table=torch.full((1, -(-size // ps)), reserved, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((size,), kv.reserved_slot, dtype=torch.int64, device=dev),
            positions=torch.arange(size, device=dev) % self.max_context,
        )
        kernels = self.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)
        for backend in (kernels.attention, kernels.mla):
            if backend is not None:
                backend.plan(meta)
        self.static_ids[:size].zero_()
        self.static_pos[:size].copy_(meta.positions)
        self.current_size = size
        self.phase = phase
        with forward_context(ForwardContext(kernels, meta, kv)):
            if phase == "record":
                self._record(size)
            else:
                self._run(size)
        self.phase = "direct"

    def describe(self) -> dict[str, Any]:
        """Numbers for `pieceworks run` / `pieceworks backends` and the capture report."""
        return {
            "sizes": self.sizes, "max_tokens": self.max_tokens, "graphs": self.num_graphs,
            "pieces": len(self.backend.pieces), "splitting_ops": getattr(self.backend, "num_splitting", 0),
            "unique_pieces": self.backend.unique_pieces(), "compiles": self.backend.num_compiles,
            **self.report,
        }
