"""The CUDA decode GEMM's bulk mode (weights through shared-memory stages filled by bulk copies) against its
register-ring mode, on the GPU: the same chunks in the same order per warp, so the same bits.

Run on the H200: `python -m pytest tests/gpu/test_cuda_bulk.py -m gpu -q`. Fresh random inputs per case.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm import cuda_decode, r16c64  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda import CudaFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

DEV = "cuda"
SPEC = BackendSpec.for_device(DEV, fp4_numerics="w4a16")
if CudaFp4GemmBackend.check(SPEC):
    pytest.skip(f"cuda fp4_gemm unavailable: {CudaFp4GemmBackend.check(SPEC)}", allow_module_level=True)


def _weights(n, k, gen):
    w = torch.randn(n, k, device=DEV, generator=gen) * torch.rand(n, 1, device=DEV, generator=gen)
    packed, scale, scale_2 = nvfp4.quantize_weight(w)
    codes, scales = r16c64.repack_decode(packed, scale)
    return (packed, scale, scale_2), (codes, scales, scale_2.float().reshape(1))


# (warps, depth, stages, stage chunks): K runs per warp that leave partial last stages (a tail), runs
# shorter than one stage, more stages than the run has
CONFIGS = [(2, 2, 2, 4), (8, 2, 3, 4), (16, 2, 2, 2), (4, 2, 2, 8), (16, 1, 4, 1)]


@pytest.mark.parametrize("n,k", [(40, 208), (4096, 4096), (48, 4160), (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 5, 9, 16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "w%dd%db%dx%d" % c)
def test_bulk_same_bits_as_ring(n, k, m, cfg):
    warps, depth, stages, chunks = cfg
    gen = torch.Generator(device=DEV).manual_seed(n + 3 * k + 17 * m + sum(cfg))
    raw, dec = _weights(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    ring = cuda_decode.decode_gemm(x, *dec, n, warps=warps, depth=depth)
    bulk = cuda_decode.decode_gemm(x, *dec, n, warps=warps, depth=depth, stages=stages, stage_chunks=chunks)
    assert torch.equal(bulk, ring)
    ref = TorchFp4GemmBackend(SPEC).forward(x, *raw, torch.ones((), device=DEV), n)
    err = float((bulk.float() - ref.float()).norm() / ref.float().norm())
    assert err < 1e-2


@pytest.mark.parametrize("m", [1, 16])
def test_bulk_swiglu_and_residual_epilogues(m):
    gen = torch.Generator(device=DEV).manual_seed(5 + m)
    n, k = 2048, 4096
    _, dec = _weights(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    res = torch.randn(m, n, device=DEV, dtype=torch.bfloat16, generator=gen)
    for kw in ({"swiglu": True}, {"residual": res}):
        ring = cuda_decode.decode_gemm(x, *dec, n, warps=4, depth=2, **kw)
        bulk = cuda_decode.decode_gemm(x, *dec, n, warps=4, depth=2, stages=3, stage_chunks=4, **kw)
        assert torch.equal(bulk, ring)


@pytest.mark.parametrize("use_pdl", [False, True])
def test_bulk_graph_replay_matches_eager(use_pdl):
    """Replays of a captured chain of bulk-mode calls (each reading the one before, with PDL when asked) give
    the eager bits; the stages' mbarriers start fresh in every launch."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    n = k = 4096
    _, dec = _weights(n, k, gen)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16, generator=gen)

    def chain():
        y = x
        for _ in range(4):
            y = cuda_decode.decode_gemm(y, *dec, n, warps=16, depth=2, stages=2, stage_chunks=4, pdl=use_pdl)
            y = y / y.float().norm().to(torch.bfloat16)
        return y

    eager = chain()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_bulk_stage_chunks_must_be_a_multiple_of_depth():
    gen = torch.Generator(device=DEV).manual_seed(2)
    _, dec = _weights(64, 256, gen)
    x = torch.randn(1, 256, device=DEV, dtype=torch.bfloat16, generator=gen)
    with pytest.raises(ValueError, match="multiple of depth"):
        cuda_decode.decode_gemm(x, *dec, 64, warps=2, depth=2, stages=2, stage_chunks=3)
