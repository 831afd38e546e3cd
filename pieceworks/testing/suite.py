"""The backend-matrix suite: every registered backend (plugins included) against dense references.

Run it for your own plugin with `pytest --pyargs pieceworks.testing.suite -p pieceworks.testing.plugin`
(add `--pieceworks-device cuda` on a GPU machine). A backend that can't serve a case is skipped with
its own reasons. One test per op (plus one for the fp4_gemm backends' SwiGLU and rope entry points);
the named scenarios and devices are the only parameters.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends.base import BackendSpec, ModelFacts, parse_options
from pieceworks.backends.fp4_gemm.base import Fp4Weight
from pieceworks.backends.registry import Registry
from pieceworks.testing import scenarios as S


def _backends(op: str) -> list:
    return [pytest.param(cls, id=cls.name) for cls in Registry().load().backends(op)]


def _devices() -> list:
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def _spec(device: str, facts: ModelFacts, numerics: str = "auto") -> BackendSpec:
    if device == "cuda":
        return BackendSpec.for_device("cuda", model=facts, fp4_numerics=numerics)
    return BackendSpec(device="cpu", model=facts, fp4_numerics=numerics)


def _build(cls, spec: BackendSpec, mode=None):
    reasons = list(cls.check(spec))
    if mode is not None and mode not in cls.forward_modes:
        reasons.append(f"does not support {mode.value} steps")
    if reasons:
        pytest.skip(f"{cls.key()} can't serve here: {'; '.join(reasons)}")
    return cls(spec, parse_options(cls, {}))


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("scenario", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("backend", _backends("attention"))
def test_attention(backend, scenario, device):
    dtype = _dtype(device)
    facts = ModelFacts(dtype=dtype, num_heads=8, num_kv_heads=2, head_dim=64, page_size=scenario.page_size)
    impl = _build(backend, _spec(device, facts), scenario.mode)
    case = S.attention_case(scenario, 8, 2, 64, dtype, torch.device(device))
    out = torch.full_like(case.inputs["q"], float("nan"))
    impl.plan(case.meta)
    impl.forward(case.inputs["q"], case.inputs["k"], case.inputs["v"], out, 0, 64**-0.5, case.pool)
    assert torch.isfinite(out).all(), "every row of out must be written"
    assert _rel_err(out, case.expected) < _tolerance(dtype)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("scenario", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
@pytest.mark.parametrize("backend", _backends("mla"))
def test_mla(backend, scenario, device):
    dtype = _dtype(device)
    rank, rope = (64, 16) if device == "cpu" else (512, 64)
    facts = ModelFacts(arch="deepseek_v3", dtype=dtype, num_heads=4, num_kv_heads=1, kv_lora_rank=rank,
                       qk_rope_head_dim=rope, page_size=scenario.page_size)
    impl = _build(backend, _spec(device, facts), scenario.mode)
    case = S.mla_case(scenario, 4, rank, rope, dtype, torch.device(device))
    i = case.inputs
    out = torch.full_like(i["q_nope"], float("nan"))
    impl.plan(case.meta)
    impl.forward(i["q_nope"], i["q_pe"], i["c_kv"], i["k_pe"], out, 0, i["scale"], case.pool)
    assert torch.isfinite(out).all(), "every row of out must be written"
    assert _rel_err(out, case.expected) < _tolerance(dtype)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("numerics", ["w4a16", "w4a4"])
@pytest.mark.parametrize("shape", list(S.GEMM_SHAPES.values()), ids=list(S.GEMM_SHAPES))
@pytest.mark.parametrize("backend", _backends("fp4_gemm"))
def test_fp4_gemm(backend, shape, numerics, device):
    dtype = _dtype(device)
    impl = _build(backend, _spec(device, ModelFacts(dtype=dtype, fp4=True), numerics))
    m, k, n = shape
    gen = torch.Generator().manual_seed(m * 1000 + k)
    w = impl.prepare(Fp4Weight(*S.random_fp4_weight(n, k, gen, torch.device(device))))
    x = (torch.randn(m, k, generator=gen)).to(dtype).to(device)
    ref_w = S.random_fp4_weight(n, k, torch.Generator().manual_seed(m * 1000 + k), torch.device("cpu"))
    y = impl.forward(x, w.weight, w.weight_scale, w.weight_scale_2, w.input_scale, n)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = S.dense_fp4_gemm(x, *ref_w, numerics)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel_err(y, ref) < tol


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("backend", _backends("fp4_gemm"))
def test_fp4_gemm_fused_epilogues(backend, device):
    """`forward_swiglu` and `forward_qkv_rope` (the fp4_gemm_swiglu / fp4_gemm_qkv_rope ops) give the
    same bits as the backend's own `forward` followed by the silu_mul / rope_qk op, whether the backend
    fuses them or runs the defaults."""
    from pieceworks.models import fused

    dtype = _dtype(device)
    impl = _build(backend, _spec(device, ModelFacts(dtype=dtype, fp4=True)))
    dev = torch.device(device)
    heads, kv_heads, head_dim, inter, k = 4, 2, 64, 96, 256
    n = (heads + 2 * kv_heads) * head_dim
    gen = torch.Generator().manual_seed(11)
    w_qkv = Fp4Weight(*S.random_fp4_weight(n, k, gen, dev))
    w_gate_up = Fp4Weight(*S.random_fp4_weight(2 * inter, k, gen, dev))
    plain_qkv, plain_gate_up = impl.prepare(w_qkv), impl.prepare(w_gate_up)
    roped = impl.prepare_qkv_rope(w_qkv, heads, kv_heads, head_dim)
    gate_up = impl.prepare_gate_up(w_gate_up)
    for m in (1, 5):
        x = torch.randn(m, k, generator=gen).to(dtype).to(dev)
        ang = (torch.rand(m, head_dim // 2, generator=gen) * 50).to(dev)
        cos, sin = ang.cos(), ang.sin()
        y = impl.forward(x, *plain_gate_up, 2 * inter)
        ref = fused.silu_mul(y[:, :inter], y[:, inter:])
        assert torch.equal(impl.forward_swiglu(x, *gate_up, inter), ref), (m, "swiglu")
        y = impl.forward(x, *plain_qkv, n)
        q_cols, kv_cols = heads * head_dim, kv_heads * head_dim
        q, kr = fused.rope_qk(y[:, :q_cols].view(m, heads, head_dim),
                              y[:, q_cols : q_cols + kv_cols].view(m, kv_heads, head_dim), cos, sin, False)
        ref = torch.cat([q.reshape(m, -1), kr.reshape(m, -1), y[:, q_cols + kv_cols :]], dim=1)
        got = impl.forward_qkv_rope(x, *roped, cos, sin, heads, kv_heads, head_dim)
        assert got.shape == (m, n) and torch.equal(got, ref), (m, "qkv rope")



@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("backend", _backends("fp4_gemm"))
def test_fp4_gemm_fused_norm_and_residual(backend, device):
    """`forward_add` gives the bits of `forward` followed by the residual add, and `forward_add_norm` those
    and `norm_inputs` of the sum (the partial sums of squares to float rounding); `forward_norm_swiglu` and
    `forward_norm_qkv_rope` (on those inputs) give the bits of the rms_norm op followed by `forward_swiglu`
    / `forward_qkv_rope` where the backend does not fuse the norm (`fuses_norm`), and are within the GEMM
    tolerance where it does (it may apply 1 / rms after the GEMM)."""
    from pieceworks.backends.fp4_gemm.base import norm_inputs
    from pieceworks.models import fused

    dtype = _dtype(device)
    impl = _build(backend, _spec(device, ModelFacts(dtype=dtype, fp4=True)))
    dev = torch.device(device)
    heads, kv_heads, head_dim, inter, k, eps = 4, 2, 64, 96, 256, 1e-5
    n = (heads + 2 * kv_heads) * head_dim
    gen = torch.Generator().manual_seed(13)
    w_qkv = Fp4Weight(*S.random_fp4_weight(n, k, gen, dev))
    w_gate_up = Fp4Weight(*S.random_fp4_weight(2 * inter, k, gen, dev))
    w_o = Fp4Weight(*S.random_fp4_weight(k, k, gen, dev))
    roped, gate_up = impl.prepare_qkv_rope(w_qkv, heads, kv_heads, head_dim), impl.prepare_gate_up(w_gate_up)
    o = impl.prepare(w_o)
    tol = 0.0 if not impl.fuses_norm else _tolerance(dtype) / 2
    for m in (1, 5):
        s = (torch.randn(m, k, generator=gen) * 3).to(dtype).to(dev)
        nw = (1 + 0.5 * torch.randn(k, generator=gen)).to(dtype).to(dev)
        res = torch.randn(m, k, generator=gen).to(dtype).to(dev)
        ang = (torch.rand(m, head_dim // 2, generator=gen) * 50).to(dev)
        cos, sin = ang.cos(), ang.sin()
        got = impl.forward_add(s, *o, k, res)
        assert got.shape == (m, k) and torch.equal(got, res + impl.forward(s, *o, k)), (m, "add")
        s2, t, parts = impl.forward_add_norm(s, *o, k, res, nw)
        ref_t, ref_parts = norm_inputs(got, nw)
        assert torch.equal(s2, got) and torch.equal(t, ref_t), (m, "add norm")
        assert parts.shape == ref_parts.shape and _rel_err(parts, ref_parts) < 1e-5, (m, "add norm partials")
        s, x = s2, fused.rms_norm(s2, nw, eps)
        got = impl.forward_norm_swiglu(s, t, parts, nw, eps, *gate_up, inter)
        ref = impl.forward_swiglu(x, *gate_up, inter)
        assert got.shape == ref.shape and _rel_err(got, ref) <= tol, (m, "norm swiglu", _rel_err(got, ref))
        got = impl.forward_norm_qkv_rope(s, t, parts, nw, eps, *roped, cos, sin, heads, kv_heads, head_dim)
        ref = impl.forward_qkv_rope(x, *roped, cos, sin, heads, kv_heads, head_dim)
        assert got.shape == ref.shape and _rel_err(got, ref) <= tol, (m, "norm qkv rope", _rel_err(got, ref))


MOE_CASES = {"nvfp4": True, "bf16": False}


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("numerics", ["w4a16", "w4a4"])
@pytest.mark.parametrize("weights", list(MOE_CASES), ids=list(MOE_CASES))
@pytest.mark.parametrize("backend", _backends("moe"))
def test_moe(backend, weights, numerics, device):
    fp4 = MOE_CASES[weights]
    if not fp4 and numerics == "w4a4":
        pytest.skip("w4a4 applies to NVFP4 experts only")
    dtype = _dtype(device)
    facts = ModelFacts(arch="deepseek_v3", dtype=dtype, fp4=fp4, moe_experts=8,
                       moe_quant="nvfp4" if fp4 else "none")
    impl = _build(backend, _spec(device, facts, numerics))
    gen = torch.Generator().manual_seed(7)
    dev = torch.device(device)
    hidden, inter, experts = (64, 32, 8) if device == "cpu" else (256, 128, 8)
    w = S.random_moe_weights(experts, hidden, inter, fp4, dtype, gen, dev)
    x = torch.randn(11, hidden, generator=gen).to(dtype).to(dev)
    logits = torch.randn(11, experts, generator=gen).to(dev)
    bias = (torch.rand(experts, generator=gen) * 0.1).to(dev)
    args = (3, 4, 2, True, 2.5)  # top_k, groups, topk_group, renormalize, routed_scaling_factor
    y = impl.forward(x, logits, bias, impl.prepare(w), *args)
    ref = S.dense_moe(x, logits, bias, w, *args, numerics=numerics)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if dtype != torch.float32 and numerics == "w4a4":
        # w4a4 rounds the SwiGLU output h to FP4 again before the down GEMM: a backend computing in bf16 (its
        # dequantized weights and quantized activations rounded to bf16) gets an h about 0.5% from the
        # float64 reference's, which moves about 2% of h's FP4 codes across a rounding boundary: 2.6e-2 at
        # the output for the torch backend in bf16 on the CPU (w4a16: 5.5e-3; test_backend_matrix.py)
        tol = 5e-2
    assert _rel_err(y, ref) < tol
