"""The cuda backend's wgmma GEMM for 17..64 rows (backends/fp4_gemm/cuda_wgmma.py), on the GPU.

Run on the H200: `python -m pytest tests/gpu/test_cuda_wgmma.py -m gpu -q`. Fresh random inputs per case,
relative error ||y - ref|| / ||ref|| < 1e-2 against the w4a16 torch backend; outputs are checked finite.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm import cuda_wgmma  # noqa: E402
from pieceworks.backends.fp4_gemm.base import Fp4Weight  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda import CudaDecodeOptions, CudaFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend  # noqa: E402
from pieceworks.models import fused  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

DEV = "cuda"
TOL = 1e-2
SPEC = BackendSpec.for_device(DEV, fp4_numerics="w4a16")
if CudaFp4GemmBackend.check(SPEC):
    pytest.skip(f"cuda fp4_gemm unavailable: {CudaFp4GemmBackend.check(SPEC)}", allow_module_level=True)
if not cuda_wgmma.supported(torch.device(DEV)):
    pytest.skip("the wgmma kernel needs compute capability 9.0", allow_module_level=True)


def rel_err(y, ref) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def random_fp4(n, k, gen) -> Fp4Weight:
    w = torch.randn(n, k, device=DEV, generator=gen) * torch.rand(n, 1, device=DEV, generator=gen)
    packed, scale, scale_2 = nvfp4.quantize_weight(w)
    return Fp4Weight(packed, scale, scale_2, torch.ones((), device=DEV))


def reference(x, w: Fp4Weight):
    return TorchFp4GemmBackend(SPEC).forward(x, *w, w.weight.shape[0])


SHAPES = [(40, 208), (4096, 4096), (6144, 4096), (1000, 4112), (28672, 512), (4096, 14336), (7168, 2048)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [17, 24, 32, 33, 50, 64])
def test_backend_path_matches_reference(n, k, m):
    gen = torch.Generator(device=DEV).manual_seed(n + 3 * k + 11 * m)
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    backend = CudaFp4GemmBackend(SPEC)
    y = backend.forward(x, *backend.prepare(w), n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert rel_err(y, reference(x, w)) < TOL


@pytest.mark.parametrize("m", [1, 8, 9, 16, 20, 40, 64])
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_kernel_every_token_tile_and_split(m, split):
    """Every instance (1, 2, 4, 8 token tiles) and K split, K split unevenly (83 chunks); the counters are left
    zero."""
    gen = torch.Generator(device=DEV).manual_seed(100 * m + split)
    n, k = 200, 83 * 64
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    p = CudaFp4GemmBackend(SPEC).prepare(w)
    counters = torch.zeros(8, dtype=torch.int32, device=DEV)
    y = cuda_wgmma.wgmma_gemm(x, p.weight, p.weight_scale, p.weight_scale_2, n, counters, split=split)
    assert rel_err(y, reference(x, w)) < TOL
    assert not counters.any()


def test_deterministic_and_close_to_the_slices():
    """The last CTA adds the partials in split order: two calls give the same bits; the 16-row slices of the
    decode kernel (another summation order) agree to rounding."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    n, k, m = 4096, 14336, 40
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    backend = CudaFp4GemmBackend(SPEC)
    p = backend.prepare(w)
    a, b = backend.forward(x, *p, n), backend.forward(x, *p, n)
    assert torch.equal(a, b)
    slices = CudaFp4GemmBackend(SPEC, CudaDecodeOptions(wgmma=False)).forward(x, *p, n)
    assert not torch.equal(a, slices)  # the option took the other path
    assert rel_err(a, slices) < 1e-2


@pytest.mark.parametrize("m", [17, 32, 64])
def test_swiglu_same_bits_as_gemm_then_silu_mul(m):
    gen = torch.Generator(device=DEV).manual_seed(m)
    inter, k = 1024 + 8, 2048
    w = random_fp4(2 * inter, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    backend = CudaFp4GemmBackend(SPEC)
    p = backend.prepare_gate_up(w)
    y = backend.forward_swiglu(x, *p, inter)
    ref = reference(x, w)
    assert rel_err(y, fused.silu_mul(ref[:, :inter], ref[:, inter:])) < TOL
    plain = backend.forward(x, *p, 2 * inter)
    assert torch.equal(y, fused.silu_mul(plain[:, 0::2].contiguous(), plain[:, 1::2].contiguous()))


@pytest.mark.parametrize("m", [17, 40, 64])
def test_qkv_rope_same_bits_as_gemm_then_rope(m):
    gen = torch.Generator(device=DEV).manual_seed(200 + m)
    nh, nkv, hd = 8, 2, 128
    n, k = (nh + 2 * nkv) * hd, 1024
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    pos = torch.randint(0, 4096, (m,), device=DEV, generator=gen).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(hd // 2, device=DEV) / (hd // 2)))
    cos, sin = freqs.cos(), freqs.sin()
    backend = CudaFp4GemmBackend(SPEC)
    y = backend.forward_qkv_rope(x, *backend.prepare_qkv_rope(w, nh, nkv, hd), cos, sin, nh, nkv, hd)

    def roped(plain):
        q, kk = fused.rope_qk(plain[:, : nh * hd].reshape(-1, nh, hd).clone(),
                              plain[:, nh * hd : (nh + nkv) * hd].reshape(-1, nkv, hd).clone(), cos, sin, False)
        return torch.cat([q.reshape(m, -1), kk.reshape(m, -1), plain[:, (nh + nkv) * hd :]], dim=1)

    assert rel_err(y, roped(reference(x, w))) < TOL
    assert torch.equal(y, roped(backend.forward(x, *backend.prepare(w), n)))


@pytest.mark.parametrize("use_pdl", [False, True])
def test_graph_replay_matches_eager(use_pdl):
    if use_pdl and pdl.unsupported_reason(DEV):
        pytest.skip(pdl.unsupported_reason(DEV))
    gen = torch.Generator(device=DEV).manual_seed(5)
    backend = CudaFp4GemmBackend(SPEC)
    w1, w2 = backend.prepare(random_fp4(4096, 4096, gen)), backend.prepare(random_fp4(4096, 4096, gen))
    x = torch.randn(32, 4096, device=DEV, dtype=torch.bfloat16, generator=gen)
    old = pdl._enabled
    pdl._enabled = use_pdl
    try:
        eager = backend.forward(backend.forward(x, *w1, 4096), *w2, 4096)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(backend.forward(x, *w1, 4096), *w2, 4096)
        x.copy_(torch.randn(32, 4096, device=DEV, dtype=torch.bfloat16, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, backend.forward(backend.forward(x, *w1, 4096), *w2, 4096))
        assert not torch.equal(out, eager)
    finally:
        pdl._enabled = old


def test_bad_arguments_refused():
    gen = torch.Generator(device=DEV).manual_seed(3)
    p = CudaFp4GemmBackend(SPEC).prepare(random_fp4(64, 512, gen))
    x = torch.randn(20, 512, device=DEV, dtype=torch.bfloat16, generator=gen)
    counters = torch.zeros(4, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="split"):
        cuda_wgmma.wgmma_gemm(x, p.weight, p.weight_scale, p.weight_scale_2, 64, counters, split=3)
    with pytest.raises(ValueError, match="counters"):
        cuda_wgmma.wgmma_gemm(x, p.weight, p.weight_scale, p.weight_scale_2, 64, counters.float())
    with pytest.raises(ValueError, match="M <= 64"):
        cuda_wgmma.wgmma_gemm(torch.randn(65, 512, device=DEV, dtype=torch.bfloat16), p.weight, p.weight_scale,
                              p.weight_scale_2, 64, counters)
