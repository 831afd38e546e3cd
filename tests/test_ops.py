"""Custom ops: opcheck, fullgraph compile, and the forward context's rules."""

from __future__ import annotations

import pytest
import torch

import pieceworks.backends.ops  # noqa: F401  (registers the ops)
from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.registry import Registry
from pieceworks.config import load_config
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context, get_forward_context
from pieceworks.testing import scenarios as S

OPS = torch.ops.pieceworks


def _kernels(mode=ForwardMode.EXTEND):
    # the reference (checkpoint layout); `auto` would pick the CPU dequant backend, whose weights
    # need prepare() first
    cfg = load_config({"model": {"arch": "llama"}}, ["backends.fp4_gemm=torch"])
    facts = ModelFacts(fp4=True, moe_experts=8, moe_quant="nvfp4")
    table = Registry(autoload=False).load().resolve(cfg.backends, BackendSpec(model=facts))
    return table.step(mode, GraphMode.EAGER)


def _attention_args():
    case = S.attention_case(S.ATTENTION_SCENARIOS[2], 4, 2, 16, torch.float32, torch.device("cpu"))
    i = case.inputs
    return case, (i["q"], i["k"], i["v"], torch.empty_like(i["q"]), 0, 0.25)


def _mla_args():
    case = S.mla_case(S.ATTENTION_SCENARIOS[3], 2, 32, 8, torch.float32, torch.device("cpu"))
    i = case.inputs
    return case, (i["q_nope"], i["q_pe"], i["c_kv"], i["k_pe"], torch.empty_like(i["q_nope"]), 0, i["scale"])


def _gemm_args():
    w = S.random_fp4_weight(24, 64, torch.Generator().manual_seed(0), torch.device("cpu"))
    return (torch.randn(5, 64), *w, 24)


def _gemm_swiglu_args():
    w = S.random_fp4_weight(24, 64, torch.Generator().manual_seed(1), torch.device("cpu"))
    return (torch.randn(5, 64), *w, 12)


def _gemm_qkv_rope_args():
    # 2 query heads and 1 KV head of 8: rows [q (16); k (8); v (8)]
    w = S.random_fp4_weight(32, 64, torch.Generator().manual_seed(2), torch.device("cpu"))
    ang = torch.rand(5, 4, generator=torch.Generator().manual_seed(3)) * 20
    return (torch.randn(5, 64), *w, ang.cos(), ang.sin(), 2, 1, 8)


ARGS = {"fp4_gemm": _gemm_args, "fp4_gemm_swiglu": _gemm_swiglu_args, "fp4_gemm_qkv_rope": _gemm_qkv_rope_args}


def _moe_args():
    w = S.random_moe_weights(8, 32, 16, True, torch.float32, torch.Generator().manual_seed(0), torch.device("cpu"))
    return (torch.randn(6, 32), torch.randn(6, 8), torch.rand(8) * 0.1, *w, 2, 4, 2, True, 1.5)


@pytest.mark.parametrize("name", ["attention", "mla", "fp4_gemm", "fp4_gemm_swiglu", "fp4_gemm_qkv_rope", "moe"])
def test_opcheck(name):
    kernels = _kernels()
    if name == "attention":
        case, args = _attention_args()
    elif name == "mla":
        case, args = _mla_args()
    else:
        case, args = None, ARGS.get(name, _moe_args)()
    if case is not None:
        getattr(kernels, name).plan(case.meta)
    has_fp8 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    with forward_context(ForwardContext(kernels, case.meta if case else None, case.pool if case else None)):
        # opcheck's test_schema compares inputs with arithmetic that CPU float8 lacks
        # ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn); for ops with float8 inputs the
        # same property (no undeclared input mutation) is checked below on byte views instead.
        torch.library.opcheck(getattr(OPS, name), args, test_utils=utils if has_fp8 else "ALL")
        if has_fp8:
            before = [a.view(torch.uint8).clone() if a.dtype == torch.float8_e4m3fn else a.clone()
                      for a in args if isinstance(a, torch.Tensor)]
            getattr(OPS, name)(*args)
            after = [a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
                     for a in args if isinstance(a, torch.Tensor)]
            assert all(torch.equal(b, a) for b, a in zip(before, after)), "an input was mutated"


@pytest.mark.parametrize("name", ["attention", "mla", "fp4_gemm", "fp4_gemm_swiglu", "fp4_gemm_qkv_rope", "moe"])
def test_fullgraph_compile_matches_eager(name):
    torch._dynamo.reset()
    kernels = _kernels()
    if name in ("attention", "mla"):
        case, args = _attention_args() if name == "attention" else _mla_args()
        getattr(kernels, name).plan(case.meta)

        def fn(*a):
            out = torch.empty_like(a[4] if name == "mla" else a[3])
            if name == "attention":
                OPS.attention(a[0] * 1.0, a[1], a[2], out, a[4], a[5])
            else:
                OPS.mla(a[0] * 1.0, a[1], a[2], a[3], out, a[5], a[6])
            return out * 2
        ctx = ForwardContext(kernels, case.meta, case.pool)
    else:
        args = ARGS.get(name, _moe_args)()
        op = getattr(OPS, name)

        def fn(*a):
            return op(a[0] + 0, *a[1:]) * 2
        ctx = ForwardContext(kernels)
    with forward_context(ctx):
        eager = fn(*args)
        compiled = torch.compile(fn, fullgraph=True, backend="eager")(*args)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_ops_outside_a_forward_say_what_to_do():
    with pytest.raises(RuntimeError, match="run the model through Executor.forward"):
        OPS.fp4_gemm(*_gemm_args())


def test_forward_context_refuses_nesting():
    ctx = ForwardContext(_kernels())
    with forward_context(ctx):
        assert get_forward_context() is ctx
        with pytest.raises(RuntimeError, match="do not nest"):
            with forward_context(ctx):
                pass
        assert get_forward_context() is ctx
    with pytest.raises(RuntimeError):
        get_forward_context()


@pytest.mark.parametrize("sc", [s for s in S.ATTENTION_SCENARIOS if s.mode is ForwardMode.DECODE and len(s.seqs) > 1],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("window", [0, 3])
def test_torch_decode_gathers_in_groups_of_sequences(sc, window, monkeypatch):
    """The reference's decode gathers pages to the table's width a group of sequences at a time
    (`DECODE_GATHER_BYTES`): one sequence per group gives the same bits as the whole batch at once."""
    from pieceworks.backends.attention import torch as ref

    facts = ModelFacts(dtype=torch.float32, num_heads=8, num_kv_heads=2, head_dim=64, page_size=sc.page_size,
                       sliding_windows=(window,))
    outs = []
    for budget in (ref.DECODE_GATHER_BYTES, 1):
        monkeypatch.setattr(ref, "DECODE_GATHER_BYTES", budget)
        case = S.attention_case(sc, 8, 2, 64, torch.float32, torch.device("cpu"), window=window)
        backend = ref.TorchAttentionBackend(BackendSpec(device="cpu", model=facts))
        out = torch.full_like(case.inputs["q"], float("nan"))
        backend.plan(case.meta)
        backend.forward(*(case.inputs[n] for n in "qkv"), out, 0, 64**-0.5, case.pool)
        torch.testing.assert_close(out.double(), case.expected, rtol=1e-4, atol=1e-4)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
