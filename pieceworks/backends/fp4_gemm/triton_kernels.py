"""Triton kernels for weight-only NVFP4 GEMM (w4a16): y = x @ dequant(W).T, dequantized in registers.

Imported only by the Triton backends' methods (it imports triton at the top). The weight layout these
kernels read ("k32", produced by `pieceworks.backends.fp4_gemm.triton.repack_k32`):

- K is zero-padded to Kp, a multiple of 512 (zero codes, zero block scales), so that every BLOCK_K
  divides it and the weight loads need no masks (masked loads would keep Triton from pipelining them).
- Each group of 32 consecutive elements of a row is stored as 8 little-endian 16-bit units. Unit u
  (0..7) of group g holds the four codes of elements 32g + 8j + u, j = 0..3 ("slot j"), at these bits
  (code bits: s = sign, E1 E0 = exponent, m = mantissa):

      slot 0: s@15 E1@8  E0@7  m@6        slot 2: s@9  E1@2  E0@1  m@0
      slot 1: s@12 E1@5  E0@4  m@3        slot 3: s@14 E1@11 E0@10 m@13

  so slots 0-2 are `(u << 3j) & 0x81C0` away from a bfloat16 whose bits are the code's: that bfloat16
  equals e2m1 * 2^-126 (code 1, i.e. 0.5, is a subnormal). Two units decode together (one 32-bit
  register holds a pair, one op serves both): 12 integer ops and 4 bf16x2 multiplies per 8 values.
- Block scales stay linear, [N, Kp/16] float8_e4m3fn, read as int16 pairs: pair g holds scale 2g (low
  byte; slots 0 and 1 of group g) and scale 2g + 1 (high byte; slots 2 and 3).
- Codes of blocks whose scale is zero are zeroed by the repack (their values are zero either way), so
  the scale conversion below may map a zero scale to any finite number.

A scale pair converts to two bfloat16 multipliers in three instructions: `cvt.rn.f16x2.e4m3x2` (exact:
every e4m3 value, subnormals included, is a normal float16 with bits 6..0 zero), a right shift by 3
(the float16 exponent lands in the low five bits of the bfloat16 exponent, the mantissa under it) and
an OR of 0x7000 (adds 224 to the exponent), which gives bf16(scale * 2^112) exactly. Multiplying the
code pattern (e2m1 * 2^-126) by it gives bf16 e2m1 * scale * 2^-14 exactly (at most 6 significant
bits; the smallest nonzero product, 0.5 * 2^-9 * 2^-14, is a normal bfloat16). The accumulator (fp32)
is multiplied by weight_scale_2 * 2^14 at the end.

The K loop either runs four dots of BLOCK_K/4 each, one per slot, against the matching columns of x,
or (ONE_DOT) interleaves the four decoded slots back into element order (a relabeling of registers:
every thread already holds the same units of every slot) and runs one dot of K = BLOCK_K against x in
element order. Triton keeps several wgmma groups of the one dot in flight while the next k16 step is
decoded; the four-dot loop waits for each slot's wgmmas.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.backends import pdl_kernels

try:  # the accurate exp of the silu_mul kernel (models/fused_kernels.py), for the same bits
    from triton.language.extra import libdevice

    _exp = libdevice.exp
except ImportError:  # pragma: no cover - older triton
    _exp = tl.exp

# Scale bias folded into the decoded weights (see the module docstring), undone in the epilogue.
OUT_BIAS = tl.constexpr(16384.0)  # 2^14

_DECODE_ASM = tl.constexpr("""{
    .reg .b32 t0, t1, t2, t3, t4, t5;
    and.b32 t0, $4, 0x81C081C0;
    mul.rn.bf16x2 $0, t0, $5;
    shl.b32 t1, $4, 3;
    and.b32 t1, t1, 0x81C081C0;
    mul.rn.bf16x2 $1, t1, $5;
    shl.b32 t2, $4, 6;
    and.b32 t2, t2, 0x81C081C0;
    mul.rn.bf16x2 $2, t2, $6;
    shl.b32 t3, $4, 1;
    and.b32 t3, t3, 0x80008000;
    shr.b32 t4, $4, 3;
    and.b32 t4, t4, 0x01800180;
    or.b32 t3, t3, t4;
    shr.b32 t5, $4, 7;
    and.b32 t5, t5, 0x00400040;
    or.b32 t3, t3, t5;
    mul.rn.bf16x2 $3, t3, $6;
}""")


@triton.jit
def _e2m1_arith(sign, em, scale):
    # em << 9 as an fp16 is e2m1 * 2^-14 (code 1 a subnormal, converted exactly).
    mag = (em << 9).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    return tl.where(sign != 0, -mag, mag) * scale


_SCALE_ASM = tl.constexpr("""{
    .reg .b32 h;
    cvt.rn.f16x2.e4m3x2 h, $2;
    shr.b32 h, h, 3;
    or.b32 h, h, 0x70007000;
    mov.b32 {$0, $1}, h;
}""")


@triton.jit
def scales_k32(s, USE_ASM: tl.constexpr):
    """Scale pairs (int16: scale 2g low byte, 2g + 1 high byte) -> (slots 0/1, slots 2/3) multipliers:
    bf16 scale * 2^112 with USE_ASM, else float32 scale * 2^-14 (the arithmetic decode's)."""
    if USE_ASM:
        s_a, s_b = tl.inline_asm_elementwise(
            asm=_SCALE_ASM, constraints="=h,=h,h", args=[s],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1,
        )
    else:
        u = s.to(tl.int32)
        s_a = (u & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s_b = ((u >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s_a = s_a * 6.103515625e-05  # 2^-14
        s_b = s_b * 6.103515625e-05
    return s_a, s_b


@triton.jit
def decode_k32(w, s_a, s_b, USE_ASM: tl.constexpr):
    """Decode k32 units into four bf16 tensors (slots 0..3), each e2m1 * scale * 2^-14.

    w: int16 [..., 8] units; s_a, s_b: the multipliers of slots 0/1 and 2/3 from `scales_k32`,
    broadcastable to w.
    """
    if USE_ASM:
        sa = tl.broadcast_to(s_a, w.shape)
        sb = tl.broadcast_to(s_b, w.shape)
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            asm=_DECODE_ASM,
            constraints="=r,=r,=r,=r,r,r,r",
            args=[w, sa, sb],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=2,
        )
    else:
        u = w.to(tl.int32) & 0xFFFF
        v0 = _e2m1_arith((u >> 15) & 1, (u >> 6) & 7, s_a).to(tl.bfloat16)
        v1 = _e2m1_arith((u >> 12) & 1, (u >> 3) & 7, s_a).to(tl.bfloat16)
        v2 = _e2m1_arith((u >> 9) & 1, u & 7, s_b).to(tl.bfloat16)
        em3 = (((u >> 10) & 3) << 1) | ((u >> 13) & 1)
        v3 = _e2m1_arith((u >> 14) & 1, em3, s_b).to(tl.bfloat16)
    return v0, v1, v2, v3


@triton.jit
def _mma(acc, w, x, W_AS_A: tl.constexpr):
    # W_AS_A: acc is [BN, BM] (weights are the register operand of wgmma); else [BM, BN].
    if W_AS_A:
        acc = tl.dot(w, tl.trans(x), acc)
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _dequant_mma(acc, w, s, x0, x1, x2, x3, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 W_AS_A: tl.constexpr, USE_ASM: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc += the tile's four slot products. ONE_DOT: x0 is the tile's x in element order [BM, BK]
    (x1..x3 unused) and the decoded slots, interleaved back into element order, go to one dot of
    K = BLOCK_K; else four dots of BLOCK_K / 4."""
    BG: tl.constexpr = BLOCK_K // 32
    BQ: tl.constexpr = BLOCK_K // 4
    s_a, s_b = scales_k32(s, USE_ASM)  # [BN, BG]: slots 0/1 and 2/3 of each group
    s_a = tl.broadcast_to(s_a[:, :, None], (BLOCK_N, BG, 8)).reshape(BLOCK_N, BQ)
    s_b = tl.broadcast_to(s_b[:, :, None], (BLOCK_N, BG, 8)).reshape(BLOCK_N, BQ)
    v0, v1, v2, v3 = decode_k32(w, s_a, s_b, USE_ASM)
    if ONE_DOT:
        # [BN, BQ, 2 (slot bit 0), 2 (slot bit 1)] -> [BN, group, slot, unit] -> [BN, BK].
        v = tl.join(tl.join(v0, v1), tl.join(v2, v3)).reshape(BLOCK_N, BG, 8, 2, 2)
        v = v.permute(0, 1, 4, 3, 2).reshape(BLOCK_N, BLOCK_K)
        acc = _mma(acc, v, x0, W_AS_A)
    else:
        acc = _mma(acc, v0, x0, W_AS_A)
        acc = _mma(acc, v1, x1, W_AS_A)
        acc = _mma(acc, v2, x2, W_AS_A)
        acc = _mma(acc, v3, x3, W_AS_A)
    return acc


@triton.jit
def fp4_tile_loop(
    acc, acc2, x_ptr, x_rows, x_mask, w_ptr, w_rows, w_rows2, s_ptr, s_rows, s_rows2,
    k_lo, num_iters, K, Kp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, W_AS_A: tl.constexpr, USE_ASM: tl.constexpr, DUAL: tl.constexpr,
    ONE_DOT: tl.constexpr = False,
):  # EVEN_K: K == Kp, x needs no column mask
    """acc += x[rows, k_lo : k_lo + num_iters*BLOCK_K] @ dequant(W[w_rows, same]).T, without the
    global scale; with DUAL also acc2 for the weight rows w_rows2 (x is loaded once for both).

    x_rows [BM] / w_rows [BN] / s_rows [BN]: int64 offsets of each row's start (x in elements, w in
    16-bit units, s in int16 scale pairs); x_mask [BM]: rows to read (others load zeros). acc/acc2
    are [BN, BM] when W_AS_A, else [BM, BN]. Weights, scales and x go through Triton's cp.async
    pipeline (num_stages)."""
    BQ: tl.constexpr = BLOCK_K // 4
    c = tl.arange(0, BQ)  # k32 unit within the tile: group c // 8, unit c % 8
    t32 = tl.arange(0, BLOCK_K // 32)  # scale pair within the tile
    xc = (c // 8) * 32 + (c % 8)  # element of slot 0 of unit c
    w_ptrs = w_ptr + w_rows[:, None] + (k_lo // 4 + c)[None, :]
    s_ptrs = s_ptr + s_rows[:, None] + (k_lo // 32 + t32)[None, :]
    if DUAL:
        w_ptrs2 = w_ptr + w_rows2[:, None] + (k_lo // 4 + c)[None, :]
        s_ptrs2 = s_ptr + s_rows2[:, None] + (k_lo // 32 + t32)[None, :]
    x_ptrs = x_ptr + x_rows[:, None] + (k_lo + xc)[None, :]
    xs = tl.arange(0, BLOCK_K)  # ONE_DOT: x in element order
    xs_ptrs = x_ptr + x_rows[:, None] + (k_lo + xs)[None, :]
    xm = x_mask[:, None]
    for it in range(num_iters):
        k0 = k_lo + it * BLOCK_K
        # The weights are padded to a multiple of every BLOCK_K and splits are whole BLOCK_K
        # iterations, so weight and scale loads need no mask: Triton's pipeliner streams both with
        # cp.async (scales from 8 bytes a row, BLOCK_K >= 128; smaller tiles load them synchronously).
        w = tl.load(w_ptrs)
        s0 = tl.load(s_ptrs)
        if ONE_DOT:
            if EVEN_K:
                x0 = tl.load(xs_ptrs, mask=xm, other=0.0)
            else:
                x0 = tl.load(xs_ptrs, mask=xm & (k0 + xs < K)[None, :], other=0.0)
            x1 = x0
            x2 = x0
            x3 = x0
        elif EVEN_K:
            x0 = tl.load(x_ptrs, mask=xm, other=0.0)
            x1 = tl.load(x_ptrs + 8, mask=xm, other=0.0)
            x2 = tl.load(x_ptrs + 16, mask=xm, other=0.0)
            x3 = tl.load(x_ptrs + 24, mask=xm, other=0.0)
        else:
            xk = k0 + xc
            x0 = tl.load(x_ptrs, mask=xm & (xk < K)[None, :], other=0.0)
            x1 = tl.load(x_ptrs + 8, mask=xm & (xk + 8 < K)[None, :], other=0.0)
            x2 = tl.load(x_ptrs + 16, mask=xm & (xk + 16 < K)[None, :], other=0.0)
            x3 = tl.load(x_ptrs + 24, mask=xm & (xk + 24 < K)[None, :], other=0.0)
        x0 = x0.to(tl.bfloat16)
        x1 = x1.to(tl.bfloat16)
        x2 = x2.to(tl.bfloat16)
        x3 = x3.to(tl.bfloat16)
        acc = _dequant_mma(acc, w, s0, x0, x1, x2, x3, BLOCK_N, BLOCK_K, W_AS_A, USE_ASM, ONE_DOT)
        if DUAL:
            w2 = tl.load(w_ptrs2)
            r0 = tl.load(s_ptrs2)
            acc2 = _dequant_mma(acc2, w2, r0, x0, x1, x2, x3, BLOCK_N, BLOCK_K, W_AS_A, USE_ASM,
                                 ONE_DOT)
            w_ptrs2 += BLOCK_K // 4
            s_ptrs2 += BLOCK_K // 32
        w_ptrs += BLOCK_K // 4
        s_ptrs += BLOCK_K // 32
        x_ptrs += BLOCK_K
        xs_ptrs += BLOCK_K
    return acc, acc2


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
def _swiglu(g, u, dtype: tl.constexpr):
    """silu(g) * u from the GEMM's float32 gate and up values, rounded as the unfused path rounds:
    the GEMM's output to `dtype`, then silu_mul (models/fused_kernels.py) on those."""
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    act = (g / (1.0 + _exp(-g))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def _store_out(out_ptr, y, rm, col0, M, N, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SWIGLU: tl.constexpr):
    """Store the tile y [BM, BN] (float32, columns col0..) of x @ W.T, or with SWIGLU its
    silu(gate) * up: weight rows 2j and 2j + 1 are gate and up of output column j (the
    `interleave_gate_up` order), so the tile gives output columns col0/2 .. col0/2 + BN/2."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if SWIGLU:
        g, u = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
        cols = col0 // 2 + tl.arange(0, BLOCK_N // 2)
        mask = (rm[:, None] < M) & (cols[None, :] < N // 2)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + cols[None, :], _swiglu(g, u, dtype),
                 mask=mask)
    else:
        cols = col0 + tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (cols[None, :] < N)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(dtype), mask=mask)


@triton.jit(do_not_specialize=["M", "iters", "num_splits"])
def _fp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, Kp, stride_xm, stride_wn, stride_sn, stride_om, iters, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, EVEN_K: tl.constexpr, W_AS_A: tl.constexpr,
    USE_ASM: tl.constexpr, ONE_DOT: tl.constexpr, PDL: tl.constexpr = False, SWIGLU: tl.constexpr = False,
):
    """One output tile, or (SPLIT) one of `num_splits` K ranges of it; ranges differ by at most one
    BLOCK_K iteration. A split writes its float32 partial to part[pid_k] (laid out [splits, M, N]);
    with FUSED_REDUCE, the split that arrives last at the tile's counter (count_ptr[tile], zero
    before the call and reset by that split) sums the partials in split order and writes out, so
    the result does not depend on which split finishes last; otherwise `_splitk_reduce_kernel` does.
    With PDL (pdl.py) a program waits for the kernel before it first and lets the next one start
    once its K loop is done, so that kernel's launch overlaps this one's epilogue. With SWIGLU the
    weight is a gate/up pair interleaved by rows and out [M, N/2] gets silu(gate) * up (`_store_out`);
    partials stay [splits, M, N]."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Weight rows past N re-read row N-1 (valid memory, never stored); x rows past M load zeros.
    x_rows = rm.to(tl.int64) * stride_xm
    n_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    base = iters // num_splits
    extra = iters % num_splits
    it_lo = pid_k * base + tl.minimum(pid_k, extra)
    num_iters = base + (pid_k < extra).to(tl.int32)
    k_lo = it_lo * BLOCK_K  # a multiple of BLOCK_K: 16-byte aligned weight loads
    w_rows = n_c * stride_wn
    s_rows = n_c * stride_sn
    pdl_kernels.wait(PDL)
    acc, unused = fp4_tile_loop(
        acc, acc, x_ptr, x_rows, rm < M, w_ptr, w_rows, w_rows, s_ptr, s_rows, s_rows,
        k_lo, num_iters, K, Kp,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, W_AS_A, USE_ASM, False, ONE_DOT,
    )
    pdl_kernels.launch_dependents(PDL)
    if W_AS_A:
        acc = tl.trans(acc)
    acc = acc * (tl.load(gs_ptr) * OUT_BIAS)
    if not SPLIT:
        _store_out(out_ptr, acc, rm, pid_n * BLOCK_N, M, N, stride_om, BLOCK_M, BLOCK_N, SWIGLU)
    else:
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None].to(tl.int64) * N + rn[None, :]
        mn = M.to(tl.int64) * N
        tl.store(part_ptr + pid_k * mn + offs, acc, mask=mask)
        if FUSED_REDUCE:
            # Publish this split's partial and count it (`publish_and_count`); the last split
            # reads all partials from L2.
            arrived = publish_and_count(count_ptr + pid)
            if arrived == num_splits - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k in range(num_splits):
                    total += tl.load(part_ptr + k * mn + offs, mask=mask, other=0.0,
                                     cache_modifier=".cg")
                _store_out(out_ptr, total, rm, pid_n * BLOCK_N, M, N, stride_om, BLOCK_M, BLOCK_N, SWIGLU)
                tl.store(count_ptr + pid, 0)


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, numel, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False, SWIGLU: tl.constexpr = False):
    """out = the partials [SPLIT_K, M, N] (numel = M * N) summed in split order; with SWIGLU,
    out [M, N/2] = silu(gate) * up of each interleaved column pair (see `_store_out`)."""
    pdl_kernels.enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if SWIGLU:
        half = N // 2
        mask = offs < numel // 2
        src = (offs // half) * N + 2 * (offs % half)
        g = tl.load(part_ptr + src, mask=mask, other=0.0)
        u = tl.load(part_ptr + src + 1, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            g += tl.load(part_ptr + s * numel + src, mask=mask, other=0.0)
            u += tl.load(part_ptr + s * numel + src + 1, mask=mask, other=0.0)
        tl.store(out_ptr + offs, _swiglu(g, u, out_ptr.dtype.element_ty), mask=mask)
    else:
        mask = offs < numel
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
                    SWIGLU: tl.constexpr = False):
    """out [N, K] = bf16(e2m1 * scale * weight_scale_2), as the torch reference rounds it. With
    SWIGLU (rows interleaved gate/up, `interleave_gate_up`) row 2j goes to out row j and row 2j + 1
    to out row N/2 + j: the gate/up weight in its checkpoint order."""
    BG: tl.constexpr = BLOCK_K // 32
    BQ: tl.constexpr = BLOCK_K // 4
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K  # within Kp: the weight needs no mask
    w = tl.load(w_ptr + n_c[:, None] * stride_wn + (k0 // 4 + tl.arange(0, BQ))[None, :])
    s = tl.load(s_ptr + n_c[:, None] * stride_sn + (k0 // 32 + tl.arange(0, BG))[None, :])
    s_a, s_b = scales_k32(s, USE_ASM)
    s_a = tl.broadcast_to(s_a[:, :, None], (BLOCK_N, BG, 8)).reshape(BLOCK_N, BQ)
    s_b = tl.broadcast_to(s_b[:, :, None], (BLOCK_N, BG, 8)).reshape(BLOCK_N, BQ)
    v0, v1, v2, v3 = decode_k32(w, s_a, s_b, USE_ASM)
    # Interleave the slots back into element order: [BN, BG, unit, slot] -> [BN, BG, slot, unit].
    v = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, BQ, 2 (slot bit 0), 2 (slot bit 1)]
    v = v.reshape(BLOCK_N, BG, 8, 2, 2).permute(0, 1, 3, 4, 2).reshape(BLOCK_N, BLOCK_K)
    gs = tl.load(gs_ptr) * OUT_BIAS
    k = k0 + tl.arange(0, BLOCK_K)
    if SWIGLU:
        dst = (rn % 2) * (N // 2) + rn // 2
    else:
        dst = rn
    tl.store(out_ptr + dst[:, None].to(tl.int64) * stride_on + k[None, :],
             (v.to(tl.float32) * gs).to(out_ptr.dtype.element_ty),
             mask=(rn < N)[:, None] & (k < K)[None, :])


def fp4_gemm(x, weight, weight_scale, weight_scale_2, N, K, cfg, split_k, counters=None, swiglu=False):
    """Launch the GEMM for x [M, K] and a k32-layout weight; returns [M, N] in x.dtype, or with
    `swiglu` (a gate/up weight of N rows interleaved by `interleave_gate_up`) [M, N/2] =
    silu(x @ gate.T) * (x @ up.T), rounded as the GEMM followed by the silu_mul op.

    weight: uint8 [N, Kp/2] (k32 layout), weight_scale: float8_e4m3fn [N, Kp/16], weight_scale_2:
    float32 scalar tensor. cfg: a `TileConfig`; split_k: K splits (any count up to the BLOCK_K
    iterations; 1 = none). counters: int32 tensor of zeros, at least one per output tile, that the
    call leaves zero again; with it a split-K call reduces in the same kernel, without it a second
    kernel sums the partials. Calls sharing counters must not run concurrently (under PDL they do
    not: a kernel touches them only after waiting for the one before it).
    """
    from pieceworks.backends import pdl

    M = x.shape[0]
    Kp = weight.shape[1] * 2
    assert not swiglu or N % 2 == 0, f"a gate/up weight has an even row count, not {N}"
    out = torch.empty((M, N // 2 if swiglu else N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if cfg.kind == "dequant":
        w = torch.empty((N, K), dtype=torch.bfloat16, device=x.device)
        grid = (triton.cdiv(N, 16), triton.cdiv(K, 512))
        _dequant_kernel[grid](weight.view(torch.int16), weight_scale.view(torch.int16), weight_scale_2,
                              w, N, K, weight.stride(0) // 2, weight_scale.stride(0) // 2, w.stride(0),
                              BLOCK_N=16, BLOCK_K=512, USE_ASM=cfg.asm, SWIGLU=swiglu, num_warps=4)
        y = torch.matmul(x.to(torch.bfloat16), w.t()).to(x.dtype)
        if swiglu:
            from pieceworks.models import fused_kernels

            return fused_kernels.silu_mul(y[:, : N // 2], y[:, N // 2 :])
        return y
    iters, rem = divmod(Kp, cfg.block_k)
    assert rem == 0, "weights must come from repack_k32 (K padded to a multiple of 512)"
    assert 1 <= split_k <= iters, f"split_k={split_k} must be in [1, {iters}]"
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    fused = split_k > 1 and counters is not None and counters.numel() >= tiles
    part = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else out
    use_pdl, launch = pdl.launch_options(x.device)
    _fp4_gemm_kernel[(tiles, split_k)](
        x, weight.view(torch.int16), weight_scale.view(torch.int16), weight_scale_2, out, part,
        counters if fused else out,
        M, N, K, Kp, x.stride(0), weight.stride(0) // 2, weight_scale.stride(0) // 2, out.stride(0), iters,
        split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SPLIT=split_k > 1, FUSED_REDUCE=fused, EVEN_K=K == Kp, W_AS_A=cfg.w_as_a, USE_ASM=cfg.asm,
        ONE_DOT=cfg.one_dot, PDL=use_pdl, SWIGLU=swiglu, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch,
    )
    if split_k > 1 and not fused:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(out.numel(), block),)](
            part, out, M * N, N, SPLIT_K=split_k, BLOCK=block, PDL=use_pdl, SWIGLU=swiglu, num_warps=4, **launch)
    return out
