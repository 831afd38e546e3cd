"""FastPlan and FastRun (backends/attention/flashinfer_fast.py) on CPU, against a stand-in wrapper that plans
and runs the way FlashInfer 0.7's BatchPrefillWithPagedKVCacheWrapper does for an eager fa2 plan (the
planner's and the kernel's argument lists, the attributes a plan sets). tests/gpu/test_flashinfer.py
compares both with the real wrapper."""

from __future__ import annotations

import torch

from pieceworks.backends.attention.flashinfer import paged_kv_indices, qo_indptr
from pieceworks.backends.attention.flashinfer_fast import FastPlan, FastRun


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
