"""The fused elementwise ops (pieceworks::rms_norm / add_rms_norm / rope / silu_mul): registration and CPU numerics.

On CPU the ops run their torch reference, so they must equal the formulas the models are defined by;
opcheck verifies schema, fake implementations and that Dynamo can trace them. The Triton (CUDA)
implementations are compared with the same references in tests/gpu/test_fused_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends import fused


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_transformers_formula(dtype):
    x, w = _x(5, 64, dtype=dtype), _x(64, dtype=dtype, seed=1)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    x, r, w = _x(5, 64, dtype=dtype), _x(5, 64, dtype=dtype, seed=2), _x(64, dtype=dtype, seed=1)
    out, s = fused.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, r + x)
    assert torch.equal(out, fused.rms_norm(r + x, w, 1e-5))


def test_block_forward_matches_the_plain_residual_stream():
    """block_forward's fused adds give, block after block and to the bit, `h = h + attn(norm(h));
    h = h + mlp(norm(h))` followed by the final norm."""
    from torch import nn

    from pieceworks.models.base import RMSNorm, block_forward

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = RMSNorm(32, 1e-6), RMSNorm(32, 1e-6)
            for n in (self.input_layernorm, self.post_attention_layernorm):
                n.weight.data.uniform_(0.5, 1.5)
            self.attn_proj, self.mlp = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)

        def self_attn(self, x, cos, sin):
            return self.attn_proj(x) * cos

    blocks = [Block().to(torch.bfloat16) for _ in range(3)]
    final = RMSNorm(32, 1e-6).to(torch.bfloat16)
    h0, cos = _x(4, 32, dtype=torch.bfloat16), _x(4, 1, dtype=torch.bfloat16, seed=3)
    with torch.no_grad():
        h = h0
        for b in blocks:
            h = h + b.self_attn(b.input_layernorm(h), cos, None)
            h = h + b.mlp(b.post_attention_layernorm(h))
        want = final(h)
        h, residual = h0, None
        for b in blocks:
            h, residual = block_forward(b, h, residual, cos, None)
        got = final(h, residual)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_rotates_pairs(interleaved):
    x = _x(3, 2, 8, dtype=torch.float64)
    angle = _x(3, 4, dtype=torch.float64, seed=1)
    out = fused.rope(x, angle.cos(), angle.sin(), interleaved)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :4], x[..., 4:])
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    assert torch.allclose(out, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1))
    # a rotation: norms of every pair are kept
    assert torch.allclose(out[..., :4] ** 2 + out[..., 4:] ** 2, x1**2 + x2**2)


def test_silu_mul():
    g, u = _x(4, 32, dtype=torch.bfloat16), _x(4, 32, dtype=torch.bfloat16, seed=1)
    assert torch.equal(fused.silu_mul(g, u), torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("op,args", [
    ("rms_norm", lambda: (_x(6, 32, dtype=torch.bfloat16), _x(32, dtype=torch.bfloat16, seed=1), 1e-6)),
    ("add_rms_norm", lambda: (_x(6, 32, dtype=torch.bfloat16), _x(6, 32, dtype=torch.bfloat16, seed=2),
                              _x(32, dtype=torch.bfloat16, seed=1), 1e-6)),
    ("rope", lambda: (_x(6, 4, 16)[:, 1:3], _x(6, 8).cos(), _x(6, 8).sin(), False)),
    ("rope", lambda: (_x(6, 1, 16), _x(6, 8).cos(), _x(6, 8).sin(), True)),
    ("silu_mul", lambda: tuple(_x(6, 64).split(32, dim=-1))),
    ("rope_qk", lambda: (_x(6, 7, 16)[:, :4], _x(6, 7, 16)[:, 4:6], _x(6, 8).cos(), _x(6, 8).sin(), False)),
])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.pieceworks, op).default, args())


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_qk_is_rope_of_each(interleaved):
    qkv = _x(5, (4 + 2 + 2) * 16)
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    q, k = q.view(5, 4, 16), k.view(5, 2, 16)
    angle = _x(5, 8, seed=3) * 10
    got_q, got_k = fused.rope_qk(q, k, angle.cos(), angle.sin(), interleaved)
    assert torch.equal(got_q, fused.rope(q, angle.cos(), angle.sin(), interleaved))
    assert torch.equal(got_k, fused.rope(k, angle.cos(), angle.sin(), interleaved))


def test_traced_without_graph_breaks():
    w = _x(16)

    def f(x, cos, sin):
        h = fused.rms_norm(x, w, 1e-6)
        q = fused.rope(h.view(-1, 2, 8), cos, sin, False)
        q2, k2 = fused.rope_qk(q, h.view(-1, 2, 8), cos, sin, False)
        return fused.silu_mul(q.flatten(1), h) + q2.flatten(1) * k2.flatten(1)

    args = (_x(5, 16), _x(5, 4).cos(), _x(5, 4).sin())
    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=True)
    assert torch.equal(compiled(*args), f(*args))
