"""torch.library custom ops in namespace `pieceworks`: every kernel entry the models call.

Each op takes tensors and scalars only and dispatches to the backend the kernel table chose for the
running step (read from the forward context). Each has a fake implementation, so Dynamo traces the
models with `fullgraph=True` and treats every op as one opaque node. The models call `attention`, `mla`
and `moe` here: the op while Dynamo traces, its implementation without the dispatcher in eager code
(`core/direct.py`). `attention` and `mla` write into
a caller-allocated `out`: they are the splitting ops of piecewise graphs, and the piece before them
owns the output buffer, so its address stays fixed across graph replays.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pieceworks.backends.moe.base import MoEWeights
from pieceworks.core.context import get_forward_context
from pieceworks.core.direct import direct

SPLITTING_OPS = ("pieceworks::attention", "pieceworks::mla")


def attention_impl(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: float) -> None:
    ctx = get_forward_context()
    ctx.kernels.attention.forward(q, k, v, out, layer_id, scale, ctx.kv)


def mla_impl(q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, out: Tensor, layer_id: int,
             scale: float) -> None:
    ctx = get_forward_context()
    ctx.kernels.mla.forward(q_nope, q_pe, c_kv, k_pe, out, layer_id, scale, ctx.kv)


@torch.library.custom_op("pieceworks::attention", mutates_args=("out",))
def attention_op(q: Tensor, k: Tensor, v: Tensor, out: Tensor, layer_id: int, scale: float) -> None:
    """Paged attention; see backends/attention/base.py for shapes. Writes `out` [T, Hq, D]."""
    attention_impl(q, k, v, out, layer_id, scale)


@attention_op.register_fake
def _attention_fake(q, k, v, out, layer_id, scale):
    return None


@torch.library.custom_op("pieceworks::mla", mutates_args=("out",))
def mla_op(
    q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, out: Tensor, layer_id: int, scale: float
) -> None:
    """Paged MLA (absorbed); see backends/mla/base.py for shapes. Writes `out` [T, H, kv_lora_rank]."""
    mla_impl(q_nope, q_pe, c_kv, k_pe, out, layer_id, scale)


@mla_op.register_fake
def _mla_fake(q_nope, q_pe, c_kv, k_pe, out, layer_id, scale):
    return None


@torch.library.custom_op("pieceworks::fp4_gemm", mutates_args=())
def fp4_gemm(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor,
    input_scale: Tensor,
    out_features: int,
) -> Tensor:
    """x [M, K] @ dequant(W).T -> [M, out_features] in x.dtype; see backends/fp4_gemm/base.py."""
    backend = get_forward_context().kernels.fp4_gemm
    return backend.forward(x, weight, weight_scale, weight_scale_2, input_scale, out_features)


@fp4_gemm.register_fake
def _fp4_gemm_fake(x, weight, weight_scale, weight_scale_2, input_scale, out_features):
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("pieceworks::fp4_gemm_swiglu", mutates_args=())
def fp4_gemm_swiglu(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor,
    input_scale: Tensor,
    intermediate: int,
) -> Tensor:
    """silu(x @ gate.T) * (x @ up.T) -> [M, intermediate] for a SwiGLU MLP's gate/up weight as
    `Fp4GemmBackend.prepare_gate_up` returned it; see backends/fp4_gemm/base.py."""
    backend = get_forward_context().kernels.fp4_gemm
    return backend.forward_swiglu(x, weight, weight_scale, weight_scale_2, input_scale, intermediate)


@fp4_gemm_swiglu.register_fake
def _fp4_gemm_swiglu_fake(x, weight, weight_scale, weight_scale_2, input_scale, intermediate):
    return x.new_empty((x.shape[0], intermediate))


@torch.library.custom_op("pieceworks::fp4_gemm_qkv_rope", mutates_args=())
def fp4_gemm_qkv_rope(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor,
    input_scale: Tensor,
    cos: Tensor,
    sin: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Tensor:
    """x @ [q; k; v].T with q and k roped (rotate-half) -> [M, (num_heads + 2 * num_kv_heads) *
    head_dim], for a weight as `Fp4GemmBackend.prepare_qkv_rope` returned it; see
    backends/fp4_gemm/base.py."""
    backend = get_forward_context().kernels.fp4_gemm
    return backend.forward_qkv_rope(x, weight, weight_scale, weight_scale_2, input_scale, cos, sin, num_heads,
                                    num_kv_heads, head_dim)


@fp4_gemm_qkv_rope.register_fake
def _fp4_gemm_qkv_rope_fake(x, weight, weight_scale, weight_scale_2, input_scale, cos, sin, num_heads,
                            num_kv_heads, head_dim):
    return x.new_empty((x.shape[0], (num_heads + 2 * num_kv_heads) * head_dim))


@torch.library.custom_op("pieceworks::fp4_gemm_add", mutates_args=())
def fp4_gemm_add(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor,
    input_scale: Tensor,
    out_features: int,
    residual: Tensor,
) -> Tensor:
    """residual + x @ dequant(W).T -> [M, out_features]; see `Fp4GemmBackend.forward_add`."""
    backend = get_forward_context().kernels.fp4_gemm
    return backend.forward_add(x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual)


@fp4_gemm_add.register_fake
def _fp4_gemm_add_fake(x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual):
    return residual.new_empty((x.shape[0], out_features))


@torch.library.custom_op("pieceworks::fp4_gemm_add_norm", mutates_args=())
def fp4_gemm_add_norm(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor,
    input_scale: Tensor,
    out_features: int,
    residual: Tensor,
    norm_weight: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(s = residual + x @ dequant(W).T, t = s * norm_weight, partial sums of s^2 [M, ceil(N / 16)]); see
    `Fp4GemmBackend.forward_add_norm`."""
    backend = get_forward_context().kernels.fp4_gemm
    return backend.forward_add_norm(x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual,
                                    norm_weight)


@fp4_gemm_add_norm.register_fake
def _fp4_gemm_add_norm_fake(x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual,
                            norm_weight):
    from pieceworks.backends.fp4_gemm.base import norm_parts

    s = residual.new_empty((x.shape[0], out_features))
    return s, s.new_empty(s.shape), s.new_empty((x.shape[0], norm_parts(out_features)), dtype=torch.float32)


@torch.library.custom_op("pieceworks::fp4_gemm_norm_swiglu", mutates_args=())
def fp4_gemm_norm_swiglu(
    s: Tensor,
    t: Tensor,
    partials: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor,
    input_scale: Tensor,
    intermediate: int,
) -> Tensor:
    """`fp4_gemm_swiglu` of RMSNorm(s); see `Fp4GemmBackend.forward_norm_swiglu`."""
    backend = get_forward_context().kernels.fp4_gemm
    return backend.forward_norm_swiglu(s, t, partials, norm_weight, eps, weight, weight_scale, weight_scale_2,
                                       input_scale, intermediate)


@fp4_gemm_norm_swiglu.register_fake
def _fp4_gemm_norm_swiglu_fake(s, t, partials, norm_weight, eps, weight, weight_scale, weight_scale_2,
                               input_scale, intermediate):
    return s.new_empty((s.shape[0], intermediate))


@torch.library.custom_op("pieceworks::fp4_gemm_norm_qkv_rope", mutates_args=())
def fp4_gemm_norm_qkv_rope(
    s: Tensor,
    t: Tensor,
    partials: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    weight_scale: Tensor,
    weight_scale_2: Tensor,
    input_scale: Tensor,
    cos: Tensor,
    sin: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Tensor:
    """`fp4_gemm_qkv_rope` of RMSNorm(s); see `Fp4GemmBackend.forward_norm_qkv_rope`."""
    backend = get_forward_context().kernels.fp4_gemm
    return backend.forward_norm_qkv_rope(s, t, partials, norm_weight, eps, weight, weight_scale, weight_scale_2,
                                         input_scale, cos, sin, num_heads, num_kv_heads, head_dim)


@fp4_gemm_norm_qkv_rope.register_fake
def _fp4_gemm_norm_qkv_rope_fake(s, t, partials, norm_weight, eps, weight, weight_scale, weight_scale_2,
                                 input_scale, cos, sin, num_heads, num_kv_heads, head_dim):
    return s.new_empty((s.shape[0], (num_heads + 2 * num_kv_heads) * head_dim))


def moe_impl(
    x: Tensor,
    router_logits: Tensor,
    correction_bias: Tensor,
    w13: Tensor,
    w13_scale: Tensor,
    w13_scale_2: Tensor,
    w13_input_scale: Tensor,
    w2: Tensor,
    w2_scale: Tensor,
    w2_scale_2: Tensor,
    w2_input_scale: Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> Tensor:
    """Routed experts: x [T, H] -> [T, H]; see backends/moe/base.py for the weights and routing."""
    w = MoEWeights(w13, w13_scale, w13_scale_2, w13_input_scale, w2, w2_scale, w2_scale_2, w2_input_scale)
    backend = get_forward_context().kernels.moe
    return backend.forward(
        x, router_logits, correction_bias, w, top_k, num_expert_group, topk_group, renormalize,
        routed_scaling_factor,
    )


moe_op = torch.library.custom_op("pieceworks::moe", moe_impl, mutates_args=())


@moe_op.register_fake
def _moe_fake(x, router_logits, correction_bias, *rest):
    return torch.empty_like(x)


# What the models call (core/direct.py): the op while Dynamo traces, its implementation straight in eager
# code (the dispatcher costs tens of microseconds per call; a step makes several per layer).
attention = direct(attention_op, attention_impl)
mla = direct(mla_op, mla_impl)
moe = direct(moe_op, moe_impl)


# What a splitting op does, callable without the dispatcher: the piecewise runner calls these between
# pieces (same function the op runs; it saves the custom-op dispatch, ~10s of us per layer).
SPLITTING_IMPLS = {"pieceworks::attention": attention_impl, "pieceworks::mla": mla_impl}
assert tuple(SPLITTING_IMPLS) == SPLITTING_OPS


def splitting_impl(target: object):
    """The direct implementation of a splitting op's FX target, or None."""
    for name, impl in SPLITTING_IMPLS.items():
        packet = getattr(torch.ops.pieceworks, name.split("::")[1])
        if target is packet or target is packet.default:
            return impl
    return None


def is_splitting_node_target(target: object) -> bool:
    """Whether an FX node target is a splitting op (Dynamo may record the packet or `.default`)."""
    return splitting_impl(target) is not None
