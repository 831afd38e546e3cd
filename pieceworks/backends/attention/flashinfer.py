"""FlashInfer paged GQA attention: the prefill wrapper for extend/mixed steps, the decode wrapper for
decode steps (CUDA-core or tensor-core kernels, `decode_tensor_cores`), and one CUDA-graph
decode wrapper per graph batch size for FULL graphs.

`plan(meta)` turns the step's pages into FlashInfer's CSR form (`paged_kv_indices`: from the host page
lists when the step carries them, else from the page table) and plans on the host once per step, for
all layers; `forward` only writes K/V and launches the kernel,
so it is capturable. The CSR helpers here are shared with the FlashInfer MLA backend. Extend and mixed
steps plan and launch through `flashinfer_fast.py` (FastPlan, FastRun) around FlashInfer's Python.

Sliding windows and soft caps (Gemma 2 / 3) go into the plan (`window_left` = W - 1, `logits_soft_cap`):
FlashInfer schedules a plan for one window, so the layers of each further window value take a lane of their
own, a backend of this class with its own wrappers, planned with the step (the workspace is shared: the lanes'
kernels run one after another on one stream). Models without windows have one lane, the backend itself. A
windowed lane plans each sequence without the pages wholly before its window (`window_view`).

An FP8 pool (`kv_fp8`) plans with `kv_data_type` float8_e4m3fn and runs every layer with its k_scale / v_scale
(FlashInfer folds k_scale into the softmax scale and multiplies the output by v_scale). FlashInfer's fa3 kernels
take FP8 K/V only with FP8 queries, so such a pool runs fa2 (`auto`; fa3 named is refused); FastRun sets each layer's
scales in its recorded call (`FastRun.scale_at`).

The softmax scale reaches a backend with every `forward`, but FlashInfer takes it at plan time. It is a
model constant: the backend plans with the last scale it was given (head_dim^-0.5 before the first
forward) and re-plans eagerly if a forward brings another one. Graph runners run one eager warm-up
forward before capturing, so a capture never sees a new scale (if it did, that is an error).

flashinfer is imported inside methods only, so `import pieceworks` never loads it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pieceworks.backends.attention.base import AttentionBackend, gqa_kernel_reasons
from pieceworks.backends.attention.flashinfer_fast import FastPlan, FastRun, PlanCopyGuard, flat_pages, run_scales
from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.kv_write import bind_rows
from pieceworks.core.batch import ForwardMode, GraphMode, is_replayed, to_device
from pieceworks.core.kv import KV_FP8

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)
GPU_INSTALL_HINT = "pip install 'pieceworks[gpu]'"
log = logging.getLogger("pieceworks.flashinfer")


@dataclass(frozen=True)
class FlashInferOptions:
    """`backends.options.flashinfer` (shared by the attention and MLA backends)."""

    variant: str = "auto"
    """FlashInfer kernel generation: fa2, fa3 (Hopper only), or auto (fa3 on sm_90, fa2 elsewhere)."""

    decode_tensor_cores: bool | str = "auto"
    """GQA decode through FlashInfer's tensor-core (prefill) kernels of `variant` (true) or its CUDA-core
    decode kernel (false); auto (the default): tensor cores when more than 4 query heads share a KV
    head. Measured on the H200 (Llama-3.1-8B shape, 4 query heads per KV head, 512-token contexts):
    the CUDA-core kernel made full-graph NVFP4 decode replays 1%, 7% and 21% faster at batch 1, 8 and
    32 (docs/benchmarks.md). MLA ignores it."""

    fast_plan: bool = True
    """Extend/mixed steps plan through `FastPlan` (FlashInfer's planner called directly, the index arrays
    sent with one copy) once one public `plan()` has shown the call's form, and MLA steps through
    `FastMLAPlan` likewise; false: FlashInfer's public `plan()` on every step."""

    def __post_init__(self) -> None:
        if self.variant not in ("auto", "fa2", "fa3"):
            raise ValueError(f"backends.options.flashinfer.variant: {self.variant!r}; use auto, fa2 or fa3")
        if self.decode_tensor_cores not in (True, False, "auto"):
            raise ValueError("backends.options.flashinfer.decode_tensor_cores must be true, false or auto, "
                             f"got {self.decode_tensor_cores!r}")
        if not isinstance(self.fast_plan, bool):
            raise ValueError(f"backends.options.flashinfer.fast_plan must be true or false, got {self.fast_plan!r}")


def resolve_decode_tensor_cores(option: bool | str, model) -> bool:
    """`decode_tensor_cores`: auto is tensor cores for more than 4 query heads per KV head."""
    if option == "auto":
        return model.num_heads // max(1, model.num_kv_heads) > 4
    return bool(option)


def resolve_variant(variant: str, capability: tuple[int, int] | None, kv_fp8: bool = False) -> str:
    """The FlashInfer variant to run: `auto` is fa3 on Hopper (sm_90), fa2 elsewhere and for an FP8 pool (fa3's
    kernels read FP8 K/V only with FP8 queries)."""
    hopper = capability is not None and capability[0] == 9
    if variant == "fa3" and kv_fp8:
        raise ValueError("backends.options.flashinfer.variant=fa3: FlashInfer's fa3 kernels read an FP8 KV cache "
                         "only with FP8 queries; use fa2 or auto (fa2), or kv_cache.dtype: model")
    if variant == "auto":
        return "fa3" if hopper and not kv_fp8 else "fa2"
    if variant == "fa3" and not hopper:
        cap = "none" if capability is None else ".".join(map(str, capability))
        raise ValueError(
            f"backends.options.flashinfer.variant=fa3 needs a Hopper GPU (sm_90); this GPU: {cap}. "
            "Use fa2 or auto"
        )
    return variant


class PagedKV(NamedTuple):
    """A page table in FlashInfer's CSR form (B planned sequences).

    indptr: [B + 1] int32 (host); indices: [indptr[-1]] int32 (on the page table's device);
    last_page_len: [B] int32 (host), in 1..page_size; kv_lens: [B] int32 (host).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor


def paged_kv_indices(page_table: torch.Tensor, kv_lens: list[int], page_size: int,
                     page_lists: list[list[int]] | None = None) -> PagedKV:
    """Convert a dense page table into FlashInfer's paged-KV CSR arrays, without a device sync.

    Args:
        page_table: [B, P] int32 page ids per sequence (any device); row i's first
            ceil(kv_lens[i] / page_size) entries are used.
        kv_lens: [B] KV length of every sequence after the step (each >= 1).
        page_size: tokens per page.
        page_lists: the same pages as host lists, when the caller has them: the CSR arrays are then
            built in Python and the indices sent with one asynchronous copy from pinned memory
            (a few microseconds per step instead of a dozen small torch ops and two kernels).
    """
    if page_table.shape[0] != len(kv_lens):
        raise ValueError(f"page table has {page_table.shape[0]} rows for {len(kv_lens)} sequences")
    width = page_table.shape[1]
    counts = [-(-n // page_size) for n in kv_lens]
    if counts and max(counts) > width:
        raise ValueError(f"a sequence needs {max(counts)} pages; the page table holds {width}")
    # small int32 host arrays through numpy: ~1.5 us each against ~4 for torch.tensor (2-core CPU); plans run every step
    lens = torch.from_numpy(np.array(kv_lens, dtype=np.int32))
    last = torch.from_numpy(np.array([n - (c - 1) * page_size for n, c in zip(kv_lens, counts)], dtype=np.int32))
    if page_lists is not None:
        indices = to_device(torch.from_numpy(flat_pages(page_lists, counts)), page_table.device)
        ptr = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, dtype=np.int32, out=ptr[1:])
        return PagedKV(torch.from_numpy(ptr), indices, last, lens)
    num_pages = torch.tensor(counts, dtype=torch.int64)
    indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int64)
    torch.cumsum(num_pages, 0, out=indptr[1:])
    # Gather positions in the flattened table, built on the host: indexing the device table with them
    # needs no device->host copy (a boolean mask would).
    rows = torch.repeat_interleave(torch.arange(len(kv_lens)), num_pages)
    cols = torch.arange(int(indptr[-1])) - torch.repeat_interleave(indptr[:-1], num_pages)
    flat = (rows * width + cols).to(page_table.device, non_blocking=True)
    indices = page_table.reshape(-1).index_select(0, flat).to(torch.int32)
    return PagedKV(indptr.to(torch.int32), indices, last, lens)


def window_view(meta, window: int):
    """The step as a layer of sliding window `window` sees it: each sequence without the pages wholly before the
    first key its earliest new query sees, its KV length shorter by as many tokens, so the kernels read no page
    outside the window. The attention is the same: K/V are cached roped, and FlashInfer aligns every sequence's
    queries to the end of its KV. Only the host page lists are cut (FlashInfer plans from them), so a step
    without them stays whole; padding sequences of FULL graphs (past the real ones) stay as they are."""
    if meta.page_lists is None:
        return meta
    ps = meta.page_size
    drop = [max(0, p - window + 1) // ps for p in meta.prefix_lens]
    if not any(drop):
        return meta
    lists = [pages[d:] for pages, d in zip(meta.page_lists, drop)] + meta.page_lists[len(drop):]
    return dataclasses.replace(meta, prefix_lens=[p - d * ps for p, d in zip(meta.prefix_lens, drop)],
                               page_lists=lists, _cache={})


def step_lengths(meta) -> tuple[list[int], list[int]]:
    """(new tokens, KV length) of every sequence the kernels are planned for.

    In FULL decode graphs the batch is padded to `meta.graph_batch_size` with length-1 dummy sequences
    (their page-table rows point at the reserved page), so every replay plans the captured shape.
    """
    pad = (meta.graph_batch_size or meta.num_seqs) - meta.num_seqs
    return list(meta.extend_lens) + [1] * pad, list(meta.seq_lens) + [1] * pad


def qo_indptr(qo_lens: list[int]) -> torch.Tensor:
    """[B + 1] int32 host offsets of every sequence's new tokens."""
    out = np.zeros(len(qo_lens) + 1, dtype=np.int32)
    np.cumsum(np.array(qo_lens, dtype=np.int32), out=out[1:])
    return torch.from_numpy(out)


def workspace(backend, device, nbytes: int = WORKSPACE_BYTES) -> torch.Tensor:
    """The backend's FlashInfer workspace (`backend._workspace`), zero-filled on first use and kept."""
    if backend._workspace is None:
        backend._workspace = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return backend._workspace


def check_capture_scale(backend, scale: float) -> bool:
    """Whether `scale` differs from the planned softmax scale; raises if it does while capturing."""
    if scale == backend._sm_scale:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{backend.key()}: softmax scale {scale} differs from the planned {backend._sm_scale} while a "
            "CUDA graph is being captured; run one eager forward before capturing"
        )
    return True


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    priority = 100
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), min_capability=(8, 0), modules=("flashinfer",),
                            install_hint=GPU_INSTALL_HINT)
    Options = FlashInferOptions
    description = "FlashInfer paged prefill + tensor-core decode (fa2/fa3), CUDA-graph decode wrappers"
    windows = softcap = fp8_kv = True

    @classmethod
    def check(cls, spec):
        return super().check(spec) + gqa_kernel_reasons(spec.model, "FlashInfer kernels")

    def __init__(self, spec, options=None, *, window: int | None = None, root=None) -> None:
        """`window` and `root` build a lane: the backend of `root` for the layers of sliding window `window`."""
        super().__init__(spec, options)
        self.variant = resolve_variant(self.options.variant, spec.capability, spec.model.kv_fp8)
        self.decode_tensor_cores = resolve_decode_tensor_cores(self.options.decode_tensor_cores, spec.model)
        self._sm_scale = spec.model.head_dim**-0.5
        self._workspace: torch.Tensor | None = None
        self._prefill = self._decode = None
        self._graph_decode: dict[int, object] = {}
        self._meta = None
        self._wrapper = None
        self._rows = 0
        self._views: dict[int, tuple] = {}
        self._bound: dict[int, tuple] = {}
        self._fast: FastRun | None = None
        self._fast_plan: FastPlan | None = None
        self._fast_plan_refused = False  # a recorded public plan had another form: no more tries
        self._plan_guard = PlanCopyGuard()
        self._root = root or self  # whose workspace the wrappers share
        windows = sorted(set(spec.model.sliding_windows)) or [0]
        self._window = windows[0] if window is None else window
        self._lanes = {} if root is not None else {
            w: type(self)(spec, self.options, window=w, root=self) for w in windows[1:]}
        self._lane_of = {i: self._lanes[w] for i, w in enumerate(spec.model.sliding_windows) if w in self._lanes}

    # ------------------------------------------------------------------ plan (host)
    def plan(self, meta) -> None:
        for lane in self._lanes.values():
            lane.plan(meta)
        if self._window:
            meta = window_view(meta, self._window)
        self._meta = meta
        qo_lens, kv_lens = step_lengths(meta)
        self._rows = sum(qo_lens)
        if meta.mode is ForwardMode.DECODE:
            dims, kw = self._plan_args(meta.page_size)
            kv = paged_kv_indices(meta.page_table[: len(kv_lens)], kv_lens, meta.page_size, meta.page_lists)
            if meta.graph_mode is GraphMode.FULL:
                wrapper = self._graph_decode_wrapper(len(kv_lens), meta.page_table.shape[1], meta.device)
            else:
                wrapper = self._decode_wrapper(meta.device)
            self._plan_guard.before(wrapper)
            wrapper.plan(kv.indptr, kv.indices, kv.last_page_len, *dims, **kw)
        else:
            wrapper = self._prefill or self._prefill_wrapper(meta.device)
            self._plan_guard.before(wrapper)
            stream = self._plan_prefill(wrapper, meta, qo_lens, kv_lens)
            # FastRun's plan-owned arguments follow the new plan; without it, layer 0 records one
            if self._fast is not None and not self._fast.rebind(wrapper, meta.page_size):
                self._fast = None
            if stream is not None:  # a FastPlan on this CUDA stream
                self._plan_guard.after(wrapper, None, stream)
                self._wrapper = wrapper
                return
        self._plan_guard.after(wrapper, meta.device)
        self._wrapper = wrapper

    def _plan_args(self, page_size: int) -> tuple[tuple, dict]:
        """The head shape and page size, and the dtypes and scale, that FlashInfer's public plans take."""
        m = self.spec.model
        kw = dict(q_data_type=m.dtype, kv_data_type=KV_FP8 if m.kv_fp8 else m.dtype, sm_scale=self._sm_scale)
        if self._window:
            kw["window_left"] = self._window - 1  # FlashInfer's window: the keys left of the query's own
        if m.attn_logit_softcap:
            kw["logits_soft_cap"] = m.attn_logit_softcap
        return (m.num_heads, m.num_kv_heads, m.head_dim, page_size), kw

    def _plan_prefill(self, wrapper, meta, qo_lens: list[int], kv_lens: list[int]) -> int | None:
        """The prefill wrapper's plan: through the FastPlan when there is one for the step's page size (the
        planner takes it) and host page lists, else FlashInfer's public plan, given the lengths it would
        otherwise derive on the host; a public plan after the planner's module exists records a FastPlan."""
        fast = self._fast_plan
        if fast is not None and meta.page_lists is not None and fast.page_size == meta.page_size:
            # a window lane's page lists are cut (`window_view`), its page table is not: no gather from it
            fast(wrapper, qo_lens, kv_lens, meta.page_lists, None if self._window else meta.page_table)
            return fast.stream
        dims, kw = self._plan_args(meta.page_size)
        kv = paged_kv_indices(meta.page_table[: len(kv_lens)], kv_lens, meta.page_size, meta.page_lists)
        qo = qo_indptr(qo_lens)

        def public() -> None:
            wrapper.plan(qo, kv.indptr, kv.indices, kv.last_page_len, *dims, causal=True, seq_lens=kv.kv_lens,
                         max_token_per_sequence=max(qo_lens), max_sequence_kv=max(kv_lens), **kw)

        if (self.options.fast_plan and not self._fast_plan_refused and meta.page_lists is not None
                and getattr(wrapper, "_cached_module", None) is not None):
            self._fast_plan = FastPlan.record(wrapper, public, qo, kv, meta.page_size)
            if self._fast_plan is None:
                self._fast_plan_refused = True
                log.warning("FlashInfer's prefill planner is called in another form than FlashInfer 0.7's; "
                            "extend steps plan through its public plan() (slower on the host, same results)")
        else:
            public()

    def _ws(self, device) -> torch.Tensor:
        return workspace(self._root, device)

    def _prefill_wrapper(self, device):
        if self._prefill is None:
            import flashinfer

            self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._ws(device), "NHD",
                                                                           backend=self.variant)
        return self._prefill

    def _decode_wrapper(self, device):
        if self._decode is None:
            import flashinfer

            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._ws(device), "NHD", use_tensor_cores=self.decode_tensor_cores,
                backend=self.variant)
        return self._decode

    def _graph_decode_wrapper(self, bs: int, width: int, device):
        """The decode wrapper captured for graph batch size `bs`; its CSR buffers stay at fixed
        addresses and are refilled by every plan."""
        if bs not in self._graph_decode:
            import flashinfer

            i32 = dict(dtype=torch.int32, device=device)
            self._graph_decode[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._ws(device), "NHD", use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(bs * width, **i32),
                paged_kv_last_page_len_buffer=torch.ones(bs, **i32), backend=self.variant)
        return self._graph_decode[bs]

    # ------------------------------------------------------------------ run (capturable)
    def forward(self, q, k, v, out, layer_id, scale, kv) -> None:
        if self._lane_of:
            lane = self._lane_of.get(layer_id)
            if lane is not None:
                lane.forward(q, k, v, out, layer_id, scale, kv)
                return
        if check_capture_scale(self, scale):
            self._sm_scale = scale
            self._fast = self._fast_plan = None  # they hold the old scale; the public plan sets the new one
            self.plan(self._meta)
        slots = self._meta.slot_mapping
        # Between piecewise graph replays a layer gets the same q/k/v/out tensors (captured outputs) on
        # every step of a size: their views are made once, not per layer and step.
        bound = self._bound.get(layer_id)
        if (bound is None or bound[0] is not q or bound[1] is not k or bound[2] is not v or bound[3] is not out
                or bound[4] is not kv or bound[5] != self._rows):
            bound = self._bind(q, k, v, out, layer_id, kv)
            if all(map(is_replayed, (q, k, v, out))):
                self._bound[layer_id] = bound
        _, _, _, _, _, _, kc, vc, write, new_rows, q, out, padded = bound
        if slots.shape[0] != new_rows:
            slots = slots[:new_rows]
        write(slots)  # padded tokens write to the reserved page
        if padded is not None:
            padded.zero_()
        scales = kv.scales[layer_id] if kv.fp8 else (1.0, 1.0)
        fast = self._fast
        if self._wrapper is not self._prefill or (fast is not None and fast.scale_at is None and scales != (1.0, 1.0)):
            self._wrapper.run(q, (kc, vc), out=out, **run_scales(scales))
        elif fast is not None:
            fast(q, kc, vc, out, scales)
        else:
            self._fast = FastRun.record(self._wrapper, q, kc, vc, out, scales)

    def _bind(self, q, k, v, out, layer_id, kv) -> tuple:
        """(q, k, v, out, kv, rows: the key), then the K/V caches, the write of the new K/V rows into
        the pool (`bind_rows`: a function of the step's slots) and their count, and q/out cut to the
        planned rows plus out's padded rows (None without padding)."""
        views = self._views.get(layer_id)
        if views is None or views[0] is not kv:
            kc, vc = kv.k_cache(layer_id), kv.v_cache(layer_id)
            width = kc.shape[2] * kc.shape[3]
            views = self._views[layer_id] = (kv, kc, vc, kc.view(-1, width), vc.view(-1, width))
        _, kc, vc, k_rows, v_rows = views
        rows, padded, q_run, out_run = self._rows, None, q, out
        if out.shape[0] > rows:
            q_run, padded, out_run = q[:rows], out[rows:], out[:rows]
        write = bind_rows(k_rows, k.reshape(k.shape[0], -1), v_rows, v.reshape(v.shape[0], -1),
                          self._meta.slot_mapping[: k.shape[0]], kv.scales[layer_id])
        return (q, k, v, out, kv, rows, kc, vc, write, k.shape[0], q_run, out_run, padded)
