"""Programmatic dependent launch (backends/pdl.py) on the GPU: a chain of dependent pieceworks kernels
gives the same bits with PDL as without, eagerly and replayed from a CUDA graph with fresh inputs.

Run on the H200: `python -m pytest tests/gpu/test_pdl_gpu.py -m gpu -q`. A kernel that read its input
before the kernel producing it had finished would show up as a mismatch; each replay gets new inputs
(and the eager runs fresh ones per round) so stale data can't pass.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not importable here")

from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm.base import Fp4Weight  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend  # noqa: E402
from pieceworks.backends import fused  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

DEV = "cuda"
H, INTER = 2048, 5632  # down's K (5632) is not a multiple of 512: the padded, masked path too

needs_sm90 = pytest.mark.skipif(pdl.unsupported_reason(DEV) is not None,
                                reason=str(pdl.unsupported_reason(DEV)))


@pytest.fixture(autouse=True)
def _restore_switch():
    yield
    pdl.configure("auto", DEV)


def random_fp4(n: int, k: int, gen: torch.Generator) -> Fp4Weight:
    w = torch.randn(n, k, device=DEV, generator=gen)
    packed, scale, scale_2 = nvfp4.quantize_weight(w)
    return Fp4Weight(packed, scale, scale_2, torch.ones((), device=DEV))


class Block:
    """norm -> gate_up GEMM -> SiLU-and-multiply -> down GEMM -> residual add + norm: a decoder MLP's
    kernels, each reading what the one before wrote."""

    def __init__(self, gen: torch.Generator) -> None:
        self.backend = TritonFp4GemmBackend(BackendSpec.for_device(DEV, fp4_numerics="w4a16"))
        self.gate_up = self.backend.prepare(random_fp4(2 * INTER, H, gen))
        self.down = self.backend.prepare(random_fp4(H, INTER, gen))
        self.norm_w = torch.rand(H, device=DEV, generator=gen).to(torch.bfloat16) + 0.5

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, s = fused.add_rms_norm(x, residual, self.norm_w, 1e-5)
        gu = self.backend.forward(h, *self.gate_up, 2 * INTER)
        a = fused.silu_mul(gu[:, :INTER], gu[:, INTER:])
        y = self.backend.forward(a, *self.down, H)
        out, _ = fused.add_rms_norm(y, s, self.norm_w, 1e-5)
        return out


def inputs(m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(m, H, device=DEV, generator=gen).to(torch.bfloat16),
            torch.randn(m, H, device=DEV, generator=gen).to(torch.bfloat16))


@needs_sm90
def test_pdl_is_used_on_hopper():
    assert pdl.configure("auto", DEV)
    assert pdl.launch_options(DEV) == (True, {"launch_pdl": True})
    assert not pdl.configure("off", DEV)
    assert pdl.launch_options(DEV) == (False, {})


@needs_sm90
@pytest.mark.parametrize("m", [1, 7, 64])
def test_chain_eager_same_bits_with_and_without_pdl(m):
    gen = torch.Generator(DEV).manual_seed(m)
    block = Block(gen)
    for _ in range(3):
        x, r = inputs(m, gen)
        pdl.configure("off", DEV)
        ref = block(x, r)
        pdl.configure("on", DEV)
        got = block(x, r)
        torch.cuda.synchronize()
        assert torch.isfinite(ref).all()
        assert torch.equal(got, ref)


@needs_sm90
@pytest.mark.parametrize("m", [1, 16])
def test_chain_graph_replays_match_pdl_off(m):
    gen = torch.Generator(DEV).manual_seed(100 + m)
    block = Block(gen)
    x, r = inputs(m, gen)
    pdl.configure("on", DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(x, r)  # compile and allocate the split-K counters outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x, r)
    pdl.configure("off", DEV)
    for _ in range(10):
        nx, nr = inputs(m, gen)
        x.copy_(nx)
        r.copy_(nr)
        graph.replay()
        ref = block(nx, nr)
        torch.cuda.synchronize()
        assert torch.isfinite(ref).all()
        assert torch.equal(out, ref)
