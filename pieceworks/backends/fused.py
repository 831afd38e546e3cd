"""Fused elementwise ops of the model bodies: RMSNorm (alone or after the residual add), rope,
SiLU-and-multiply.

Each is a torch custom op (`pieceworks::rms_norm`, `pieceworks::add_rms_norm`, `pieceworks::rope`,
`pieceworks::rope_qk` (queries and keys in one launch), `pieceworks::silu_mul`) whose default
implementation is the plain torch code of `*_ref` (the numerics the models define: the CPU parity with
transformers), with a CUDA implementation that is one Triton kernel (`fused_kernels.py`) where the
plain code launches several small kernels per call. In an NVFP4 Llama-3.1-8B-shaped decode step at
batch 1 on the H200 those small kernels took 39% of the GPU time (benchmarks/profile_step.py --decode 1;
docs/benchmarks.md).

The Triton kernels round exactly where the torch code rounds (every bf16 product and sum), so they
agree with it to the bit except where the two reduce in a different order (RMSNorm's mean of squares)
or compute exp differently (SiLU): at most one unit in the last place, and rarely.

The models call `rms_norm`, `add_rms_norm`, `rope`, `rope_qk` and `silu_mul`: the op while Dynamo
traces (inside piecewise graphs the ops are opaque nodes like the kernel ops, captured into the pieces'
CUDA graphs), its implementation straight in eager code, without the dispatcher (`core/direct.py`).
triton is imported on first CUDA use only; without it the CUDA path runs the torch code.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from pieceworks.core.direct import direct


# --- reference (torch) implementations: the numerics the models define ----------------------------
def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, H] / rms(x) * weight [H], normalized in float32, rounded to x.dtype before the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the next RMSNorm of a decoder block in one op: s = residual + x (rounded to
    their dtype, as the plain add), returns (rms_norm(s, weight, eps), s). x, residual [T, H]."""
    s = residual + x
    return rms_norm_ref(s, weight, eps), s


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding: x [T, heads, D], cos/sin [T, D/2] float32 -> [T, heads, D] in x.dtype.

    interleaved=False rotates halves (Llama); True rotates pairs (x0, x1), (x2, x3), ... and writes the
    result de-interleaved (DeepSeek, as transformers does it; q and k agree, so dot products hold).
    """
    c, s = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_qk_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    """`rope` of the queries q [T, Hq, D] and the keys k [T, Hk, D] at the same positions: one launch on
    CUDA where two `rope` calls take two (same numerics)."""
    return rope_ref(q, cos, sin, interleaved), rope_ref(k, cos, sin, interleaved)


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, both [T, I] (rounded to their dtype after the silu, as torch does)."""
    return torch.nn.functional.silu(gate) * up


# --- the ops: each registered from its reference, with a fake and a CUDA kernel ------------------------
rms_norm_op = torch.library.custom_op("pieceworks::rms_norm", rms_norm_ref, mutates_args=())


@rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@rms_norm_op.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    k = _kernels()
    if k is None or not k.rms_norm_supported(x, weight):
        return rms_norm_ref(x, weight, eps)
    return k.rms_norm(x, weight, eps)


add_rms_norm_op = torch.library.custom_op("pieceworks::add_rms_norm", add_rms_norm_ref, mutates_args=())


@add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, weight, eps):
    s = x.new_empty(x.shape, dtype=torch.promote_types(residual.dtype, x.dtype))
    return s.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, s.dtype)), s


@add_rms_norm_op.register_kernel("cuda")
def _add_rms_norm_cuda(x, residual, weight, eps):
    k = _kernels()
    if k is None or not k.add_rms_norm_supported(x, residual, weight):
        return add_rms_norm_ref(x, residual, weight, eps)
    return k.add_rms_norm(x, residual, weight, eps)


rope_op = torch.library.custom_op("pieceworks::rope", rope_ref, mutates_args=())


@rope_op.register_fake
def _rope_fake(x, cos, sin, interleaved):
    return x.new_empty(x.shape)


@rope_op.register_kernel("cuda")
def _rope_cuda(x, cos, sin, interleaved):
    k = _kernels()
    if k is None or not k.rope_supported(x, cos, sin):
        return rope_ref(x, cos, sin, interleaved)
    return k.rope(x, cos, sin, interleaved)


rope_qk_op = torch.library.custom_op("pieceworks::rope_qk", rope_qk_ref, mutates_args=())


@rope_qk_op.register_fake
def _rope_qk_fake(q, k, cos, sin, interleaved):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@rope_qk_op.register_kernel("cuda")
def _rope_qk_cuda(q, k, cos, sin, interleaved):
    kn = _kernels()
    if (kn is None or q.dtype != k.dtype or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]
            or not (kn.rope_supported(q, cos, sin) and kn.rope_supported(k, cos, sin))):
        return _rope_cuda(q, cos, sin, interleaved), _rope_cuda(k, cos, sin, interleaved)
    return kn.rope_qk(q, k, cos, sin, interleaved)


silu_mul_op = torch.library.custom_op("pieceworks::silu_mul", silu_mul_ref, mutates_args=())


@silu_mul_op.register_fake
def _silu_mul_fake(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@silu_mul_op.register_kernel("cuda")
def _silu_mul_cuda(gate, up):
    k = _kernels()
    if k is None or not k.silu_mul_supported(gate, up):
        return silu_mul_ref(gate, up)
    return k.silu_mul(gate, up)


# What the models call: the op under Dynamo, its implementation straight otherwise (core/direct.py).
rms_norm = direct(rms_norm_op, rms_norm_ref, _rms_norm_cuda)
add_rms_norm = direct(add_rms_norm_op, add_rms_norm_ref, _add_rms_norm_cuda)
rope = direct(rope_op, rope_ref, _rope_cuda)
rope_qk = direct(rope_qk_op, rope_qk_ref, _rope_qk_cuda)
silu_mul = direct(silu_mul_op, silu_mul_ref, _silu_mul_cuda)


@functools.cache
def _kernels():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from pieceworks.backends import fused_kernels

    return fused_kernels
