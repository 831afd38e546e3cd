"""The fused elementwise ops (pieceworks::rms_norm / rope / silu_mul): registration and CPU numerics.

On CPU the ops run their torch reference, so they must equal the formulas the models are defined by;
opcheck verifies schema, fake implementations and that Dynamo can trace them. The Triton (CUDA)
implementations are compared with the same references in tests/gpu/test_fused_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.models import fused


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_transformers_formula(dtype):
    x, w = _x(5, 64, dtype=dtype), _x(64, dtype=dtype, seed=1)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), want)


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
    ("rope", lambda: (_x(6, 4, 16)[:, 1:3], _x(6, 8).cos(), _x(6, 8).sin(), False)),
    ("rope", lambda: (_x(6, 1, 16), _x(6, 8).cos(), _x(6, 8).sin(), True)),
    ("silu_mul", lambda: tuple(_x(6, 64).split(32, dim=-1))),
])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.pieceworks, op).default, args())


def test_traced_without_graph_breaks():
    w = _x(16)

    def f(x, cos, sin):
        h = fused.rms_norm(x, w, 1e-6)
        q = fused.rope(h.view(-1, 2, 8), cos, sin, False)
        return fused.silu_mul(q.flatten(1), h)

    args = (_x(5, 16), _x(5, 4).cos(), _x(5, 4).sin())
    compiled = torch.compile(f, fullgraph=True, backend="eager", dynamic=True)
    assert torch.equal(compiled(*args), f(*args))
