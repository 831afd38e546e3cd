"""The backend conformance suite: every selected backend against dense references and the op contracts.

Run it for one backend (pieceworks registers the pytest plugin `pieceworks.testing.plugin` by entry point):

    pytest --pyargs pieceworks.testing.suite --pieceworks-backend attention.mine
    pytest --pyargs pieceworks.testing.suite --pieceworks-backend attention.mine --pieceworks-device cuda

What runs, per backend and device (the plugin parametrizes `backend` and `device`):
- attention / mla: the named scenarios (up to a 2,101-token context), attention's with q, k and v as
  separate tensors and as strided views of one fused qkv projection, as the model passes them;
  `contract` runs step chains over one multi-layer pool for every graph mode the backend declares
  (`pieceworks.testing.contract`: layer_id, a non-default scale, K/V written by one step read by the
  next, re-plans with new lengths, PIECEWISE padding, FULL metadata with graph-batch padding); `shapes`
  sweeps head shapes and page sizes through `check()` (what it accepts must be right); `graph_trace`
  traces forward whole for backends declaring FULL; on CUDA `cuda_graph` captures, re-plans and replays.
  Attention backends declaring `fp8_kv` run the scenarios and the step chains again over FP8 pools
  (`test_attention_fp8_kv`, `test_contract_fp8_kv`: two layers with scales of their own).
- fp4_gemm / moe: shapes and numerics against dense references in float32 (CPU) and bf16, the result's
  shape and dtype (x's), the fused entry points, CUDA-graph capture.
Every case checks that forward left its input tensors as they were (references are built from copies
taken before the call), and a NotImplementedError without a message names the method to define. A case
the backend can't serve is skipped with the backend's own reasons; a backend under test none of whose
cases ran fails the run, and so does a broken plugin in a run of every backend (see the plugin).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pieceworks.backends.base import ModelFacts, parse_options
from pieceworks.backends.fp4_gemm.base import Fp4Weight
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.kv import quantize_kv
from pieceworks.testing import contract as C
from pieceworks.testing import scenarios as S
from pieceworks.testing.checks import (
    ACTIVATION_DTYPES, assert_close, assert_unchanged, assert_written, build, CONTRACT, device_dtype, dtype_name,
    DTYPES, for_op, GRAPH_FORWARD_MODES, GRAPHS, reasons_of, rel_err, SHAPES, snapshot, spec_for,
)
from pieceworks.testing.suite_fp4 import (  # noqa: F401 (collected here)
    test_fp4_gemm, test_fp4_gemm_fused_epilogues,
    test_fp4_gemm_fused_norm_and_residual, test_fp4_gemm_graph_trace, test_moe,
)


# ---------------------------------------------------------------------------- attention and mla
QKV = {"tensors": "q, k, v separate tensors", "qkv_views": "q, k, v strided views of one fused qkv projection"}


@pytest.mark.parametrize("qkv", list(QKV))
@pytest.mark.parametrize("scenario", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
@for_op("attention", dtypes=ACTIVATION_DTYPES)
def test_attention(backend, scenario, qkv, device, dtype):
    """A named scenario, with q, k and v as separate tensors and as the Llama attention passes them:
    column views of one fused qkv projection (`scenarios.fused_qkv_views`); float32 (CPU) and bf16 (a backend
    serving bf16 only gets every scenario on the CPU too)."""
    dtype = DTYPES[dtype]
    facts = ModelFacts(dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=64, page_size=scenario.page_size)
    impl = build(backend, spec_for(device, facts), scenario.mode)
    case = S.attention_case(scenario, 8, 2, 64, dtype, torch.device(device))
    q, k, v = (case.inputs[n] for n in "qkv")
    if qkv == "qkv_views":
        q, k, v = S.fused_qkv_views(q, k, v)
    what = f"{backend.key()} {scenario.name} ({dtype_name(dtype)}, {QKV[qkv]})"
    tol, hint = C.TOLERANCE[dtype], ""
    out = _attend(impl, case, q, k, v, what)
    if qkv == "qkv_views" and not rel_err(out, case.expected) <= tol:
        again = _attend(impl, case, q.contiguous(), k.contiguous(), v.contiguous(), what)
        if rel_err(again, case.expected) <= tol:
            hint = ("; contiguous copies of the same q, k, v pass: read q, k and v through their strides (the "
                    "model passes column views of its fused qkv projection) or make them contiguous")
    assert_close(out, case.expected, tol, what, hint)


@pytest.mark.parametrize("scenario", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
@for_op("attention")
def test_attention_sliding_window(backend, scenario, device):
    """Sliding-window layers (`ModelFacts.sliding_windows`) among full ones, for backends that declare `windows`:
    layers 0, 1 and 2 of one step with windows 6, none and 3 (each query sees itself and the W - 1 keys before
    it), over one pool layer."""
    if not getattr(backend, "windows", False):
        pytest.skip(f"{backend.key()} declares no sliding-window attention (windows = False)")
    dtype = device_dtype(device)
    windows = (6, 0, 3)
    facts = ModelFacts(dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=64, page_size=scenario.page_size,
                       sliding_windows=windows)
    impl = build(backend, spec_for(device, facts), scenario.mode)
    cases = [S.attention_case(scenario, 8, 2, 64, dtype, torch.device(device), window=w) for w in windows]
    pool = cases[0].pool
    one_layer = SimpleNamespace(k_cache=lambda layer: pool.k_cache(0), v_cache=lambda layer: pool.v_cache(0),
                                fp8=False, scales=[(1.0, 1.0)] * 3, k_scale=lambda layer: 1.0,
                                v_scale=lambda layer: 1.0)
    impl.plan(cases[0].meta)
    for layer, (w, case) in enumerate(zip(windows, cases)):
        what = f"{backend.key()} {scenario.name}, layer {layer} of windows {windows} ({dtype_name(dtype)})"
        out = _attend(impl, case, *(case.inputs[n] for n in "qkv"), what, layer=layer, kv=one_layer, plan=False)
        assert_close(out, case.expected, C.TOLERANCE[dtype], what, "")


@pytest.mark.parametrize("scenario", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
@for_op("attention")
def test_attention_softcap(backend, scenario, device):
    """Soft-capped scores (`ModelFacts.attn_logit_softcap`, Gemma 2's), for backends that declare `softcap`; the
    cap of 1.0 bends these scores (of order 1) well away from tanh's linear range."""
    if not getattr(backend, "softcap", False):
        pytest.skip(f"{backend.key()} declares no soft-capped scores (softcap = False)")
    dtype = device_dtype(device)
    facts = ModelFacts(dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=64, page_size=scenario.page_size,
                       attn_logit_softcap=1.0)
    impl = build(backend, spec_for(device, facts), scenario.mode)
    case = S.attention_case(scenario, 8, 2, 64, dtype, torch.device(device), softcap=1.0)
    what = f"{backend.key()} {scenario.name}, softcap 1.0 ({dtype_name(dtype)})"
    out = _attend(impl, case, *(case.inputs[n] for n in "qkv"), what)
    assert_close(out, case.expected, C.TOLERANCE[dtype], what, "")


FP8_SCALES = (0.0125, 0.01)  # k_scale, v_scale: N(0, 1) keys and values span most of e4m3's range (448 x scale)


@pytest.mark.parametrize("scenario", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
@for_op("attention")
def test_attention_fp8_kv(backend, scenario, device):
    """An FP8 KV pool (`ModelFacts.kv_fp8`), for backends that declare `fp8_kv`: the step's K/V stored as
    `core.kv.quantize_kv` with the layer's scales (not 1.0, so a scale left out or applied twice shows), every
    key and value read back times them."""
    if not getattr(backend, "fp8_kv", False):
        pytest.skip(f"{backend.key()} declares no FP8 KV cache (fp8_kv = False)")
    dtype = device_dtype(device)
    facts = ModelFacts(dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=64, page_size=scenario.page_size,
                       kv_fp8=True)
    impl = build(backend, spec_for(device, facts), scenario.mode)
    case = S.attention_case(scenario, 8, 2, 64, dtype, torch.device(device), kv_scales=FP8_SCALES)
    what = f"{backend.key()} {scenario.name}, FP8 KV pool, scales {FP8_SCALES} ({dtype_name(dtype)})"
    out = _attend(impl, case, *(case.inputs[n] for n in "qkv"), what)
    assert_close(out, case.expected, C.TOLERANCE[dtype], what, "")
    rows = case.meta.slot_mapping.long()
    stored = case.pool.k_cache(0).flatten(0, 1)[rows].view(torch.uint8)
    want = quantize_kv(case.inputs["k"], FP8_SCALES[0]).view(torch.uint8).to(stored.device)
    assert torch.equal(stored, want), f"{what}: the step's keys are not stored as quantize_kv(k, k_scale)"


def _attend(impl, case: S.AttentionCase, q, k, v, what: str, layer: int = 0, kv=None,
            plan: bool = True) -> torch.Tensor:
    given, before = snapshot(q=q, k=k, v=v)
    out = torch.full_like(case.inputs["q"], float("nan"))
    if plan:
        impl.plan(case.meta)
    impl.forward(q, k, v, out, layer, 64**-0.5, case.pool if kv is None else kv)
    assert_unchanged(before, given, what)
    assert_written(out, what)
    return out


@pytest.mark.parametrize("scenario", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
@for_op("mla", dtypes=ACTIVATION_DTYPES)
def test_mla(backend, scenario, device, dtype):
    """A named scenario in float32 (CPU) and bf16 (a backend serving bf16 only gets every scenario on the CPU too)."""
    dtype = DTYPES[dtype]
    rank, rope = (64, 16) if device == "cpu" else (512, 64)
    facts = ModelFacts(arch="deepseek_v3", dtype=dtype, num_heads=4, num_kv_heads=1, kv_lora_rank=rank,
                       qk_rope_head_dim=rope, page_size=scenario.page_size)
    impl = build(backend, spec_for(device, facts), scenario.mode)
    case = S.mla_case(scenario, 4, rank, rope, dtype, torch.device(device))
    i = case.inputs
    what = f"{backend.key()} {scenario.name} ({dtype_name(dtype)})"
    given, before = snapshot(q_nope=i["q_nope"], q_pe=i["q_pe"], c_kv=i["c_kv"], k_pe=i["k_pe"])
    out = torch.full_like(i["q_nope"], float("nan"))
    impl.plan(case.meta)
    impl.forward(i["q_nope"], i["q_pe"], i["c_kv"], i["k_pe"], out, 0, i["scale"], case.pool)
    assert_unchanged(before, given, what)
    assert_written(out, what)
    assert_close(out, case.expected, C.TOLERANCE[dtype], what)


def _contract_modes(backend, graph: GraphMode) -> list[ForwardMode]:
    if graph not in backend.graph_modes:
        pytest.skip(f"{backend.key()} does not declare {graph.value} graphs: nothing to check")
    modes = [m for m in GRAPH_FORWARD_MODES[graph] if m in backend.forward_modes]
    if not modes:
        pytest.skip(f"{backend.key()} serves no {'/'.join(m.value for m in GRAPH_FORWARD_MODES[graph])} steps")
    return modes


@pytest.mark.parametrize("graph", list(GRAPHS), ids=list(GRAPHS))
@for_op("attention", "mla")
def test_contract(backend, graph, device):
    """Step chains over one two-layer pool in every forward mode the graph mode runs (see
    pieceworks.testing.contract); PIECEWISE steps padded, FULL steps with graph-batch padding. float32 on
    the CPU, bf16 on CUDA (test_shapes runs both dtypes on both)."""
    graph, dtype = GRAPHS[graph], device_dtype(device)
    modes = _contract_modes(backend, graph)
    shapes, ps = CONTRACT[device]
    shape = shapes[backend.op]
    for mode in modes:
        impl = build(backend, spec_for(device, shape.facts(dtype, ps)))
        run = C.PoolRun(shape, impl, dtype, device, ps, graph, name=f"{backend.key()} {shape} {mode.value}")
        C.run_chain(run, mode, pad=3 if graph is GraphMode.PIECEWISE else 0)


@pytest.mark.parametrize("graph", list(GRAPHS), ids=list(GRAPHS))
@for_op("attention")
def test_contract_fp8_kv(backend, graph, device):
    """`test_contract`'s step chains over an FP8 two-layer pool whose layers have their own scales (FP8_SCALES,
    then (0.02, 0.05)), for backends that declare `fp8_kv`: each layer's K/V stored as `quantize_kv` with its own
    scales, read back times them, step after step."""
    if not getattr(backend, "fp8_kv", False):
        pytest.skip(f"{backend.key()} declares no FP8 KV cache (fp8_kv = False)")
    graph, dtype = GRAPHS[graph], device_dtype(device)
    modes = _contract_modes(backend, graph)
    shapes, ps = CONTRACT[device]
    shape = shapes[backend.op]
    for mode in modes:
        impl = build(backend, spec_for(device, replace(shape.facts(dtype, ps), kv_fp8=True)))
        run = C.PoolRun(shape, impl, dtype, device, ps, graph, name=f"{backend.key()} {shape} {mode.value}, FP8 KV",
                        kv_scales=[FP8_SCALES, (0.02, 0.05)])
        C.run_chain(run, mode, pad=3 if graph is GraphMode.PIECEWISE else 0)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@for_op("attention", "mla")
def test_shapes(backend, dtype, device):
    """Every head shape and page size `check()` accepts gives right results (eager; one mixed step over
    an empty-cache 1-token sequence, a 1-token prefix and a 40-token one, or the step kinds the backend
    serves)."""
    dtype = DTYPES[dtype]
    refused: dict[str, list[str]] = {}
    errors, ran = [], 0
    shapes = SHAPES[backend.op]
    # every shape once, page sizes taking turns, and the first shape at every page size
    combos = [(shape, C.PAGE_SIZES[i % len(C.PAGE_SIZES)]) for i, shape in enumerate(shapes)]
    combos += [(shapes[0], ps) for ps in C.PAGE_SIZES if (shapes[0], ps) not in combos]
    for shape, ps in combos:
        reasons = reasons_of(backend, spec_for(device, shape.facts(dtype, ps)))
        if reasons:
            refused[f"{shape} page {ps}"] = reasons
            continue
        impl = backend(spec_for(device, shape.facts(dtype, ps)), parse_options(backend, {}))
        run = C.PoolRun(shape, impl, dtype, device, ps, GraphMode.EAGER, num_layers=1,
                        name=f"{backend.key()} {shape} page {ps}")
        for name, prefix in C.SWEEP_SEQS.items():
            run.add(name, prefix)
        try:
            for step in C.sweep_steps(backend.forward_modes):
                run.step(step)
        except Exception as exc:  # noqa: BLE001 (a kernel that raises for an accepted shape fails too)
            errors.append(str(exc) if isinstance(exc, C.ContractError)
                          else f"{run.name}: {C.raised(exc, backend, 'the step')}")
        ran += 1
    if not ran:
        common = [r for r in next(iter(refused.values())) if all(r in rs for rs in refused.values())]
        own = {k: [r for r in rs if r not in common] for k, rs in refused.items()}
        own_text = "; ".join(f"{k}: {', '.join(rs)}" for k, rs in own.items() if rs)
        pytest.skip(f"{backend.key()} can't serve here: {'; '.join(common)}"
                    + (f" (and per shape: {own_text})" if own_text else ""))
    assert not errors, (f"{len(errors)} of {ran} shapes that check() accepts fail:\n" + "\n".join(errors))


@for_op("attention", "mla")
def test_graph_trace(backend, device):
    """A backend declaring FULL: its decode forward is traced whole (torch.compile fullgraph=True, no
    compilation), so a host sync or data-dependent Python in forward fails without a GPU."""
    from pieceworks.testing.graphs import traced

    if GraphMode.FULL not in backend.graph_modes:
        pytest.skip(f"{backend.key()} does not declare FULL graphs")
    if ForwardMode.DECODE not in backend.forward_modes:
        pytest.skip(f"{backend.key()} serves no decode steps")
    if device == "cuda":
        pytest.skip("traced on the CPU; on CUDA test_cuda_graph captures the real graph")
    shape = CONTRACT["cpu"][0][backend.op]
    impl = build(backend, spec_for(device, shape.facts(torch.float32, 4)))
    run = C.PoolRun(shape, impl, torch.float32, device, 4, GraphMode.FULL, num_layers=1,
                    name=f"{backend.key()} traced")
    seqs, steps = C.chain(ForwardMode.DECODE)
    for name, prefix in seqs.items():
        run.add(name, prefix)
    run.step(steps[0])  # eager, as the runner's warm-up before capture
    from torch import _dynamo

    _dynamo.reset()  # the traces of other backends' forwards through the same `call`
    run.call = traced(shape.call, f"{backend.key()}.forward")
    # one graph for every later step: a FULL graph replays what it captured, so a Python value read in forward
    # that changes per step (a length from meta's lists) is an error, not a recompile
    with _dynamo.config.patch(error_on_recompile=True):
        for step in steps[1:]:
            run.step(step)


@pytest.mark.gpu
@for_op("attention", "mla")
def test_cuda_graph(backend, device):
    """A backend declaring FULL: one CUDA graph of every layer's decode forward, captured once, replayed
    after re-plans with new lengths (batches of 4, 2 and 3 sequences padded to 8)."""
    from pieceworks.testing.graphs import CaptureRun

    if GraphMode.FULL not in backend.graph_modes or ForwardMode.DECODE not in backend.forward_modes:
        pytest.skip(f"{backend.key()} does not declare FULL decode graphs")
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    dtype = torch.bfloat16
    shapes, ps = CONTRACT["cuda"]
    shape = shapes[backend.op]
    impl = build(backend, spec_for(device, shape.facts(dtype, ps)))
    run = CaptureRun(shape, impl, dtype, device, ps, GraphMode.FULL, name=f"{backend.key()} cuda graph")
    seqs, steps = C.chain(ForwardMode.DECODE)
    for name, prefix in seqs.items():
        run.add(name, prefix)
    for step in steps:
        run.step(step)


def _full_extend_modes(backend) -> list[ForwardMode]:
    if not getattr(backend, "full_extend", False):
        pytest.skip(f"{backend.key()} does not declare full_extend")
    if GraphMode.FULL not in backend.graph_modes:
        pytest.skip(f"{backend.key()} declares full_extend but not FULL graphs: the registry never puts it in them")
    modes = [m for m in (ForwardMode.EXTEND, ForwardMode.MIXED) if m in backend.forward_modes]
    if not modes:
        pytest.skip(f"{backend.key()} serves no extend or mixed steps")
    return modes


@for_op("attention", "mla")
def test_contract_full_extend(backend, device):
    """A backend declaring `full_extend`: the extend and mixed step chains laid out as full extend graphs lay them
    out (PoolRun.FULL_EXTEND_TOKENS rows, GRAPH_BATCH sequences, `StepMetadata.extend_index`, padding rows and
    sequences), run eagerly; test_cuda_graph_full_extend replays them from a graph."""
    modes, dtype = _full_extend_modes(backend), device_dtype(device)
    shapes, ps = CONTRACT[device]
    shape = shapes[backend.op]
    for mode in modes:
        impl = build(backend, spec_for(device, shape.facts(dtype, ps)))
        run = C.PoolRun(shape, impl, dtype, device, ps, GraphMode.FULL, full_extend=True,
                        name=f"{backend.key()} {shape} {mode.value}, full extend")
        C.run_chain(run, mode)


@pytest.mark.gpu
@for_op("attention", "mla")
def test_cuda_graph_full_extend(backend, device):
    """A backend declaring `full_extend`: one CUDA graph of every layer's forward over PoolRun.FULL_EXTEND_TOKENS
    rows and GRAPH_BATCH sequences, captured at an extend (mixed) chain's first step and replayed for the next,
    which has other sequences, lengths and token counts."""
    from pieceworks.testing.graphs import CaptureRun

    modes = _full_extend_modes(backend)
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    dtype = torch.bfloat16
    shapes, ps = CONTRACT["cuda"]
    shape = shapes[backend.op]
    for mode in modes:
        impl = build(backend, spec_for(device, shape.facts(dtype, ps)))
        run = CaptureRun(shape, impl, dtype, device, ps, GraphMode.FULL, full_extend=True,
                         name=f"{backend.key()} {mode.value} full extend graph")
        C.run_chain(run, mode)


@pytest.mark.gpu
@for_op("fp4_gemm", "moe")
def test_cuda_graph_capture(backend, device):
    """fp4_gemm and moe backends declaring FULL or PIECEWISE: forward captured on static inputs and
    replayed on new ones gives what an eager call gives (within the bf16 tolerance: a backend may take
    another path while capturing, as the torch MoE does)."""
    from pieceworks.testing.graphs import capture_replay

    if not {GraphMode.FULL, GraphMode.PIECEWISE} & backend.graph_modes:
        pytest.skip(f"{backend.key()} declares no CUDA-graph mode")
    if device != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    dtype, dev = torch.bfloat16, torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    if backend.op == "fp4_gemm":
        impl = build(backend, spec_for(device, ModelFacts(dtype=dtype, fp4=True)))
        m, k, n = 8, 256, 128
        w = impl.prepare(Fp4Weight(*S.random_fp4_weight(n, k, gen, dev)))
        xs = [torch.randn(m, k, generator=gen).to(dtype).to(dev) for _ in range(2)]
        capture_replay(lambda x: impl.forward(x, w.weight, w.weight_scale, w.weight_scale_2, w.input_scale, n),
                       lambda i: (xs[i].clone(),), backend.key(), 1e-2)
        return
    facts = ModelFacts(arch="deepseek_v3", dtype=dtype, fp4=True, moe_experts=8, moe_quant="nvfp4")
    impl = build(backend, spec_for(device, facts))
    w = impl.prepare(S.random_moe_weights(8, 256, 128, True, dtype, gen, dev))
    xs = [torch.randn(11, 256, generator=gen).to(dtype).to(dev) for _ in range(2)]
    logits = [torch.randn(11, 8, generator=gen).to(dev) for _ in range(2)]
    bias = (torch.rand(8, generator=gen) * 0.1).to(dev)
    capture_replay(lambda x, lg: impl.forward(x, lg, bias, w, 3, 4, 2, True, 2.5),
                   lambda i: (xs[i].clone(), logits[i].clone()), backend.key(), 1e-2)
