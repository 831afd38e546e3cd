"""FlashInfer attention and MLA on a GPU (the H200 through the device tool): every named scenario against
the dense reference, padded token counts, FULL-graph capture and replay with a re-plan before every
replay, the executor end to end against the torch backends, and what the Blackwell-only backends say on
this GPU. Variant fa2 throughout: a fresh machine JIT-compiles each FlashInfer module once (fa2 ~20 s,
fa3 prefill ~75 s); benchmarks/attention.py exercises fa3.

    pytest tests/gpu/test_flashinfer.py        (skipped without CUDA or flashinfer)
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from pieceworks.backends.attention.flashinfer import FlashInferAttentionBackend, FlashInferOptions
from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.mla.flashinfer import FlashInferMLABackend
from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata
from pieceworks.executor.kv_cache import KVLayout, KVPool
from pieceworks.testing import scenarios as S

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                       reason="flashinfer is not importable (pip install 'pieceworks[gpu]')"),
]
FA2 = FlashInferOptions("fa2")
DEV = torch.device("cuda")
BF16 = torch.bfloat16
TOL = 2e-2  # the suite's bf16 tolerance (relative Frobenius error)


def rel_err(out, ref) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def gqa_backend(page_size: int, heads=8, kv_heads=2, head_dim=64):
    facts = ModelFacts(dtype=BF16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size)
    spec = BackendSpec.for_device(DEV, model=facts)
    assert FlashInferAttentionBackend.check(spec) == []
    return FlashInferAttentionBackend(spec, FA2)


def mla_backend(page_size: int, heads=4):
    facts = ModelFacts(arch="deepseek_v3", dtype=BF16, num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64,
                       page_size=page_size)
    spec = BackendSpec.for_device(DEV, model=facts)
    assert FlashInferMLABackend.check(spec) == []
    return FlashInferMLABackend(spec, FA2)


def padded(meta: StepMetadata, extra: int, graph: GraphMode = GraphMode.PIECEWISE) -> StepMetadata:
    """The same step padded by `extra` tokens, as a piecewise graph size pads it (KV to the reserved slot)."""
    pad = torch.zeros(extra, dtype=torch.int64, device=meta.device)
    return replace(meta, graph_mode=graph, slot_mapping=torch.cat([meta.slot_mapping, pad]),
                   positions=torch.cat([meta.positions, pad]), _cache={})


def pad_rows(t: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([t, torch.randn(extra, *t.shape[1:], device=t.device).to(t.dtype)])


# ---------------------------------------------------------------- scenarios, eager and padded
@pytest.mark.parametrize("sc", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
def test_attention_scenarios(sc):
    impl = gqa_backend(sc.page_size)
    case = S.attention_case(sc, 8, 2, 64, BF16, DEV)
    q, k, v = case.inputs["q"], case.inputs["k"], case.inputs["v"]
    out = torch.full_like(q, float("nan"))
    impl.plan(case.meta)
    impl.forward(q, k, v, out, 0, 64**-0.5, case.pool)
    assert torch.isfinite(out).all() and rel_err(out, case.expected) < TOL
    if sc.mode is ForwardMode.DECODE:
        return
    # padded to a piecewise capture size: real rows unchanged, padded rows zero
    case = S.attention_case(sc, 8, 2, 64, BF16, DEV)
    extra = 5
    out = torch.full((q.shape[0] + extra, *q.shape[1:]), float("nan"), dtype=BF16, device=DEV)
    impl.plan(padded(case.meta, extra))
    impl.forward(pad_rows(q, extra), pad_rows(k, extra), pad_rows(v, extra), out, 0, 64**-0.5, case.pool)
    assert rel_err(out[: q.shape[0]], case.expected) < TOL and (out[q.shape[0]:] == 0).all()


def test_fast_plan_and_run_match_flashinfers_public_plan():
    """Extend/mixed steps one after another through FastPlan + a rebound FastRun, against a backend on
    FlashInfer's public plan and run(): the same outputs to the bit and the same wrapper state."""
    fast, public = gqa_backend(16), gqa_backend(16)
    public.options = FlashInferOptions("fa2", fast_plan=False)
    extend = [sc for sc in S.ATTENTION_SCENARIOS if sc.mode is not ForwardMode.DECODE]
    for i, sc in enumerate(extend * 2):
        case = S.attention_case(sc, 8, 2, 64, BF16, DEV, seed=i)
        q, k, v = case.inputs["q"], case.inputs["k"], case.inputs["v"]
        outs = []
        for impl in (fast, public):
            out = torch.full_like(q, float("nan"))
            impl.plan(case.meta)
            for _ in range(2):  # the second call through FastRun
                impl.forward(q, k, v, out, 0, 64**-0.5, case.pool)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), sc.name
        assert rel_err(outs[0], case.expected) < TOL
        if i >= 1:  # the second plan records the FastPlan, later ones use it
            assert fast._fast_plan is not None and fast._fast is not None and fast._fast.plan_slots is not None
        a, b = fast._prefill, public._prefill
        n = len(case.meta.extend_lens)
        for name in ("_batch_size", "_qo_indptr_last", "_max_q_len", "_max_kv_len"):
            assert getattr(a, name) == getattr(b, name), name
        assert list(a._plan_info) == list(b._plan_info)
        for name in ("_qo_indptr_buf", "_paged_kv_indptr_buf", "_paged_kv_indices_buf", "_paged_kv_last_page_len_buf"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.equal(a._kv_lens_buffer[:n], b._kv_lens_buffer[:n])


def test_fast_plan_gathering_pages_on_the_gpu_matches_flashinfers_public_plan(monkeypatch):
    """The same with every plan of several sequences gathering its page indices on the GPU
    (backends/page_gather_cuda.py, from the step's device page table): the same outputs and wrapper state."""
    from pieceworks.backends import page_gather_cuda

    launches = []
    call = page_gather_cuda.PageGather.__call__
    monkeypatch.setattr(page_gather_cuda, "MIN_PAGES", 1)
    monkeypatch.setattr(page_gather_cuda.PageGather, "__call__", lambda self, t: launches.append(1) or call(self, t))
    test_fast_plan_and_run_match_flashinfers_public_plan()
    assert launches


def test_page_gather_matches_the_host_indices():
    """The kernel against `flat_pages` at a serving-like mix: 64 sequences of 1-300 pages in a wider table."""
    from pieceworks.backends.attention.flashinfer_fast import flat_pages
    from pieceworks.backends.page_gather_cuda import PageGather

    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(1, 301, (64,), generator=gen).tolist()
    table = torch.randint(0, 10**6, (64, 320), generator=gen, dtype=torch.int32)
    pages = [table[i, :c].tolist() for i, c in enumerate(counts)]
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    indices = torch.full((sum(counts) + 5,), -1, dtype=torch.int32, device=DEV)
    PageGather(indices, indptr)(table.to(DEV))
    assert torch.equal(indices[: sum(counts)].cpu(), torch.from_numpy(flat_pages(pages, counts)))
    assert (indices[sum(counts):] == -1).all()


def test_fast_run_with_fp8_scales_matches_flashinfers_public_run():
    """An FP8 pool whose layers have their own k_scale / v_scale: extend steps through the recorded FastRun equal
    FlashInfer's public run() with those scales, to the bit (and the suite's float64 reference within TOL)."""
    facts = ModelFacts(dtype=BF16, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, kv_fp8=True)
    impl = FlashInferAttentionBackend(BackendSpec.for_device(DEV, model=facts), FA2)
    extend = [sc for sc in S.ATTENTION_SCENARIOS if sc.mode is not ForwardMode.DECODE and sc.page_size == 16]
    layer_scales = [(0.0125, 0.01), (0.02, 0.05), (1.0, 1.0), (0.0125, 0.01)]
    for i, sc in enumerate(extend):
        for scales in layer_scales:
            case = S.attention_case(sc, 8, 2, 64, BF16, DEV, seed=i, kv_scales=scales)
            q, k, v = case.inputs["q"], case.inputs["k"], case.inputs["v"]
            out, ref = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
            impl.plan(case.meta)
            impl.forward(q, k, v, out, 0, 64**-0.5, case.pool)
            kw = dict(k_scale=scales[0], v_scale=scales[1]) if scales != (1.0, 1.0) else {}
            impl._prefill.run(q, (case.pool.k_cache(0), case.pool.v_cache(0)), out=ref, **kw)
            assert torch.equal(out, ref), (sc.name, scales)
            assert rel_err(out, case.expected) < TOL
    assert impl._fast is not None and impl._fast.scale_at is not None  # the later layers ran through it


@pytest.mark.parametrize("heads", [4, 20, 128])  # 20 (GLM-4.7-Flash): planned at 32, the queries padded
@pytest.mark.parametrize("sc", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
def test_mla_scenarios(sc, heads):
    impl = mla_backend(sc.page_size, heads)
    case = S.mla_case(sc, heads, 512, 64, BF16, DEV)
    i = case.inputs
    out = torch.full_like(i["q_nope"], float("nan"))
    impl.plan(case.meta)
    impl.forward(i["q_nope"], i["q_pe"], i["c_kv"], i["k_pe"], out, 0, i["scale"], case.pool)
    assert torch.isfinite(out).all() and rel_err(out, case.expected) < TOL
    if sc.mode is ForwardMode.DECODE:
        return
    case = S.mla_case(sc, heads, 512, 64, BF16, DEV)
    i, n, extra = case.inputs, case.inputs["q_nope"].shape[0], 3
    out = torch.full((n + extra, heads, 512), float("nan"), dtype=BF16, device=DEV)
    impl.plan(padded(case.meta, extra))
    impl.forward(pad_rows(i["q_nope"], extra), pad_rows(i["q_pe"], extra), pad_rows(i["c_kv"], extra),
                 pad_rows(i["k_pe"], extra), out, 0, i["scale"], case.pool)
    assert rel_err(out[:n], case.expected) < TOL and (out[n:] == 0).all()


# ---------------------------------------------------------------- FULL graphs: capture once, replan, replay
DECODE_STEPS = [
    S.Scenario("a", ((5, 1), (17, 1), (1, 1), (33, 1)), page_size=16),
    S.Scenario("b", ((60, 1), (2, 1), (9, 1)), page_size=16),
    S.Scenario("c", ((3, 1), (40, 1), (21, 1), (7, 1), (1, 1)), page_size=16),
]
BS, WIDTH, PAGES = 8, 8, 64


class GraphHarness:
    """What the decode graph runner does, for one backend and one layer: static inputs and page table,
    plan before capture, one eager warm-up, capture, then plan + copy + replay per step."""

    def __init__(self, impl, pool: KVPool, inputs: dict, op):
        self.impl, self.pool, self.op = impl, pool, op
        self.static = {k: torch.zeros(BS, *v.shape[1:], dtype=v.dtype, device=DEV) for k, v in inputs.items()}
        self.table = torch.zeros(BS, WIDTH, dtype=torch.int32, device=DEV)
        self.slots = torch.zeros(BS, dtype=torch.int64, device=DEV)
        self.out = torch.zeros(BS, *self.out_shape(inputs), dtype=BF16, device=DEV)
        self.graph = None

    def out_shape(self, inputs):
        q = inputs["q"] if "q" in inputs else inputs["q_nope"]
        return q.shape[1:]

    def meta(self, sc: S.Scenario) -> StepMetadata:
        return StepMetadata(
            mode=ForwardMode.DECODE, graph_mode=GraphMode.FULL, extend_lens=[n for _, n in sc.seqs],
            prefix_lens=[p for p, _ in sc.seqs], page_size=sc.page_size, page_table=self.table,
            slot_mapping=self.slots, positions=torch.zeros(BS, dtype=torch.int64, device=DEV), graph_batch_size=BS)

    def step(self, sc: S.Scenario, case: S.AttentionCase) -> torch.Tensor:
        n = len(sc.seqs)
        self.pool.buffer.zero_()  # the case's pages (prefix KV) become the first pages of the static pool
        page_dim = 1 if self.pool.layout.kind == "mla" else 2
        self.pool.buffer.narrow(page_dim, 0, case.pool.buffer.shape[page_dim]).copy_(case.pool.buffer)
        self.table.zero_()
        self.table[:n, : case.meta.page_table.shape[1]].copy_(case.meta.page_table)
        self.slots.zero_()
        self.slots[:n].copy_(case.meta.slot_mapping)
        for k, v in self.static.items():
            v.zero_()
            v[:n].copy_(case.inputs[k])
        meta = self.meta(sc)
        self.impl.plan(meta)
        if self.graph is None:
            self.op(self.impl, self.static, self.out, self.pool, case)  # eager warm-up (learns the scale)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.op(self.impl, self.static, self.out, self.pool, case)
        self.graph.replay()
        return self.out[:n].clone()


def _gqa_op(impl, s, out, pool, case):
    impl.forward(s["q"], s["k"], s["v"], out, 0, 64**-0.5, pool)


def _mla_op(impl, s, out, pool, case):
    impl.forward(s["q_nope"], s["q_pe"], s["c_kv"], s["k_pe"], out, 0, case.inputs["scale"], pool)


def test_attention_full_graph_replays_with_new_lengths():
    impl = gqa_backend(16)
    pool = KVPool(KVLayout("gqa", 1, 2, 64), PAGES, 16, BF16, DEV)
    harness = None
    for seed, sc in enumerate(DECODE_STEPS):
        case = S.attention_case(sc, 8, 2, 64, BF16, DEV, seed=seed)
        inputs = {k: case.inputs[k] for k in ("q", "k", "v")}
        harness = harness or GraphHarness(impl, pool, inputs, _gqa_op)
        got = harness.step(sc, case)
        assert rel_err(got, case.expected) < TOL, sc.name
        assert torch.isfinite(harness.out).all()  # padded rows decode the reserved page
    assert list(impl._graph_decode) == [BS]


def test_mla_full_graph_replays_with_new_lengths():
    impl = mla_backend(16, heads=16)
    pool = KVPool(KVLayout("mla", 1, latent_dim=576), PAGES, 16, BF16, DEV)
    harness = None
    for seed, sc in enumerate(DECODE_STEPS):
        case = S.mla_case(sc, 16, 512, 64, BF16, DEV, seed=seed)
        inputs = {k: case.inputs[k] for k in ("q_nope", "q_pe", "c_kv", "k_pe")}
        harness = harness or GraphHarness(impl, pool, inputs, _mla_op)
        got = harness.step(sc, case)
        assert rel_err(got, case.expected) < TOL, sc.name
        assert torch.isfinite(harness.out).all()
    assert list(impl._graph) == [BS]


def _mla_pair(heads: int):
    """(a backend on FastMLAPlan and FastMLARun, one on FlashInfer's public MLA plan and run())."""
    fast, public = mla_backend(16, heads), mla_backend(16, heads)
    public.options = FlashInferOptions("fa2", fast_plan=False)
    public._fast_run_refused = True  # as after a recording of another form: run() on every call
    return fast, public


@pytest.mark.parametrize("heads", [16, 128])
def test_mla_fast_plan_matches_flashinfers_public_plan(heads):
    """MLA steps of every mode one after another, planned through FastMLAPlan once a wrapper has one and run
    through FastMLARun, against a backend on FlashInfer's public plan and run(): the same outputs to the bit and
    the same schedule."""
    fast, public = _mla_pair(heads)
    scenarios = [replace(sc, page_size=16) for sc in S.ATTENTION_SCENARIOS]
    for i, sc in enumerate(scenarios * 2):
        case = S.mla_case(sc, heads, 512, 64, BF16, DEV, seed=i)
        x = case.inputs
        outs = []
        for impl in (fast, public):
            out = torch.full_like(x["q_nope"], float("nan"))
            impl.plan(case.meta)
            for _ in range(2):  # the backend's first call records the FastMLARun, later ones use it
                impl.forward(x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], out, 0, x["scale"], case.pool)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), sc.name
        assert rel_err(outs[0], case.expected) < TOL, sc.name
        assert fast._fast_run is not None and public._fast_run is None
        # the first step's re-plan with the model's scale records the FastMLAPlan: fast from the second step on
        if i >= 1:
            assert fast._fast.get(id(fast._eager)) is not None, sc.name
            assert fast._eager._planned_backend is fast._fast[id(fast._eager)].backend
        a, b = fast._eager._planned_backend, public._eager._planned_backend
        assert list(a._plan_info) == list(b._plan_info) and a._causal == b._causal, sc.name


def test_mla_fast_plan_in_full_graphs_matches_flashinfers_public_plan():
    """FULL decode graphs captured once, re-planned through FastMLAPlan before every replay: the same bits
    as a graph re-planned through FlashInfer's public plan."""
    fast, public = _mla_pair(16)
    harnesses = {}
    for seed, sc in enumerate(DECODE_STEPS * 2):
        got = []
        for impl in (fast, public):
            case = S.mla_case(sc, 16, 512, 64, BF16, DEV, seed=seed)
            if impl not in harnesses:
                pool = KVPool(KVLayout("mla", 1, latent_dim=576), PAGES, 16, BF16, DEV)
                inputs = {k: case.inputs[k] for k in ("q_nope", "q_pe", "c_kv", "k_pe")}
                harnesses[impl] = GraphHarness(impl, pool, inputs, _mla_op)
            got.append(harnesses[impl].step(sc, case))
            assert rel_err(got[-1], case.expected) < TOL, sc.name
        assert torch.equal(got[0], got[1]), sc.name
    assert fast._fast.get(id(fast._graph[BS])) is not None


# ---------------------------------------------------------------- end to end through the executor
def _executor(arch: str, attention: str, sizes: dict):
    from pieceworks import Executor

    backends = {"attention": attention, "mla": attention, "options": {"flashinfer": {"variant": "fa2"}}}
    cfg = {"model": {"arch": arch, "preset": "tiny", "sizes": sizes}, "runtime": {"device": "cuda", "dtype": "bfloat16"},
           "kv_cache": {"num_tokens": 2048, "page_size": 16}, "backends": backends,
           "cuda_graph": {"piecewise": {"enabled": "on", "sizes": [16, 32, 64], "max_tokens": 64},
                          "decode": {"enabled": "on", "batch_sizes": [1, 2, 4]},
                          # full extend graphs (on by default) run extend steps on attention.triton_all:
                          # off, the prompts go through FlashInfer's piecewise and eager extends
                          "extend": {"enabled": "off"}}}
    return Executor.from_config(cfg, progress=False)


E2E = {
    "llama": {"head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256},
    "deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32},
}


@pytest.mark.parametrize("arch", list(E2E))
def test_executor_matches_the_torch_backends(arch):
    """Same random weights, FlashInfer vs torch backends: prompt logits (piecewise-graph and eager
    extends), then teacher-forced decode steps (FULL graphs) fed the reference's greedy tokens."""
    from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode

    fi, ref = _executor(arch, "flashinfer", E2E[arch]), _executor(arch, "torch", E2E[arch])
    op = "attention" if arch == "llama" else "mla"
    # the steps below: extends eager and piecewise, decodes in FULL graphs (the table's full-extend entries go unused)
    steps = [(ForwardMode.EXTEND, GraphMode.EAGER), (ForwardMode.EXTEND, GraphMode.PIECEWISE),
             (ForwardMode.DECODE, GraphMode.FULL)]
    assert fi.extend_graphs is None
    assert {getattr(fi.table.step(m, g), op).name for m, g in steps} == {"flashinfer"}
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 9, 70)]
    for a, b in zip(fi.score(prompts), ref.score(prompts)):
        assert rel_err(a.float(), b.float()) < 3e-2
    seqs = {e: [e.new_sequence() for _ in prompts] for e in (fi, ref)}
    logits = {e: e.forward(ForwardBatch(seqs[e], [p[:30] for p in prompts])) for e in (fi, ref)}
    agree = steps = 0
    for step in range(7):  # the prompt chunk's logits, then six decode steps'
        assert rel_err(logits[fi].float(), logits[ref].float()) < 3e-2, step
        agree += int((logits[fi].argmax(-1) == logits[ref].argmax(-1)).sum())
        steps += len(prompts)
        if step == 6:
            break
        nxt = [[t] for t in logits[ref].argmax(-1).tolist()]
        batch = {e: ForwardBatch(seqs[e], nxt) for e in (fi, ref)}
        assert batch[fi].mode is ForwardMode.DECODE
        logits = {e: e.forward(batch[e]) for e in (fi, ref)}
    print(f"{arch}: greedy tokens agree on {agree}/{steps} teacher-forced steps")
    assert agree >= 0.8 * steps  # bf16 rounding may flip a near tie, not most tokens


# ---------------------------------------------------------------- the Blackwell backends on this GPU
def test_blackwell_backends_refuse_this_gpu_with_reasons():
    from pieceworks.backends.fp4_gemm.flashinfer import fp4_quantize_activation
    from pieceworks.backends.registry import Registry

    cap = torch.cuda.get_device_capability()
    if cap[0] >= 10:
        pytest.skip(f"this GPU is sm_{cap[0]}{cap[1]}: the Blackwell backends can run here")
    spec = BackendSpec.for_device(DEV, model=ModelFacts(arch="deepseek_v3", dtype=BF16, num_heads=16, kv_lora_rank=512,
                                                        qk_rope_head_dim=64, page_size=64, fp4=True, moe_experts=8,
                                                        moe_quant="nvfp4"))
    need = f"(this GPU: {cap[0]}.{cap[1]})"
    registered = Registry(autoload=False).load().backends()
    mine = [c for c in registered if c.__module__.rsplit(".", 1)[1] in ("flashinfer", "trtllm")]
    assert len(mine) == 8
    for cls in mine:
        if cls.name in ("trtllm", "cutlass", "cudnn"):
            assert any(r.startswith("needs compute capability 10.x") and need in r for r in cls.check(spec)), cls.key()
        else:
            assert cls.check(spec) == [], cls.key()  # FlashInfer attention and MLA serve this GPU
    with pytest.raises(RuntimeError, match="uninitialised memory"):  # the guard reads the real device
        fp4_quantize_activation(torch.randn(4, 32, dtype=BF16, device=DEV), torch.ones(1, device=DEV))
