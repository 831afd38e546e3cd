"""The Triton implementations of pieceworks::rms_norm / add_rms_norm / rope / silu_mul against their torch references,
on the GPU, at the models' shapes and strides (views of fused projections included)."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends import fused

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton", reason="triton is not importable here")
    assert fused._kernels() is not None


def randn(*shape, dtype=BF16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def ulp_mismatch(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements that differ, largest difference in units of b's bf16 spacing)."""
    diff = (a.float() - b.float()).abs()
    spacing = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return float((diff > 0).float().mean()), float((diff / spacing).max())


@pytest.mark.parametrize("tokens,hidden,dtype", [(1, 4096, BF16), (37, 7168, BF16), (300, 512, BF16),
                                                 (5, 1536, torch.float32), (0, 4096, BF16)])
def test_rms_norm(tokens, hidden, dtype):
    wide = randn(tokens, hidden + 64, dtype=dtype)
    x = wide[:, :hidden]  # a row-strided view, like DeepSeek's c_kv
    w = randn(hidden, dtype=dtype, seed=1) * 0.1 + 1
    got, want = fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:  # summation order and rsqrt's last bits show directly in float32
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    elif tokens:
        frac, worst = ulp_mismatch(got, want)
        assert frac < 0.01 and worst <= 1.0, (frac, worst)  # only where the mean's order rounds differently


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 32, 128), (200, 8, 128), (9, 128, 64), (3, 1, 64)])
def test_rope_bit_exact(tokens, heads, dim, interleaved):
    fused_qkv = randn(tokens, (heads + 3) * dim)
    x = fused_qkv[:, dim: (heads + 1) * dim].view(tokens, heads, dim)  # strided, as split from qkv
    angle = torch.rand(tokens, dim // 2, device="cuda") * 100
    got = fused.rope(x, angle.cos(), angle.sin(), interleaved)
    want = fused.rope_ref(x, angle.cos(), angle.sin(), interleaved)
    assert torch.equal(got, want)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tokens,hq,hk,dim", [(1, 32, 8, 128), (200, 32, 8, 128), (9, 128, 128, 64), (3, 4, 1, 64)])
def test_rope_qk_bit_exact(tokens, hq, hk, dim, interleaved):
    qkv = randn(tokens, (hq + 2 * hk) * dim)
    q, k, _ = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)  # strided views, as the model passes them
    q, k = q.view(tokens, hq, dim), k.view(tokens, hk, dim)
    angle = torch.rand(tokens, dim // 2, device="cuda") * 100
    got_q, got_k = fused.rope_qk(q, k, angle.cos(), angle.sin(), interleaved)
    assert torch.equal(got_q, fused.rope_ref(q, angle.cos(), angle.sin(), interleaved))
    assert torch.equal(got_k, fused.rope_ref(k, angle.cos(), angle.sin(), interleaved))


def test_rope_head_view_of_a_wider_row():
    q = randn(7, 16, 128 + 64)
    q_pe = q[..., 128:]  # DeepSeek: the rope part of every head
    angle = torch.rand(7, 32, device="cuda")
    assert torch.equal(fused.rope(q_pe, angle.cos(), angle.sin(), True),
                       fused.rope_ref(q_pe, angle.cos(), angle.sin(), True))


@pytest.mark.parametrize("tokens,inter", [(1, 14336), (64, 2048), (3, 100)])
def test_silu_mul(tokens, inter):
    gate_up = randn(tokens, 2 * inter) * 3
    gate, up = gate_up.split(inter, dim=-1)
    got, want = fused.silu_mul(gate, up), fused.silu_mul_ref(gate, up)
    frac, worst = ulp_mismatch(got, want)
    assert frac < 0.01 and worst <= 1.0, (frac, worst)


@pytest.mark.parametrize("tokens,hidden,dtype", [(1, 4096, BF16), (37, 7168, BF16), (300, 512, BF16),
                                                 (5, 1536, torch.float32), (0, 4096, BF16)])
def test_add_rms_norm(tokens, hidden, dtype):
    x, r = randn(tokens, hidden, dtype=dtype, seed=1), randn(tokens, hidden, dtype=dtype, seed=2)
    w = randn(hidden, dtype=dtype) * 0.1 + 1
    (out, s), (want, want_s) = fused.add_rms_norm(x, r, w, 1e-5), fused.add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(s, want_s)  # the add rounds once, as the plain add
    assert out.dtype == want.dtype and out.shape == want.shape
    if dtype == torch.float32:
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    elif tokens:
        frac, worst = ulp_mismatch(out, want)
        assert frac < 0.01 and worst <= 1.0, (frac, worst)


def test_ops_capture_in_a_cuda_graph():
    x, w = randn(4, 256), randn(256, seed=1)
    angle = torch.rand(4, 32, device="cuda")
    cos, sin = angle.cos(), angle.sin()

    def body():
        h = fused.add_rms_norm(fused.rms_norm(x, w, 1e-6), x, w, 1e-6)[0]
        return fused.silu_mul(fused.rope(h.view(4, 4, 64), cos, sin, False).view(4, 256), h)

    body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    x.copy_(randn(4, 256, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, body())
