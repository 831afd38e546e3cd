"""FastPlan and FastRun (backends/attention/flashinfer_fast.py), FastMLAPlan and FastMLARun
(backends/mla/flashinfer_fast.py) on CPU, against stand-in wrappers that plan and run the way FlashInfer 0.7's
BatchPrefillWithPagedKVCacheWrapper does for an eager fa2 plan and its BatchMLAPagedAttentionWrapper for fa2 plans
(the planner's and the kernel's argument lists, the attributes a plan sets). tests/gpu/test_flashinfer.py compares
them with the real wrappers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pieceworks.backends.attention.flashinfer import paged_kv_indices, qo_indptr
from pieceworks.backends.attention.flashinfer_fast import FastPlan, FastRun
from pieceworks.backends.mla.flashinfer_fast import FastMLAPlan, FastMLARun


class Module:
    def __init__(self) -> None:
        self.plans, self.runs = [], []

    def plan(self, *args):
        self.plans.append(args)
        return [len(self.plans), int(args[6])]  # stands for the planner's schedule

    def paged_run(self, *args):
        self.runs.append(args)


class Wrapper:
    """The parts of FlashInfer's eager prefill wrapper that FastPlan and FastRun rely on."""

    def __init__(self, graph: bool = False) -> None:
        self.device = torch.device("cpu")
        self._backend, self.is_cuda_graph_enabled = "fa2", graph
        self._custom_mask_buf = self._prefix_len_ptr = None
        self._cached_module = Module()
        self._kv_lens_buffer = torch.zeros(32, dtype=torch.int32)
        self.ws = [torch.zeros(4), torch.zeros(4), torch.zeros(4)]

    def plan(self, qo, indptr, indices, last, hq, hkv, d, ps, causal, seq_lens, max_token_per_sequence,
             max_sequence_kv, **kw) -> None:
        b = len(qo) - 1
        self._batch_size, self._qo_indptr_last = b, int(qo[-1])
        self._max_q_len, self._max_kv_len = max_token_per_sequence, max_sequence_kv
        self._kv_lens_buffer[:b].copy_(seq_lens)
        self._qo_indptr_buf, self._paged_kv_indptr_buf = qo.clone(), indptr.clone()
        self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf = indices.clone(), last.clone()
        self._seq_lens_kv = seq_lens
        self._plan_info = self._cached_module.plan(*self.ws, qo, indptr, seq_lens, int(qo[-1]), b, hq, hkv, ps,
                                                   False, d, d, causal, -1, -1, False, 0, 0)

    def run(self, q, kv, out) -> None:
        self._cached_module.paged_run(
            self.ws[0], self.ws[1], self._plan_info, q, kv[0], kv[1], self._qo_indptr_buf,
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf, out, None,
            1, 0, -1, False, None, 0.125, 4, 8, self._kv_lens_buffer, 16, self._max_q_len, self._max_kv_len,
            self._batch_size, self._qo_indptr_buf, self._paged_kv_indptr_buf, None)


PS = 16
STEPS = [([7], [7], [[3]]), ([256, 1, 1], [256, 512, 17], [list(range(10, 26)), list(range(30, 62)), [5, 6]]),
         ([3, 2], [40, 2], [[9, 8, 7, 6], [1]])]


def public(w: Wrapper, qo_lens, kv_lens, pages):
    table = torch.zeros(len(pages), max(64, *map(len, pages)), dtype=torch.int32)
    kv = paged_kv_indices(table, kv_lens, PS, pages)
    qo = qo_indptr(qo_lens)
    return qo, kv, lambda: w.plan(qo, kv.indptr, kv.indices, kv.last_page_len, 8, 2, 64, PS, True, kv.kv_lens,
                                  max(qo_lens), max(kv_lens))


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_fast_plan_plans_and_sets_the_wrapper_as_the_public_plan_does():
    fast_w, ref_w = Wrapper(), Wrapper()
    qo, kv, plan = public(fast_w, *STEPS[0])
    fast = FastPlan.record(fast_w, plan, qo, kv, PS)
    assert fast is not None and len(fast_w._cached_module.plans) == 1  # the recorded public plan ran once
    # one sequence over several pages, and one whose 6,000 pages outgrow the first buffers (views made anew)
    more = [([5], [40], [[9, 8, 7, 6]]), ([3], [6000 * PS], [list(range(6000))])]
    for qo_lens, kv_lens, pages in STEPS[1:] + more + STEPS:
        fast(fast_w, qo_lens, kv_lens, pages)
        public(ref_w, qo_lens, kv_lens, pages)[2]()
        assert same(fast_w._cached_module.plans[-1], ref_w._cached_module.plans[-1])
        b = len(kv_lens)
        for name in ("_batch_size", "_qo_indptr_last", "_max_q_len", "_max_kv_len", "_qo_indptr_buf",
                     "_paged_kv_indptr_buf", "_paged_kv_indices_buf", "_paged_kv_last_page_len_buf"):
            assert same(getattr(fast_w, name), getattr(ref_w, name)), name
        assert torch.equal(fast_w._kv_lens_buffer[:b], ref_w._kv_lens_buffer[:b])


class HostGather:
    """backends/page_gather_cuda.PageGather's kernel in torch (the GPU tests run the kernel itself)."""

    def __init__(self, indices: torch.Tensor, indptr: torch.Tensor) -> None:
        self.indices, self.indptr, self.calls = indices, indptr, 0

    def __call__(self, table: torch.Tensor) -> None:
        ptr = self.indptr.tolist()
        for b in range(len(ptr) - 1):
            self.indices[ptr[b] : ptr[b + 1]] = table[b, : ptr[b + 1] - ptr[b]]
        HostGather.launches += 1


def test_fast_plan_gathers_many_pages_from_the_device_table(monkeypatch):
    """A plan of many pages with the step's page table sends only the CSR offsets and has the indices gathered
    from the table (here by a stand-in of the kernel): the wrapper's state is the public plan's; a plan with
    few pages, without a table, or of one sequence builds them on the host."""
    from pieceworks.backends import page_gather_cuda

    monkeypatch.setattr(page_gather_cuda, "unavailable", lambda device: None)
    monkeypatch.setattr(page_gather_cuda, "PageGather", HostGather)
    monkeypatch.setattr(page_gather_cuda, "MIN_PAGES", 40)
    HostGather.launches = 0
    fast_w, ref_w = Wrapper(), Wrapper()
    qo, kv, plan = public(fast_w, *STEPS[0])
    fast = FastPlan.record(fast_w, plan, qo, kv, PS)
    many = ([256, 1, 1], [256, 512, 17], [list(range(10, 26)), list(range(30, 62)), [5, 6]])  # 50 pages
    longer = ([1, 1], [700, 9], [list(range(100, 150)), [7, 3]])  # 45 pages, table wider than both
    expect = 0
    for qo_lens, kv_lens, pages, with_table in [(*many, True), (*longer, True), (*many, False), (*STEPS[2], True),
                                                (*longer, True), ([3], [6000 * PS], [list(range(6000))], True)]:
        width = max(map(len, pages)) + 3
        table = torch.full((len(pages), width), -1, dtype=torch.int32)
        for i, p in enumerate(pages):
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        fast_w._paged_kv_indices_buf = None
        if fast.device_buf is not None:  # no indices left from an earlier step
            fast.device_buf.fill_(-7)
        fast(fast_w, qo_lens, kv_lens, pages, table if with_table else None)
        public(ref_w, qo_lens, kv_lens, pages)[2]()
        n = sum(-(-x // PS) for x in kv_lens)
        expect += with_table and len(pages) > 1 and n >= 40
        assert HostGather.launches == expect, (kv_lens, with_table)
        assert same(fast_w._cached_module.plans[-1], ref_w._cached_module.plans[-1])
        for name in ("_qo_indptr_buf", "_paged_kv_indptr_buf", "_paged_kv_indices_buf", "_paged_kv_last_page_len_buf"):
            assert same(getattr(fast_w, name), getattr(ref_w, name)), name
    assert expect == 3
    with pytest.raises(ValueError, match="needs 50 pages; its page list holds 2"):
        fast(fast_w, [1, 1], [800, 9], [[1, 2], [7, 3]], torch.zeros(2, 60, dtype=torch.int32))


def test_fast_run_follows_every_new_plan():
    w = Wrapper()
    qo, kv, plan = public(w, *STEPS[0])
    plan()
    q, kc, vc, out = (torch.zeros(2) for _ in range(4))
    fast = FastRun.record(w, q, kc, vc, out)
    assert fast is not None and fast.plan_slots is not None
    qo, kv, plan = public(w, *STEPS[1])
    fast_plan = FastPlan.record(w, plan, qo, kv, PS)
    assert fast_plan is not None
    for step in STEPS[2:] + STEPS[:1]:
        fast_plan(w, *step)
        assert fast.rebind(w, PS) and not fast.rebind(w, 2 * PS)
        fast(q, kc, vc, out)
        w.run(q, (kc, vc), out)
        assert same(w._cached_module.runs[-1], w._cached_module.runs[-2])


class ScaledWrapper(Wrapper):
    """run() with FP8 KV scales as FlashInfer 0.7's: the plan's softmax scale times k_scale in the kernel's
    arguments, the output times v_scale afterwards."""

    _sm_scale = 0.125

    def run(self, q, kv, out, k_scale=None, v_scale=None) -> None:
        sm_scale = self._sm_scale
        if k_scale is not None:
            sm_scale *= k_scale
        self._cached_module.paged_run(
            self.ws[0], self.ws[1], self._plan_info, q, kv[0], kv[1], self._qo_indptr_buf,
            self._paged_kv_indptr_buf, self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf, out, None,
            1, 0, -1, False, None, sm_scale, 4, 8, self._kv_lens_buffer, 16, self._max_q_len, self._max_kv_len,
            self._batch_size, self._qo_indptr_buf, self._paged_kv_indptr_buf, None)
        if v_scale is not None and v_scale != 1.0:
            out *= v_scale


def test_fast_run_takes_each_layers_fp8_scales():
    """Recorded with one layer's k_scale / v_scale, a FastRun calls the kernel with another layer's softmax scale
    and multiplies its output by that layer's v_scale, as run() does (scales of 1.0 too); a softmax scale that
    can't be told apart from another argument leaves scaled layers to run()."""
    w = ScaledWrapper()
    public(w, *STEPS[0])[2]()
    q, kc, vc = (torch.zeros(2) for _ in range(3))
    fast = FastRun.record(w, q, kc, vc, torch.ones(2), (0.5, 0.25))
    assert fast is not None and fast.scale_at == 17
    for scales in ((0.3, 2.0), (1.0, 1.0), (0.5, 0.25), (2.0, 1.0)):
        out_fast, out_run = torch.ones(2), torch.ones(2)
        fast(q, kc, vc, out_fast, scales)
        kw = dict(k_scale=scales[0], v_scale=scales[1]) if scales != (1.0, 1.0) else {}
        w.run(q, (kc, vc), out_run, **kw)
        runs = w._cached_module.runs
        assert same([a for i, a in enumerate(runs[-2]) if i != 10], [a for i, a in enumerate(runs[-1]) if i != 10])
        assert torch.equal(out_fast, out_run) and out_fast[0] == scales[1], scales
    w._max_q_len = 0.125 * 0.5  # another argument equal to the scaled softmax scale: not told apart
    assert FastRun.record(w, q, kc, vc, torch.ones(2), (0.5, 0.25)) is None
    assert FastRun.record(w, q, kc, vc, torch.ones(2)).scale_at == 17  # unscaled: 0.125 is still one argument


def test_fast_paths_stay_off_for_calls_of_another_form():
    w = Wrapper(graph=True)
    qo, kv, plan = public(w, *STEPS[0])
    assert FastPlan.record(w, plan, qo, kv, PS) is None  # the public plan still ran
    assert w._qo_indptr_last == 7
    w = Wrapper()
    qo, kv, plan = public(w, *STEPS[0])
    plan()
    w._max_q_len = 7.0  # not where FlashInfer 0.7 passes an int: the recording is not rebound
    fast = FastRun.record(w, *(torch.zeros(1) for _ in range(4)))
    assert fast is not None and fast.plan_slots is None and not fast.rebind(w, PS)


def test_the_backend_records_one_fast_plan_or_warns_once_and_keeps_the_public_plan(caplog):
    from pieceworks.backends.attention.flashinfer import FlashInferAttentionBackend
    from pieceworks.backends.base import BackendSpec, ModelFacts
    from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata

    facts = ModelFacts(dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, head_dim=64, page_size=PS)
    backend = FlashInferAttentionBackend(BackendSpec.for_device(torch.device("cpu"), model=facts))
    qo_lens, kv_lens, pages = STEPS[1]
    meta = StepMetadata(mode=ForwardMode.MIXED, graph_mode=GraphMode.EAGER, extend_lens=qo_lens,
                        prefix_lens=[k - q for q, k in zip(qo_lens, kv_lens)], page_size=PS,
                        page_table=torch.zeros(3, 64, dtype=torch.int32), slot_mapping=torch.zeros(258),
                        positions=torch.zeros(258), page_lists=pages)
    for graph, recorded in ((False, True), (True, False)):
        w = Wrapper(graph=graph)
        w.plan = lambda qo, indptr, indices, last, *a, causal, w=w, **k: Wrapper.plan(
            w, qo, indptr, indices, last, *a, causal, k["seq_lens"], k["max_token_per_sequence"], k["max_sequence_kv"])
        backend._fast_plan, backend._fast_plan_refused = None, False
        caplog.clear()
        for _ in range(3):
            backend._plan_prefill(w, meta, qo_lens, kv_lens)
        assert (backend._fast_plan is not None) is recorded
        # recorded: one public plan, then two through the planner directly; refused: three public plans
        assert len(w._cached_module.plans) == 3 and w._qo_indptr_last == 258
        assert len([r for r in caplog.records if "public plan()" in r.getMessage()]) == (0 if recorded else 1)


# ---------------------------------------------------------------- FastMLAPlan
class MLAModule:
    """Stands for FlashInfer 0.7's MLA module (`plan_with_staged_workspace_bytes`, `run`)."""

    def __init__(self) -> None:
        self.plans, self.runs = [], []

    def run(self, *args):
        self.runs.append(args)

    def plan_with_staged_workspace_bytes(self, *args):
        self.plans.append(args)
        # stands for the schedule: what the planner read
        return [int(args[3][-1]), int(args[4][-1]), int(args[5].sum()), int(args[8])], 96


class MLAPlanned:
    """The backend object FlashInfer's MLA wrapper builds on every public plan."""

    def __init__(self, w: "MLAWrapper") -> None:
        self._cached_module = w.module
        self._float_workspace_buffer, self._int_workspace_buffer, self._pin_memory_int_workspace_buffer = w.ws
        self._kv_indices_buf = w._fixed if w._use_cuda_graph else None
        if not w._use_cuda_graph:  # an eager plan allocates its own int workspace; graph plans keep the first
            self._int_workspace_buffer = torch.zeros(4)


class MLAWrapper:
    """The parts of FlashInfer 0.7's BatchMLAPagedAttentionWrapper (fa2) that FastMLAPlan relies on: a public
    plan builds a new planned backend, calls the planner with host copies of the CSR arrays (`.to("cpu")`:
    the same tensors when they are on the host) and stages the indices (graph: into a fixed buffer)."""

    def __init__(self, graph: bool = False) -> None:
        self._backend, self._use_cuda_graph = "fa2", graph
        self.ws = (torch.zeros(4), torch.zeros(4), torch.zeros(4))
        self._float_workspace_buffer = self.ws[0]
        self._fixed = torch.zeros(64, dtype=torch.int32) if graph else None
        self._kv_indices_buf = self._fixed
        self.module = MLAModule()
        self._planned_backend = None
        self.public_plans = 0

    def plan(self, metadata, num_heads, head_dim_ckv, causal, page_size=PS, **kw) -> None:
        self.public_plans += 1
        be = MLAPlanned(self)
        m = metadata
        be._plan_info, be._staged_int_workspace_bytes = self.module.plan_with_staged_workspace_bytes(
            be._float_workspace_buffer, be._int_workspace_buffer, be._pin_memory_int_workspace_buffer,
            m["qo_indptr"].to("cpu"), m["kv_indptr"].to("cpu"), m["kv_len_arr"].to("cpu"), num_heads,
            head_dim_ckv, causal)
        if self._use_cuda_graph:
            be._kv_indices_buf[: len(m["kv_indices"])].copy_(m["kv_indices"])
        else:
            be._kv_indices_buf = m["kv_indices"]
        be._causal, be._page_size, be._sm_scale = causal, page_size, 0.125
        self._planned_backend, self._plan_info, self._kv_indices_buf = be, be._plan_info, be._kv_indices_buf


    def run(self, query, kv_cache, out, lse=None) -> None:
        be, (q_nope, q_pe) = self._planned_backend, query
        rank = q_nope.shape[-1]
        self.module.run(be._float_workspace_buffer, be._int_workspace_buffer, be._plan_info, q_nope, q_pe,
                        kv_cache[..., :rank], kv_cache[..., rank:], be._kv_indices_buf, out, lse, int(be._causal),
                        q_nope.shape[1], be._page_size, be._sm_scale, False, 1.0, 1.0, None)


def mla_csr(qo_lens, kv_lens, pages) -> dict:
    table = torch.zeros(len(pages), max(64, *map(len, pages)), dtype=torch.int32)
    kv = paged_kv_indices(table, kv_lens, PS, pages)
    return dict(qo_indptr=qo_indptr(qo_lens), kv_indptr=kv.indptr, kv_indices=kv.indices, kv_len_arr=kv.kv_lens)


MLA_STEPS = [([1, 1], [40, 3], [[1, 2, 3], [4]]), ([5], [20], [[7, 8]]),
             ([1, 1, 1], [17, 33, 2], [[9, 10], [11, 12, 13], [14]])]


def fake_capacity(most: int = 100):
    def work_count(q_lens, kv_lens, heads, sms, causal):  # stands for FlashInfer's exact count
        return sum(q_lens) + sum(kv_lens) // 16
    return lambda device: (work_count, most, 132)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_fast_mla_plan_plans_as_the_public_plan_does(monkeypatch, graph):
    from pieceworks.backends.mla import flashinfer_fast

    monkeypatch.setattr(flashinfer_fast, "fa_mla_capacity", fake_capacity())
    fast_w, ref_w = MLAWrapper(graph), MLAWrapper(graph)
    fast_w.plan(mla_csr(*MLA_STEPS[0]), 16, 512, False)  # a wrapper's first plan: public
    csr = mla_csr(*MLA_STEPS[1])
    fast = FastMLAPlan.record(fast_w, lambda: fast_w.plan(csr, 16, 512, True), csr, 16, 512, True, PS)
    assert fast is not None and fast_w.public_plans == 2
    planned = fast_w._planned_backend
    for qo_lens, kv_lens, pages in MLA_STEPS * 2:
        causal = max(qo_lens) > 1
        csr = mla_csr(qo_lens, kv_lens, pages)
        assert fast(fast_w, csr, 16, 512, causal, PS)
        ref_w.plan(mla_csr(qo_lens, kv_lens, pages), 16, 512, causal)
        a, b = fast_w._planned_backend, ref_w._planned_backend
        assert a is planned and fast_w.public_plans == 2  # no public plan, no new backend object
        assert same(fast_w.module.plans[-1], ref_w.module.plans[-1])
        assert a._plan_info == b._plan_info == fast_w._plan_info and a._staged_int_workspace_bytes == 96
        assert a._causal == b._causal == causal
        n = len(csr["kv_indices"])
        assert torch.equal(a._kv_indices_buf[:n], b._kv_indices_buf[:n])
        if graph:
            assert a._kv_indices_buf is fast_w._fixed


def test_fast_mla_plan_leaves_other_forms_and_steps_over_capacity_to_the_public_plan(monkeypatch):
    from pieceworks.backends.mla import flashinfer_fast

    monkeypatch.setattr(flashinfer_fast, "fa_mla_capacity", fake_capacity(most=30))
    csr = mla_csr(*MLA_STEPS[0])
    w = MLAWrapper()
    assert FastMLAPlan.record(w, lambda: w.plan(csr, 16, 512, False), csr, 16, 512, False, PS) is None  # first plan
    assert w.public_plans == 1
    # the planner called with other dimensions than the backend's: no recording
    assert FastMLAPlan.record(w, lambda: w.plan(csr, 8, 512, False), csr, 16, 512, False, PS) is None
    fast = FastMLAPlan.record(w, lambda: w.plan(csr, 16, 512, False), csr, 16, 512, False, PS)
    assert fast is not None and w.public_plans == 3
    before = (w._plan_info, len(w.module.plans))
    big = mla_csr([1], [600], [list(range(38))])  # 1 + 600 // 16 = 38 work items > 30
    assert not fast(w, big, 16, 512, False, PS) and (w._plan_info, len(w.module.plans)) == before
    assert not fast(w, csr, 16, 576, False, PS)  # another latent width
    assert not fast(w, csr, 16, 512, False, 2 * PS)  # another page size
    w.plan(csr, 16, 512, False)  # any public plan in between: a new backend object, this recording is stale
    assert not fast(w, csr, 16, 512, False, PS)
    monkeypatch.setattr(flashinfer_fast, "fa_mla_capacity", lambda device: None)  # FlashInfer of another form
    assert FastMLAPlan.record(w, lambda: w.plan(csr, 16, 512, False), csr, 16, 512, False, PS) is None


def test_the_mla_backend_plans_fast_from_its_third_plan_and_records_anew_after_a_public_one(monkeypatch):
    import sys
    import types

    from pieceworks.backends.mla import flashinfer_fast
    from pieceworks.backends.base import BackendSpec, ModelFacts
    from pieceworks.backends.mla.flashinfer import FlashInferMLABackend

    monkeypatch.setattr(flashinfer_fast, "fa_mla_capacity", fake_capacity(most=30))
    stub = types.ModuleType("flashinfer.mla")
    stub.MLAPlanMetadata = types.SimpleNamespace(csr=lambda **kw: kw)  # FlashInfer's CSR metadata: the arrays
    monkeypatch.setitem(sys.modules, "flashinfer.mla", stub)
    facts = ModelFacts(arch="deepseek_v3", dtype=torch.bfloat16, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                       page_size=PS)
    backend = FlashInferMLABackend(BackendSpec.for_device(torch.device("cpu"), model=facts))
    w = MLAWrapper()
    args = dict(num_heads=16, head_dim_ckv=512, causal=False, page_size=PS)
    for i in range(4):
        backend._plan_wrapper(w, mla_csr(*MLA_STEPS[0]), args)
        assert w.public_plans == min(i + 1, 2)  # public, public + recording, then the FastMLAPlan
    backend._plan_wrapper(w, mla_csr([1], [600], [list(range(38))]), args)  # over capacity: public
    assert w.public_plans == 3 and id(w) not in backend._fast
    for i in range(3):
        backend._plan_wrapper(w, mla_csr(*MLA_STEPS[0]), args)
    assert w.public_plans == 4 and backend._fast[id(w)] is not None  # recorded anew, then fast
    backend.options = replace(backend.options, fast_plan=False)
    backend._fast.clear()
    for _ in range(2):
        backend._plan_wrapper(w, mla_csr(*MLA_STEPS[0]), args)
    assert w.public_plans == 6


@pytest.fixture
def mask_mode(monkeypatch):
    """flashinfer.utils.MaskMode where FlashInfer is not installed (FlashInfer 0.7: non-causal 0, causal 1)."""
    import enum
    import sys
    import types

    utils = types.ModuleType("flashinfer.utils")
    utils.MaskMode = enum.Enum("MaskMode", {"NON_CAUSAL": 0, "CAUSAL": 1})
    monkeypatch.setitem(sys.modules, "flashinfer.utils", utils)


def test_fast_mla_run_calls_the_kernel_as_run_does_under_every_later_plan(monkeypatch, mask_mode):
    from pieceworks.backends.mla import flashinfer_fast

    monkeypatch.setattr(flashinfer_fast, "fa_mla_capacity", fake_capacity())
    w = MLAWrapper()
    q_nope, q_pe, out = torch.zeros(5, 16, 512), torch.zeros(5, 16, 64), torch.zeros(5, 16, 512)
    cache = torch.zeros(8, PS, 576)
    ckv, kpe = cache[..., :512], cache[..., 512:]
    w.plan(mla_csr(*MLA_STEPS[1]), 16, 512, True)
    fast = FastMLARun.record(w, q_nope, q_pe, cache, out, ckv, kpe)
    assert fast is not None and len(w.module.runs) == 1  # the recorded run() ran once
    csr = mla_csr(*MLA_STEPS[0])
    plan = FastMLAPlan.record(w, lambda: w.plan(csr, 16, 512, False), csr, 16, 512, False, PS)
    steps = [(MLA_STEPS[2], False, "fast"), (MLA_STEPS[1], True, "public"), (MLA_STEPS[0], False, "record"),
             (MLA_STEPS[2], True, "fast")]
    for (qo_lens, kv_lens, pages), causal, how in steps:
        csr = mla_csr(qo_lens, kv_lens, pages)
        if how == "public":  # a new planned backend (workspace, plan, indices)
            w.plan(csr, 16, 512, causal)
        elif how == "record":  # as the backend does after a public plan
            plan = FastMLAPlan.record(w, lambda csr=csr: w.plan(csr, 16, 512, causal), csr, 16, 512, causal, PS)
        else:
            assert plan(w, csr, 16, 512, causal, PS)
        assert fast(w, q_nope, q_pe, ckv, kpe, out)
        w.run((q_nope, q_pe), cache, out)
        assert same(w.module.runs[-2], w.module.runs[-1])


def test_fast_mla_run_stays_off_for_calls_of_another_form(mask_mode):
    w = MLAWrapper()
    q_nope, q_pe, out, cache = torch.zeros(5, 16, 512), torch.zeros(5, 16, 64), torch.zeros(5, 16, 512), \
        torch.zeros(8, PS, 576)
    w.plan(mla_csr(*MLA_STEPS[1]), 16, 512, True)
    lse = torch.zeros(5, 16)
    w.run = lambda query, kv_cache, out, w=w: MLAWrapper.run(w, query, kv_cache, out, lse=lse)
    assert FastMLARun.record(w, q_nope, q_pe, cache, out, cache[..., :512], cache[..., 512:]) is None
    w = MLAWrapper()
    w.plan(mla_csr(*MLA_STEPS[1]), 16, 512, True)
    other = torch.zeros(8, PS, 576)  # views of another cache than the one run() splits
    assert FastMLARun.record(w, q_nope, q_pe, cache, out, other[..., :512], other[..., 512:]) is None
    assert len(w.module.runs) == 1  # the run() still ran


def test_the_mla_backend_runs_eager_layers_through_one_recorded_fast_run(monkeypatch, mask_mode):
    import types

    from pieceworks.backends.mla import flashinfer_fast
    from pieceworks.backends.base import BackendSpec, ModelFacts
    from pieceworks.backends.mla.flashinfer import FlashInferMLABackend
    from pieceworks.executor.kv_cache import KVLayout, KVPool

    monkeypatch.setattr(flashinfer_fast, "fa_mla_capacity", fake_capacity())
    facts = ModelFacts(arch="deepseek_v3", dtype=torch.float32, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                       page_size=PS)
    backend = FlashInferMLABackend(BackendSpec.for_device(torch.device("cpu"), model=facts))
    pool = KVPool(KVLayout("mla", 2, latent_dim=576), 8, PS, torch.float32, torch.device("cpu"))
    w = MLAWrapper()
    w.plan(mla_csr(*MLA_STEPS[1]), 16, 512, True)
    wrapper_runs = []
    w.run = lambda query, kv_cache, out, w=w: (wrapper_runs.append(1), MLAWrapper.run(w, query, kv_cache, out))
    backend._eager = backend._wrapper = w
    backend._rows, backend._sm_scale = 5, 0.125
    backend._meta = types.SimpleNamespace(slot_mapping=torch.arange(5) + PS)
    q_nope, q_pe, c_kv, k_pe = torch.randn(5, 16, 512), torch.randn(5, 16, 64), torch.randn(5, 512), torch.randn(5, 64)
    out = torch.zeros(5, 16, 512)
    for layer in (0, 1, 0, 1):
        backend.forward(q_nope, q_pe, c_kv, k_pe, out, layer, 0.125, pool)
    # the first call ran run() while recording; the other three called the kernel module directly
    assert backend._fast_run is not None and len(wrapper_runs) == 1 and len(w.module.runs) == 4
    for args, layer in zip(w.module.runs, (0, 1, 0, 1)):  # each layer's cache views
        assert args[5].data_ptr() == pool.latent_cache(layer).data_ptr()
        assert args[6].data_ptr() == pool.latent_cache(layer)[..., 512:].data_ptr()
        assert args[3].data_ptr() == q_nope.data_ptr()
    assert torch.equal(pool.latent_cache(1).view(-1, 576)[PS : PS + 5, :512], c_kv)  # the K/V rows were written
