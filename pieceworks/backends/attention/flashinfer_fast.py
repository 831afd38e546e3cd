"""FlashInfer's Python around its kernels, made cheap for every step: `FastPlan` (the prefill
wrapper's plan without the public `plan()`'s host work), `FastRun` (its `run()` without re-deriving
the kernel's arguments) and `PlanCopyGuard` (no pinned host buffer rewritten under a pending copy);
the MLA wrapper's are in mla/flashinfer_fast.py. The fast paths rely on FlashInfer 0.7's private
call forms, check them when they record and stay off where they differ; tests/gpu/test_flashinfer.py
compares them with the public calls.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from pieceworks.backends import driver, page_gather_cuda


def check_counts(page_lists: list[list[int]], counts: list[int]) -> None:
    """ValueError unless every page list holds the counts[i] pages its sequence needs."""
    if len(page_lists) != len(counts):
        raise ValueError(f"{len(page_lists)} page lists for {len(counts)} sequences")
    for pages, c in zip(page_lists, counts):
        if c > len(pages):
            raise ValueError(f"a sequence needs {c} pages; its page list holds {len(pages)}")


def flat_pages(page_lists: list[list[int]], counts: list[int]) -> np.ndarray:
    """int32 array of the first counts[i] pages of every page list, in order (FlashInfer's paged-KV
    indices); numpy builds it about 4x faster than torch.tensor from a list (8320 pages: 0.13 ms)."""
    check_counts(page_lists, counts)
    return np.fromiter(itertools.chain.from_iterable(p[:c] for p, c in zip(page_lists, counts)), dtype=np.int32,
                       count=sum(counts))


def watched(module, name: str, call) -> list[tuple[tuple, dict, object]]:
    """Run `call()` with `module.<name>` wrapped: the (args, kwargs, result) of every call it made to it."""
    fn, seen = getattr(module, name), []

    def spy(*args, **kwargs):
        result = fn(*args, **kwargs)
        seen.append((args, kwargs, result))
        return result

    setattr(module, name, spy)
    try:
        call()
    finally:
        setattr(module, name, fn)
    return seen


class PlanCopyGuard:
    """Keeps a FlashInfer wrapper's `plan()` from rewriting its pinned host buffer under a pending copy.

    A wrapper's `plan()` writes the schedule into one page-locked host buffer and enqueues an
    asynchronous copy of it to the device; nothing waits for that copy. When the GPU runs more than a
    step behind the host (a large lm_head at the end of a step is enough), the next `plan()` of the same
    wrapper overwrites the host buffer before the previous copy has read it, and the earlier step's
    kernels run with the later step's schedule. `before(wrapper)` waits for the event recorded after
    that wrapper's previous plan (normally long complete); `after(wrapper)` records it. Skipped while
    capturing (plans never run inside a capture: the runner plans before it). Any hashable key may
    stand for a wrapper.
    """

    def __init__(self) -> None:
        self._events: dict[object, torch.cuda.Event] = {}
        self._raw: dict[object, driver.Event] = {}

    def before(self, key) -> None:
        event = self._raw.get(key)
        if event is not None:
            event.synchronize()
        event = self._events.get(key)
        if event is not None:
            event.synchronize()

    def after(self, key, device, stream: int | None = None) -> None:
        if stream is None:
            kind = device.type if isinstance(device, torch.device) else torch.device(device).type
            if kind != "cuda":
                return
        if driver.LEAN:
            if stream is None:
                stream = driver.raw_stream(device if isinstance(device, torch.device) else torch.device(device))
            event = self._raw.get(key)
            if event is None:
                event = self._raw[key] = driver.Event()
            if not event.capturing(stream):
                event.record(stream)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        event = self._events.get(key)
        if event is None:
            event = self._events[key] = torch.cuda.Event()
        event.record()


# The prefill wrapper's attributes that a plan sets and `run()` passes on to the kernel (FlashInfer 0.7).
PLAN_TENSORS = ("_plan_info", "_qo_indptr_buf", "_paged_kv_indptr_buf", "_paged_kv_indices_buf",
                "_paged_kv_last_page_len_buf", "_kv_lens_buffer")
PLAN_INTS = ("_max_q_len", "_max_kv_len", "_batch_size")  # passed right after _kv_lens_buffer and page_size


class FastPlan:
    """The prefill wrapper's `plan()` without FlashInfer's Python around its planner.

    The public `plan()` copies its inputs on the host, sends four index arrays with pageable copies
    into freshly allocated device tensors and sets some twenty attributes; the work that matters is
    the C++ planner (`_cached_module.plan`: the split schedule, written to the int workspace) and the
    index arrays on the device. `record` watches one public plan: the planner's argument list must
    hold our host qo_indptr, kv indptr and KV lengths (by identity) followed by the row and sequence
    counts, and the wrapper must be an eager (not CUDA-graph) fa2/fa3 wrapper without masks;
    otherwise it returns None and the public plan stays. A FastPlan then builds the step's CSR
    arrays inside a pinned staging buffer (a step of many pages: all but the page indices, which one
    kernel gathers from the step's device page table), sends them with one copy into a device buffer kept
    across steps, calls the planner with the new host arrays and sets the attributes `run()` reads
    (`PLAN_TENSORS`, `PLAN_INTS`, `_qo_indptr_last`). The views of both buffers are made once per batch
    size: every torch call costs host time (a small copy 13-15 us on one H200 machine's host), and a plan
    is on every extend step's critical path (the GPU waits for it before layer 0's attention). Its
    caller's `PlanCopyGuard` on the wrapper waits for the previous plan's copies before the next plan,
    which keeps the staging buffer, too, from being rewritten under a pending copy (one event per plan).
    The GPU tests compare the wrapper's state and the attention output with the public plan's.
    """

    def __init__(self, fn, args: list, at: int, page_size: int, device: torch.device) -> None:
        self.fn, self.args, self.at, self.page_size, self.device = fn, args, at, page_size, device
        self.stage: torch.Tensor | None = None
        self.device_buf: torch.Tensor | None = None
        self._views: dict[int, _Views] = {}  # batch size -> its views of the two buffers
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # entries -> (device, host) prefixes
        self._gathers: dict[int, page_gather_cuda.PageGather] = {}  # batch size -> its page gather
        self._raw_copies: dict[int, driver.Copy] = {}
        self.stream: int | None = None  # the last plan's raw stream (lean)

    @classmethod
    def record(cls, wrapper, public, qo: torch.Tensor, kv, page_size: int) -> "FastPlan | None":
        """Run `public()` (the wrapper's public plan of qo and `kv`, a `flashinfer.PagedKV`) watching the
        planner; the FastPlan or None."""
        fn = wrapper._cached_module.plan
        seen = watched(wrapper._cached_module, "plan", public)
        ok = (len(seen) == 1 and not seen[0][1] and getattr(wrapper, "_backend", None) in ("fa2", "fa3")
              and not getattr(wrapper, "is_cuda_graph_enabled", True) and wrapper._custom_mask_buf is None
              and getattr(wrapper, "_prefix_len_ptr", None) is None
              and getattr(wrapper, "_eagle_verify_fp8kv_sm90_state", None) is None
              and all(hasattr(wrapper, a) for a in PLAN_TENSORS + PLAN_INTS + ("_qo_indptr_last",)))
        if not ok:
            return None
        args = list(seen[0][0])
        at = next((i for i, a in enumerate(args) if a is qo), None)
        if (at is None or at + 4 >= len(args) or args[at + 1] is not kv.indptr or args[at + 2] is not kv.kv_lens
                or args[at + 3] != int(qo[-1]) or args[at + 4] != len(kv.kv_lens)):
            return None
        return cls(fn, args, at, page_size, torch.device(wrapper.device))

    def __call__(self, wrapper, qo_lens: list[int], kv_lens: list[int], page_lists: list[list[int]],
                 page_table: torch.Tensor | None = None) -> None:
        """Plan a step; with `page_table` (the step's int32 [b, width] table on the device, the rows of
        `page_lists`), a step of many pages has its page indices gathered from it on the GPU
        (backends/page_gather_cuda.py) instead of built on the host."""
        b, ps = len(kv_lens), self.page_size
        counts = [-(-n // ps) for n in kv_lens]
        total = 4 * b + 2 + sum(counts)
        if self.stage is None or self.stage.numel() < total:
            self._grow(total)
        v = self._views.get(b) or self._make_views(b)
        a, gather = v.a, False
        if b == 1:  # one sequence (a prompt's prefill chunk alone): a few scalar stores, no array ops
            n, c, pages = kv_lens[0], counts[0], page_lists[0]
            if c > len(pages):
                raise ValueError(f"a sequence needs {c} pages; its page list holds {len(pages)}")
            a[0] = a[2] = 0
            a[1], a[3], a[4], a[5] = qo_lens[0], c, n - (c - 1) * ps, n
            a[6 : 6 + c] = pages[:c]
        else:
            gather = page_gather_cuda.usable(page_table, b, max(counts), total - 4 * b - 2)
            if gather:
                check_counts(page_lists, counts)
            else:
                a[4 * b + 2 : total] = flat_pages(page_lists, counts)
            # offsets through itertools (numpy's cumsum of a list converts it first: 5 against 2 us for 33)
            a[1 : b + 1] = list(itertools.accumulate(qo_lens))
            a[0] = a[b + 1] = 0
            a[b + 2 : 2 * b + 2] = list(itertools.accumulate(counts))
            a[3 * b + 2 : 4 * b + 2] = kv_lens
            a[2 * b + 2 : 3 * b + 2] = [n - (c - 1) * ps for n, c in zip(kv_lens, counts)]
        # one copy of a prefix in steps of 1024 entries (no slicing per step): a few KB more than needed; with the
        # gather, the offsets only (the kernel, after the copy in stream order, writes the indices past them)
        bucket = -(-(4 * b + 2 if gather else total) // 1024) * 1024
        stream = self.stream = None
        if driver.LEAN and self.device.type == "cuda":
            stream = self.stream = driver.raw_stream(self.device)
            copy = self._raw_copies.get(bucket)
            if copy is None:
                # the bucket may pass the buffers' end (they grow to a step's need, not to a bucket)
                nbytes = 4 * min(bucket, self.stage.numel())
                copy = self._raw_copies[bucket] = driver.Copy(self.device_buf, self.stage, nbytes)
            copy(stream)
        else:
            pair = self._copies.get(bucket)
            if pair is None:
                pair = self._copies[bucket] = (self.device_buf[:bucket], self.stage[:bucket])
            pair[0].copy_(pair[1], non_blocking=True)
        if gather:
            launch = self._gathers.get(b)
            if launch is None:
                launch = self._gathers[b] = page_gather_cuda.PageGather(self.device_buf[4 * b + 2 :], v.kv)
            launch(page_table) if stream is None else launch(page_table, stream)
        args = self.args
        rows = int(a[b])
        args[self.at : self.at + 5] = [v.qo_host, v.kv_host, v.lens_host, rows, b]
        wrapper._plan_info = self.fn(*args)
        wrapper._qo_indptr_buf, wrapper._paged_kv_indptr_buf = v.qo, v.kv
        wrapper._paged_kv_last_page_len_buf, wrapper._kv_lens_buffer = v.last, v.lens
        wrapper._paged_kv_indices_buf = self.device_buf[4 * b + 2 : total]
        wrapper._batch_size, wrapper._qo_indptr_last = b, rows
        wrapper._max_q_len, wrapper._max_kv_len = max(qo_lens), max(kv_lens)
        wrapper._seq_lens_kv = wrapper._seq_lens_q = v.lens_host

    def _grow(self, n: int) -> None:
        """New staging (pinned for a GPU) and device buffers of at least n int32 entries; every view of the
        old ones goes."""
        n = max(n, 4096)
        self.stage = torch.empty(n, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.device_buf = torch.empty(n, dtype=torch.int32, device=self.device)
        self._views.clear()
        self._copies.clear()
        self._raw_copies.clear()
        self._gathers.clear()

    def _make_views(self, b: int) -> "_Views":
        """The views a plan of b sequences uses; the buffers hold qo_indptr [b + 1], kv indptr [b + 1],
        last page lengths [b], KV lengths [b], then the page indices."""
        host, dev = self.stage, self.device_buf
        v = self._views[b] = _Views(host.numpy(), host[: b + 1], host[b + 1 : 2 * b + 2], host[3 * b + 2 : 4 * b + 2],
                                    dev[: b + 1], dev[b + 1 : 2 * b + 2], dev[2 * b + 2 : 3 * b + 2],
                                    dev[3 * b + 2 : 4 * b + 2])
        return v


class _Views(NamedTuple):
    """A FastPlan's views of its buffers for one batch size: the staging buffer as a numpy array, the host
    arrays the planner reads, the device arrays `run()` reads."""

    a: np.ndarray
    qo_host: torch.Tensor
    kv_host: torch.Tensor
    lens_host: torch.Tensor
    qo: torch.Tensor
    kv: torch.Tensor
    last: torch.Tensor
    lens: torch.Tensor


def run_scales(scales: tuple[float, float]) -> dict[str, float]:
    """FlashInfer run()'s keyword arguments for a layer's FP8 (k_scale, v_scale): none where both are 1.0."""
    return dict(k_scale=scales[0], v_scale=scales[1]) if scales != (1.0, 1.0) else {}


class FastRun:
    """FlashInfer's `run()` re-derives some 50 kernel arguments in Python on every call (~25 us a
    layer on the H200 machine's host); they are the same for every layer but q, the K/V caches and
    out, and from one plan to the next they change only in what the plan set (`PLAN_TENSORS`,
    `PLAN_INTS`). The first layer after the backend's first prefill plan goes through `run()` while
    the module's `paged_run` is watched; later layers call `paged_run` with those four tensors swapped
    in, and `rebind` swaps in a new plan's attributes, so no later step goes through `run()`. Used
    only when the recorded call holds exactly our four tensors (checked by identity); otherwise
    `record` returns None and every layer keeps calling `run()`. A recording whose plan attributes
    are not where FlashInfer 0.7 puts them (`_locate`), or one for another page size, is not rebound:
    the next plan drops it.

    An FP8 pool's layers each have their k_scale / v_scale: `run()` passes the plan's softmax scale times
    k_scale and multiplies the output by v_scale afterwards. The recording finds that softmax-scale argument (the
    one float equal to it, `scale_at`; None if not exactly one) and each call sets it for its layer's k_scale and
    multiplies by its v_scale as `run()` does; without `scale_at` only layers of scales 1.0 may call it.
    """

    def __init__(self, fn, args: list, slots: tuple[int, int, int, int],
                 plan_slots: list[tuple[int, str]] | None, scale_at: int | None = None,
                 sm_scale: float = 1.0) -> None:
        self.fn, self.args, self.slots, self.plan_slots = fn, args, slots, plan_slots
        self.scale_at, self.sm_scale = scale_at, sm_scale
        # page_size is passed right before PLAN_INTS
        self.page_size_at = plan_slots[-len(PLAN_INTS)][0] - 1 if plan_slots else None

    def __call__(self, q, kc, vc, out, scales: tuple[float, float] = (1.0, 1.0)) -> None:
        args = self.args
        iq, ik, iv, io = self.slots
        args[iq], args[ik], args[iv], args[io] = q, kc, vc, out
        if self.scale_at is not None:
            args[self.scale_at] = self.sm_scale * scales[0] if scales[0] != 1.0 else self.sm_scale
        self.fn(*args)
        if scales[1] != 1.0:
            out *= scales[1]

    def rebind(self, wrapper, page_size: int) -> bool:
        """Take a new plan's attributes of `wrapper`; False if this recording can't (drop it): its plan
        attributes were not located, or its K/V caches have another page size (an argument too)."""
        if self.plan_slots is None or self.args[self.page_size_at] != page_size:
            return False
        for i, name in self.plan_slots:
            self.args[i] = getattr(wrapper, name)
        return True

    @staticmethod
    def _locate(wrapper, args: list) -> list[tuple[int, str]] | None:
        """(position, attribute) of every plan-owned argument: the tensors by identity (each at least
        once), the ints at their place after `_kv_lens_buffer` and page_size; None if any is missing."""
        found = []
        for name in PLAN_TENSORS:
            value = getattr(wrapper, name, None)
            where = [i for i, a in enumerate(args) if value is not None and a is value]
            if not where:
                return None
            found += [(i, name) for i in where]
        lens_at = [i for i, name in found if name == "_kv_lens_buffer"]
        if len(lens_at) != 1 or lens_at[0] + 2 + len(PLAN_INTS) > len(args):
            return None
        at = lens_at[0] + 2
        for k, name in enumerate(PLAN_INTS):
            if type(args[at + k]) is not int or args[at + k] != getattr(wrapper, name):
                return None
            found.append((at + k, name))
        return found

    @classmethod
    def record(cls, wrapper, q, kc, vc, out, scales: tuple[float, float] = (1.0, 1.0)) -> "FastRun | None":
        """`wrapper.run` of this layer (with its FP8 `scales` where they are not 1.0), recorded."""
        kw = run_scales(scales)
        module = getattr(wrapper, "_cached_module", None)
        fn = getattr(module, "paged_run", None)
        if fn is None:
            wrapper.run(q, (kc, vc), out=out, **kw)
            return None
        seen = watched(module, "paged_run", lambda: wrapper.run(q, (kc, vc), out=out, **kw))
        if len(seen) != 1 or seen[0][1]:
            return None
        args = list(seen[0][0])
        where = [[i for i, a in enumerate(args) if a is t] for t in (q, kc, vc, out)]
        if any(len(w) != 1 for w in where):
            return None
        base = getattr(wrapper, "_sm_scale", None)
        scale_at = None
        if isinstance(base, float):  # run()'s own arithmetic: the plan's scale times k_scale where one is given
            passed = base * scales[0] if scales[0] != 1.0 else base
            at = [i for i, a in enumerate(args) if type(a) is float and a == passed]
            scale_at = at[0] if len(at) == 1 else None
        if scale_at is None and scales != (1.0, 1.0):
            return None  # this layer's call can't be replayed with its scales
        return cls(fn, args, tuple(w[0] for w in where), cls._locate(wrapper, args), scale_at,
                   base if isinstance(base, float) else 1.0)
