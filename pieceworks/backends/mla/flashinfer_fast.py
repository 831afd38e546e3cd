"""FlashInfer's MLA wrapper made cheap for every step, as attention/flashinfer_fast.py does for the prefill
wrapper: `FastMLAPlan` (its plan without the public `plan()`'s host work) and `FastMLARun` (its `run()` as one
call of the kernel module). Both rely on FlashInfer 0.7's private call forms, check them when they record and
stay off where they differ; tests/gpu/test_flashinfer.py compares them with the public calls.
"""

from __future__ import annotations

import torch

from pieceworks.backends.attention.flashinfer_fast import watched


def fa_mla_capacity(device: torch.device):
    """(work_count, max_items, SM count): FlashInfer 0.7's count of an fa2/fa3 MLA plan's work items
    (`_fa_plan_work_count(q_lens, kv_lens, heads, SMs, causal)`, which raises above capacity) and the native
    planner's capacity, for `device`; None where FlashInfer has another form."""
    try:
        from flashinfer.mla._batch_mla._backends._fa_common import _FA_MAX_WORK_ITEMS, _fa_plan_work_count
        from flashinfer.utils import get_device_sm_count
    except ImportError:
        return None
    return _fa_plan_work_count, _FA_MAX_WORK_ITEMS, get_device_sm_count(device)


class FastMLAPlan:
    """The MLA wrapper's `plan()` (fa2/fa3) without FlashInfer's Python around its planner.

    FlashInfer 0.7's `BatchMLAPagedAttentionWrapper.plan` audits its arguments, builds a new backend object,
    snapshots (clones) the CUDA-graph buffers it refills, checks every pair of them for overlap and validates the
    CSR arrays: on the H200 machine 0.6-0.7 ms of host time per DeepSeek-V3-shaped decode step, 0.6-1.2 per extend
    step, 1.6-3.2 times what the plan takes through a FastMLAPlan (docs/benchmarks.md). What `run()` reads of a plan
    is the planner's result (`_plan_info`), the schedule the planner stages into the int workspace, the page indices
    on the device (`_kv_indices_buf`) and the mask (`_causal`). `record` watches one public plan of a wrapper that
    has been planned before (its planner module is then known and cached by FlashInfer): the module's
    `plan_with_staged_workspace_bytes` must be called once with the planned backend's three workspaces, our host
    qo_indptr, kv_indptr and KV lengths (by identity) and the head count, latent width and mask, and the planned
    backend must hold the returned plan, our indices and page size; otherwise it returns None and the public plan
    stays. A FastMLAPlan then calls the planner with the step's host arrays and sets those attributes on the same
    planned backend (under CUDA graphs: the indices copied into its fixed buffer). It keeps FlashInfer's capacity
    check, which guards the native planner's work-item arrays: a step whose plan would exceed it (`__call__` returns
    False) goes through the public plan, which refuses it with FlashInfer's error. The GPU tests compare outputs
    with public plans step by step.
    """

    def __init__(self, fn, args: list, backend, graph: bool, page_size: int, work_count, max_items: int,
                 num_sm: int) -> None:
        self.fn, self.args, self.backend, self.graph, self.page_size = fn, args, backend, graph, page_size
        self.work_count, self.max_items, self.num_sm = work_count, max_items, num_sm

    @classmethod
    def record(cls, wrapper, public, csr: dict, num_heads: int, head_dim_ckv: int, causal: bool,
               page_size: int) -> "FastMLAPlan | None":
        """Run `public()` (the wrapper's public plan of the CSR arrays `csr`) watching its planner; the
        FastMLAPlan or None (the public plan has run either way)."""
        capacity = None if getattr(wrapper, "_float_workspace_buffer", None) is None else \
            fa_mla_capacity(wrapper._float_workspace_buffer.device)
        if capacity is None:
            public()
            return None
        previous = getattr(wrapper, "_planned_backend", None)
        module = getattr(previous, "_cached_module", None)
        if module is None or getattr(wrapper, "_backend", None) not in ("fa2", "fa3"):
            public()
            return None
        fn = module.plan_with_staged_workspace_bytes
        seen = watched(module, "plan_with_staged_workspace_bytes", public)
        be = getattr(wrapper, "_planned_backend", None)
        if len(seen) != 1 or seen[0][1] or be is None or getattr(be, "_cached_module", None) is not module:
            return None
        args, _, (plan_info, _) = seen[0]
        args = list(args)
        graph = bool(getattr(wrapper, "_use_cuda_graph", False))
        indices = getattr(be, "_kv_indices_buf", None)
        ok = (len(args) == 9 and args[0] is be._float_workspace_buffer and args[1] is be._int_workspace_buffer
              and args[2] is be._pin_memory_int_workspace_buffer and args[3] is csr["qo_indptr"]
              and args[4] is csr["kv_indptr"] and args[5] is csr["kv_len_arr"]
              and args[6:] == [num_heads, head_dim_ckv, causal] and getattr(be, "_plan_info", None) is plan_info
              and hasattr(be, "_staged_int_workspace_bytes") and getattr(be, "_causal", None) == causal
              and getattr(be, "_page_size", None) == page_size and indices is not None
              and (indices is wrapper._kv_indices_buf if graph else indices is csr["kv_indices"]))
        return cls(fn, args, be, graph, page_size, *capacity) if ok else None

    def __call__(self, wrapper, csr: dict, num_heads: int, head_dim_ckv: int, causal: bool, page_size: int) -> bool:
        """Plan the step of `csr` on `wrapper` (host qo_indptr, kv_indptr and kv_len_arr, device kv_indices);
        False, with nothing changed, where the public plan must run instead: another backend object was
        planned since the recording, other dimensions or page size, or a plan over FlashInfer's capacity."""
        be, args = self.backend, self.args
        indices = csr["kv_indices"]
        if (getattr(wrapper, "_planned_backend", None) is not be or args[6] != num_heads or args[7] != head_dim_ckv
                or page_size != self.page_size or (self.graph and indices.shape[0] > be._kv_indices_buf.shape[0])):
            return False
        qo, lens = csr["qo_indptr"].numpy(), csr["kv_len_arr"].numpy()
        try:
            items = self.work_count((qo[1:] - qo[:-1]).tolist(), lens.tolist(), num_heads, self.num_sm, causal)
        except Exception:  # over capacity, or a plan FlashInfer refuses: its public plan says why
            return False
        if items > self.max_items:
            return False
        args[3], args[4], args[5], args[8] = csr["qo_indptr"], csr["kv_indptr"], csr["kv_len_arr"], causal
        plan_info, staged = self.fn(*args)
        if self.graph:
            be._kv_indices_buf[: indices.shape[0]].copy_(indices, non_blocking=True)
        else:
            be._kv_indices_buf = wrapper._kv_indices_buf = indices
        be._plan_info = wrapper._plan_info = plan_info
        be._staged_int_workspace_bytes = staged
        be._causal = wrapper._causal = causal
        return True


class FastMLARun:
    """The MLA wrapper's `run()` (fa2/fa3, eager and piecewise steps) as one call of FlashInfer's kernel module.

    FlashInfer 0.7's `run()` checks the query, cache and output contracts and splits the packed latent cache
    into its ckv / kpe views on every call: 28-32 us of host per call on the H200 machine, paid by every layer
    of an extend step between its piecewise graph pieces (a 128-head layer's forward: 45 us less host time
    through a FastMLARun, docs/benchmarks.md). `record` watches one `run()`:
    the planned backend's `_cached_module.run` must be called once with the backend's workspaces, plan and
    page indices, our q_nope, q_pe and out (by identity), ckv / kpe views of our cache (same address, shape
    and strides as `cache[..., :rank]` and `cache[..., rank:]`), no LSE and the plan's mask, head count, page
    size and softmax scale at their places (`_run_generated_fa`); otherwise it returns None and `run()`
    stays. A FastMLARun then calls the module with the layer's tensors and the current plan's attributes
    (a public plan since the recording builds a new planned backend: its workspaces, plan and indices are
    read on every call). The GPU tests compare its outputs with `run()`'s.
    """

    def __init__(self, fn, args: list, module, masks: tuple[int, int]) -> None:
        self.fn, self.args, self.module, self.masks = fn, args, module, masks

    @classmethod
    def record(cls, wrapper, q_nope, q_pe, cache, out, ckv, kpe) -> "FastMLARun | None":
        """Run the wrapper's `run()` on these tensors watching the kernel module; the FastMLARun or None. ckv, kpe:
        the caller's views `cache[..., :rank]` and `cache[..., rank:]`, to be checked against the wrapper's."""
        be = getattr(wrapper, "_planned_backend", None)
        module = getattr(be, "_cached_module", None)
        try:
            from flashinfer.utils import MaskMode

            masks = (MaskMode.NON_CAUSAL.value, MaskMode.CAUSAL.value)
        except (ImportError, AttributeError):
            module = None
        if module is None or getattr(wrapper, "_backend", None) not in ("fa2", "fa3"):
            wrapper.run(query=(q_nope, q_pe), kv_cache=cache, out=out)
            return None
        seen = watched(module, "run", lambda: wrapper.run(query=(q_nope, q_pe), kv_cache=cache, out=out))
        if len(seen) != 1 or seen[0][1] or len(seen[0][0]) != 18:
            return None
        args = list(seen[0][0])
        same_view = all(a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                        for a, b in ((args[5], ckv), (args[6], kpe)) if isinstance(a, torch.Tensor))
        ok = (all(isinstance(a, torch.Tensor) for a in args[5:7]) and same_view
              and args[0] is be._float_workspace_buffer and args[1] is be._int_workspace_buffer
              and args[2] is be._plan_info and args[3] is q_nope and args[4] is q_pe and args[7] is be._kv_indices_buf
              and args[8] is out and args[9] is None and args[10] == masks[bool(be._causal)]
              and args[11] == q_nope.shape[1] and args[12] == be._page_size and args[13] == be._sm_scale)
        return cls(module.run, args, module, masks) if ok else None

    def __call__(self, wrapper, q_nope, q_pe, ckv, kpe, out) -> bool:
        """Run the kernel on these tensors (ckv, kpe: views of the packed cache as `record` checked them) with the
        wrapper's current plan; False (nothing run) if that plan is not of this recording's module."""
        be = wrapper._planned_backend
        if be._cached_module is not self.module:
            return False
        args = self.args
        args[0], args[1], args[2] = be._float_workspace_buffer, be._int_workspace_buffer, be._plan_info
        args[3], args[4], args[5], args[6], args[7], args[8] = q_nope, q_pe, ckv, kpe, be._kv_indices_buf, out
        args[10], args[11] = self.masks[bool(be._causal)], q_nope.shape[1]
        args[12], args[13] = be._page_size, be._sm_scale
        self.fn(*args)
        return True
