"""cpu_matmul.linear (the CPU's x @ w.T for decode-sized rows) against F.linear, and where the models use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pieceworks.backends import cpu_matmul


@pytest.mark.parametrize("m", [1, 2, 3, 17, cpu_matmul.SKINNY_ROWS, cpu_matmul.SKINNY_ROWS + 1, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_f_linear(m, dtype):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 96, generator=g).to(dtype), torch.randn(160, 96, generator=g).to(dtype)
    out = cpu_matmul.linear(x, w)
    assert out.shape == (m, 160) and out.dtype == dtype and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, F.linear(x, w), rtol=tol, atol=tol)
    if m > cpu_matmul.SKINNY_ROWS:
        assert torch.equal(out, F.linear(x, w))


def test_models_and_the_dequant_backend_call_it(monkeypatch):
    """An unquantized linear on a CPU, and the dequant backend's GEMM, go through cpu_matmul.linear; inside
    torch.compile the linear stays F.linear (no shape branches for Dynamo to guard on)."""
    from pieceworks.backends.fp4_gemm.torch import DequantizedFp4GemmBackend
    from pieceworks.models.base import DenseLinear

    seen = []
    real = cpu_matmul.linear
    monkeypatch.setattr(cpu_matmul, "linear", lambda x, w: seen.append(tuple(x.shape)) or real(x, w))
    lin = DenseLinear(8, 4)
    x = torch.randn(3, 8)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    assert seen == [(3, 8)]
    compiled = torch.compile(lin, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), F.linear(x, lin.weight))
    assert seen == [(3, 8)]
    backend = DequantizedFp4GemmBackend.__new__(DequantizedFp4GemmBackend)
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    torch.testing.assert_close(backend.forward(x, w, None, None, None, 4), F.linear(x, w))
    assert seen[-1] == (2, 16)
