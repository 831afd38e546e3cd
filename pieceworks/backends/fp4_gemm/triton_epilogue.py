"""The epilogues of the Triton NVFP4 GEMM (triton_kernels.py): the split-K handshake, SwiGLU, the q/k rope
of output column pairs, and the tile store that applies them. Each rounds as the unfused op it replaces
(backends/fused_kernels.py), so the fused and unfused paths give the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # the accurate exp of the silu_mul kernel (backends/fused_kernels.py), for the same bits
    from triton.language.extra import libdevice

    _exp = libdevice.exp
except ImportError:  # pragma: no cover - older triton
    _exp = tl.exp


@triton.jit
def publish_and_count(counter_ptr):
    """The split-K handshake: after this program stored its partial, add one to its tile's counter
    and return the old count (the same value in every thread). The barrier orders every thread's
    stores before the one atomic Triton issues for the program (a scalar atomic: one thread, result
    broadcast through shared memory behind a barrier); the atomic's release at GPU scope publishes
    them and its acquire, in the program that arrives last, orders that program's reads (L2, `.cg`)
    after every earlier program's stores. CUTLASS's split-K semaphore relies on the same barrier +
    one-thread release / acquire; per-thread `fence.acq_rel.gpu` on both sides, as before, cost
    about 1 us per split-K call on the H200 (docs/benchmarks.md)."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def swiglu_values(g, u, dtype: tl.constexpr):
    """silu(g) * u from the GEMM's float32 gate and up values, rounded as the unfused path rounds:
    the GEMM's output to `dtype`, then silu_mul (backends/fused_kernels.py) on those."""
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    act = (g / (1.0 + _exp(-g))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


# Tiles of at most this many rows rope in the GEMM's epilogue (`rope_pair`); on the H200 the 16- and
# 64-row tiles were slower with it than the GEMM followed by the rope kernel (docs/benchmarks.md).
ROPE_EPILOGUE_BLOCK_M = 8


@triton.jit
def rope_cs(cos_ptr, sin_ptr, stride_cos, stride_sin, rows, row_mask, p, rope_cols, HALF: tl.constexpr):
    """cos and sin [rows, pairs] float32 of output column pairs p (`rope_pair`); 1 and 0 where a pair
    is not roped."""
    cmask = row_mask[:, None] & (2 * p < rope_cols)[None, :]
    j = p % HALF
    c = tl.load(cos_ptr + rows[:, None].to(tl.int64) * stride_cos + j[None, :], mask=cmask, other=1.0)
    s = tl.load(sin_ptr + rows[:, None].to(tl.int64) * stride_sin + j[None, :], mask=cmask, other=0.0)
    return c, s


@triton.jit
def rope_pair(y1, y2, p, c, s, rope_cols, HALF: tl.constexpr, dtype: tl.constexpr):
    """The fused rope epilogue for output column pairs p (weight rows 2p, 2p + 1 in the
    `interleave_rope_rows` order): y1, y2 [rows, pairs] float32 are the GEMM's values of both rows,
    c, s their cos and sin (`rope_cs`). Pairs below rope_cols / 2 are dims j and j + HALF of a q or
    k head, rotated as the rope kernel rounds (backends/fused_kernels.py `_rope_rows`: the GEMM's output
    rounded to `dtype`, cos/sin rounded to `dtype`, every product and sum rounded; `mul_rn` keeps the
    products from being contracted into FMAs, which that kernel avoids with enable_fp_fusion=False);
    the others are two v columns. Returns the two values in `dtype` and their output columns."""
    roped = 2 * p < rope_cols
    head = p // HALF
    j = p % HALF
    d1 = tl.where(roped, head * (2 * HALF) + j, 2 * p)
    d2 = tl.where(roped, head * (2 * HALF) + HALF + j, 2 * p + 1)
    x1 = y1.to(dtype).to(tl.float32)
    x2 = y2.to(dtype).to(tl.float32)
    c = c.to(dtype).to(tl.float32)
    s = s.to(dtype).to(tl.float32)
    o1 = (libdevice.mul_rn(x1, c).to(dtype).to(tl.float32) - libdevice.mul_rn(x2, s).to(dtype).to(tl.float32))
    o2 = (libdevice.mul_rn(x2, c).to(dtype).to(tl.float32) + libdevice.mul_rn(x1, s).to(dtype).to(tl.float32))
    o1 = tl.where(roped[None, :], o1.to(dtype), x1.to(dtype))
    o2 = tl.where(roped[None, :], o2.to(dtype), x2.to(dtype))
    return o1, o2, d1, d2


@triton.jit
def store_out(out_ptr, y, rm, col0, M, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SWIGLU: tl.constexpr, ROPE: tl.constexpr = False, rope_c=None, rope_s=None, rope_cols=0,
               ROPE_HALF: tl.constexpr = 1):
    """Store the tile y [BM, BN] (float32, columns col0..) of x @ W.T, or with SWIGLU its
    silu(gate) * up: weight rows 2j and 2j + 1 are gate and up of output column j (the
    `interleave_gate_up` order), so the tile gives output columns col0/2 .. col0/2 + BN/2. With ROPE
    the weight is a q/k/v weight in the `interleave_rope_rows` order (`rope_pair`; rope_c / rope_s
    from `rope_cs`)."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if ROPE:
        y1, y2 = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
        p = col0 // 2 + tl.arange(0, BLOCK_N // 2)
        o1, o2, d1, d2 = rope_pair(y1, y2, p, rope_c, rope_s, rope_cols, ROPE_HALF, dtype)
        mask = (rm[:, None] < M) & (2 * p < N)[None, :]
        rows = out_ptr + rm[:, None].to(tl.int64) * stride_om
        tl.store(rows + d1[None, :], o1, mask=mask)
        tl.store(rows + d2[None, :], o2, mask=mask)
    elif SWIGLU:
        g, u = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
        cols = col0 // 2 + tl.arange(0, BLOCK_N // 2)
        mask = (rm[:, None] < M) & (cols[None, :] < N // 2)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + cols[None, :], swiglu_values(g, u, dtype),
                 mask=mask)
    else:
        cols = col0 + tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (cols[None, :] < N)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(dtype), mask=mask)
