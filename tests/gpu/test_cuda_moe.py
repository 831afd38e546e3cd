"""The CUDA fused MoE (`moe.cuda`: the decode GEMM grouped over expert-sorted blocks) against the torch
reference, on the GPU.

Run on the H200: `python -m pytest tests/gpu/test_cuda_moe.py -m gpu -q`. Fresh random inputs per case (never
zeros), ||y - ref|| / ||ref|| < 1e-2 against the w4a16 torch MoE.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not importable here")

from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.base import BackendSpec, ModelFacts  # noqa: E402
from pieceworks.backends.moe.base import MoEWeights  # noqa: E402
from pieceworks.backends.moe.cuda import CudaMoEBackend  # noqa: E402
from pieceworks.backends.moe.routing import deepseek_route  # noqa: E402
from pieceworks.backends.moe.torch import TorchMoEBackend  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

DEV = "cuda"
TOL = 1e-2


def spec(experts: int = 8) -> BackendSpec:
    facts = ModelFacts(arch="deepseek_v3", dtype=torch.bfloat16, fp4=True, moe_experts=experts, moe_quant="nvfp4")
    return BackendSpec.for_device(DEV, fp4_numerics="w4a16", model=facts)


if CudaMoEBackend.check(spec()):
    pytest.skip(f"cuda moe unavailable: {CudaMoEBackend.check(spec())}", allow_module_level=True)


def rel_err(y, ref) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def random_moe(e: int, h: int, inter: int, gen: torch.Generator) -> MoEWeights:
    """Distinct gate and up global scales per expert (up rows 3x larger)."""
    def quant(rows, cols, scale=1.0):
        ws = [nvfp4.quantize_weight(torch.randn(rows, cols, device=DEV, generator=gen) * 0.05 * scale)
              for _ in range(e)]
        return tuple(torch.stack([q[i] for q in ws]) for i in range(3))

    gp, gs, g2 = quant(inter, h)
    up, us, u2 = quant(inter, h, 3.0)
    dp, ds, d2 = quant(h, inter)
    ones = torch.ones(e, device=DEV)
    return MoEWeights(torch.cat([gp, up], 1), torch.cat([gs, us], 1), torch.stack([g2, u2], 1), ones,
                      dp, ds, d2, ones)


def run(backend, x, logits, bias, w, top_k=4, groups=4, topk_group=2, renorm=True, scale=2.5):
    return backend.forward(x, logits, bias, w, top_k, groups, topk_group, renorm, scale)


@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 64, 300])
def test_matches_reference(tokens):
    gen = torch.Generator(DEV).manual_seed(tokens)
    e, h, inter = 32, 1024, 384
    w = random_moe(e, h, inter, gen)
    assert not torch.equal(w.w13_scale_2[:, 0], w.w13_scale_2[:, 1])
    backend = CudaMoEBackend(spec(e))
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, e, device=DEV, generator=gen)
    bias = torch.randn(e, device=DEV, generator=gen) * 0.1
    y = run(backend, x, logits, bias, backend.prepare(w))
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert rel_err(y, run(TorchMoEBackend(spec(e)), x, logits, bias, w)) < TOL


@pytest.mark.parametrize("tokens", [3, 20, 333])
@pytest.mark.parametrize("top_k", [1, 4])
def test_skewed_routing(top_k, tokens):
    """Every token picks the same experts (with top_k = 1 one expert holds every pair, over several blocks);
    the other experts get none."""
    gen = torch.Generator(DEV).manual_seed(top_k + tokens)
    e, h, inter = 16, 512, 256
    w = random_moe(e, h, inter, gen)
    backend = CudaMoEBackend(spec(e))
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, e, device=DEV, generator=gen) * 0.1
    logits[:, 5 : 5 + top_k] += 20.0
    args = dict(top_k=top_k, groups=1, topk_group=1, renorm=False, scale=1.0)
    _, ids = deepseek_route(logits, torch.empty(0, device=DEV), top_k, 1, 1, False, 1.0)
    assert set(ids.unique().tolist()) == set(range(5, 5 + top_k))
    none = torch.empty(0, device=DEV)
    y = run(backend, x, logits, none, backend.prepare(w), **args)
    assert rel_err(y, run(TorchMoEBackend(spec(e)), x, logits, none, w, **args)) < TOL


@pytest.mark.parametrize("tokens", [1, 16])  # 1: a block per pair, no sort launch
@pytest.mark.parametrize("use_pdl", [False, True])
def test_graph_replay_matches_eager(use_pdl, tokens):
    if use_pdl and pdl.unsupported_reason(DEV):
        pytest.skip(pdl.unsupported_reason(DEV))
    gen = torch.Generator(DEV).manual_seed(5)
    e, h, inter = 32, 1024, 384
    backend = CudaMoEBackend(spec(e))
    w = backend.prepare(random_moe(e, h, inter, gen))
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, e, device=DEV, generator=gen)
    bias = torch.randn(e, device=DEV, generator=gen) * 0.1
    old = pdl._enabled
    pdl._enabled = use_pdl
    try:
        run(backend, x, logits, bias, w)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(backend, x, logits, bias, w)
        x.copy_(torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen))
        logits.copy_(torch.randn(tokens, e, device=DEV, generator=gen))  # new routing, same shapes
        graph.replay()
        torch.cuda.synchronize()
        # pairs of an expert come in atomic order, so the block rows may differ: the same sums per row
        assert rel_err(out, run(backend, x, logits, bias, w)) < 1e-6
    finally:
        pdl._enabled = old


def test_refuses_sizes_it_does_not_serve():
    gen = torch.Generator(DEV).manual_seed(1)
    backend = CudaMoEBackend(spec(4))
    with pytest.raises(ValueError, match="multiples of 64"):
        backend.prepare(random_moe(4, 256, 208, gen))
    w = backend.prepare(random_moe(4, 256, 128, gen))
    with pytest.raises(ValueError, match="hidden size"):
        run(backend, torch.randn(2, 320, device=DEV, dtype=torch.bfloat16), torch.randn(2, 4, device=DEV),
            torch.empty(0, device=DEV), w, top_k=2, groups=1, topk_group=1)


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_one_token_down_and_combine_in_one_launch(top_k):
    """One token: the down GEMM and the top-k combine run as one launch (warps split the slots' experts),
    for top-k counts that do and do not divide the plan's warps."""
    gen = torch.Generator(DEV).manual_seed(40 + top_k)
    e, h, inter = 16, 512, 256
    w = random_moe(e, h, inter, gen)
    backend = CudaMoEBackend(spec(e))
    x = torch.randn(1, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(1, e, device=DEV, generator=gen)
    none = torch.empty(0, device=DEV)
    args = dict(top_k=top_k, groups=1, topk_group=1, renorm=True, scale=2.5)
    y = run(backend, x, logits, none, backend.prepare(w), **args)
    assert rel_err(y, run(TorchMoEBackend(spec(e)), x, logits, none, w, **args)) < TOL
