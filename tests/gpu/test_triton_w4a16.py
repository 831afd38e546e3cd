"""`triton_w4a16.w4a16_gemm` (the whole-M w4a16 tile, not wired into a backend) against the torch reference on the
GPU: `python -m pytest tests/gpu/test_triton_w4a16.py -m gpu -q` (needs sm_90 for the TMA path; elsewhere x goes by
pointer loads). Random inputs, ||y - ref|| / ||ref|| < 1e-2 as tests/gpu/test_triton_fp4.py; outputs of a call are
fresh tensors, so an unwritten element shows as garbage in the error."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not importable here")

from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm.k32 import repack_k32  # noqa: E402
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.triton_w4a16 import tile_for, w4a16_gemm  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

# Each block_m (32, 64, 128, 256, and two 256-row tiles), N and K not multiples of the tiles (K = 4112: x past K
# zero-filled by TMA), variants: pointer loads of x, narrower weight tiles, no counters (second-kernel reduction).
CASES = [(m, n, k, over) for m in (17, 32, 64, 100, 256, 512) for n, k in ((1000, 4112), (4096, 1024))
         for over in ({}, {"tma_x": False}, {"block_n": 64, "target_ctas": 396})]


@pytest.mark.parametrize("m,n,k,over", CASES)
@pytest.mark.parametrize("counters", [True, False])
def test_w4a16_matches_reference(m, n, k, over, counters):
    gen = torch.Generator("cuda").manual_seed(m * 7919 + n + k)
    w = torch.randn(n, k, device="cuda", generator=gen) * torch.rand(n, 1, device="cuda", generator=gen)
    packed, scale, scale_2 = nvfp4.quantize_weight(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = TorchFp4GemmBackend(BackendSpec.for_device("cuda", fp4_numerics="w4a16")).forward(
        x, packed, scale, scale_2, torch.ones((), device="cuda"), n)
    count = torch.zeros(1 << 14, dtype=torch.int32, device="cuda") if counters else None
    y = w4a16_gemm(x, *repack_k32(packed, scale), scale_2.float().reshape(()), n, tile_for(m, **over), count)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    assert count is None or not count.any()
