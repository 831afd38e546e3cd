"""The "k32" NVFP4 weight layout in Triton: decoding it in registers, and the K loop that feeds the decoded
tiles to bf16 tensor-core dots. Shared by the NVFP4 GEMM (triton_kernels.py) and the fused MoE
(backends/moe/triton_kernels.py); imports triton at the top.

The layout (produced by `pieceworks.backends.fp4_gemm.k32.repack_k32`):

- K is zero-padded to Kp, a multiple of 512 (zero codes, zero block scales), so that every BLOCK_K
  divides it and the weight loads need no masks (masked loads would keep Triton from pipelining them).
- Each 128 elements of a row (a storage tile's row, below) are 4 groups of 8 little-endian 16-bit units
  (16 bytes each). Group t (0..3) holds the tile's NVFP4 blocks t and t + 4: unit u (0..7) holds the four
  codes of elements 16t + 8j + u (slots j = 0, 1: block t) and 64 + 16t + 8(j - 2) + u (slots 2, 3: block
  t + 4) of the tile (`k32.element_of`), at these bits (code bits: s = sign, E1 E0 = exponent, m =
  mantissa):

      slot 0: s@15 E1@8  E0@7  m@6        slot 2: s@9  E1@2  E0@1  m@0
      slot 1: s@12 E1@5  E0@4  m@3        slot 3: s@11 E1@10 E0@14 m@13

  so slots 0-2 are `(u << 3j) & 0x81C0` away from a bfloat16 whose bits are the code's: that bfloat16
  equals e2m1 * 2^-126 (code 1, i.e. 0.5, is a subnormal). No layout lets the fourth slot decode with
  one shift and one mask too (`python benchmarks/sass_count.py --layouts`); slot 3 sits in the four
  bits left so that one multiply moves all its bits at once: `((u & 0x6C00) >> 7) * 2081` adds the
  masked bits shifted by 0, 5 and 11 (2081 = 1 + 2^5 + 2^11; the twelve copies of the four bits of
  both units of a 32-bit pair never overlap, so there are no carries), which puts E0 and m at 7 and 6,
  E1 at 8 and s at 15, and `& 0x81C0` keeps those. Two units decode together (one 32-bit register
  holds a pair, one op serves both): 9 integer ops (one of them an integer multiply, on the FMA pipe)
  and 4 bf16x2 multiplies per 8 values (slot 3 at s@14 E1@11 E0@10 m@13 takes three shifts, three
  masks and two ORs instead: 11 ops after ptxas, measured 2026-12-01).
- Block scales stay e4m3, [N, Kp/16], read as int16 pairs: pair g holds group g's two blocks' scales,
  block t of its tile in the low byte (slots 0 and 1), block t + 4 in the high byte (slots 2 and 3)
  (`k32.pair_scales`).
- Why those blocks (rather than the 32 consecutive elements 32g + 8j + u per group g and blocks 2g,
  2g + 1 per pair g): the CUDA decode kernel's lane (g, t) reads group t and needs x at each slot's
  elements. With consecutive groups the four lanes of a quad read a token's x in four pieces 64 bytes
  apart, two 128-byte lines per token and load; with blocks t and t + 4 one slot's pieces lie 32 bytes
  apart in one line, as on the r16c64 layout (at M = 8 the kernel takes 0.78-0.86x the time of the
  consecutive grouping, docs/benchmarks.md).
  The Triton kernels only gather x at other columns (`fp4_tile_loop`'s xc and slot offsets 0, 8, 64, 72).
- Storage order (units and scales alike): rows are padded to a multiple of 64 and each tile of 64 rows
  x 128 elements (32 units, 4 scale pairs per row) is contiguous, row-major inside, tiles in (row block,
  K block) order (`k32.tile_k32`). A 64-row program's K step of 256 elements is then one 8 KB run of
  units and one 1 KB run of scales, where row-major rows lie 2-7 KB apart (docs/benchmarks.md: the
  decode GEMMs 2-6% faster on the H200). `tile_row_bases` and the K loop's offsets address it.
- Codes of blocks whose scale is zero are zeroed by the repack (their values are zero either way), so
  the scale conversion below may map a zero scale to any finite number. Scales are non-negative: the
  repack moves a negative scale's sign into its block's codes (and refuses NaN scales).

A scale pair converts to two bfloat16 multipliers in three instructions: `cvt.rn.f16x2.e4m3x2` (exact:
every e4m3 value, subnormals included, is a normal float16 with bits 6..0 zero), a right shift by 3
of the 32-bit pair (the float16 exponent lands in the low five bits of the bfloat16 exponent, the
mantissa under it; the high half's low bits, zero, shift into the low half's top) and an OR of 0x7000
per half (adds 224 to the exponent: bit 12, where the float16 sign lands, is zero for the non-negative
scales the repack leaves), which gives bf16(scale * 2^112) exactly. Multiplying the code pattern
(e2m1 * 2^-126) by it gives bf16 e2m1 * scale * 2^-14 exactly (at most 6 significant bits; the
smallest nonzero product, 0.5 * 2^-9 * 2^-14, is a normal bfloat16). The accumulator (fp32) is
multiplied by weight_scale_2 * 2^14 at the end. (One `mad.hi.u32 h, h, 2^29, 0x70007000` would do the
shift and the add in one instruction, 16 fewer per 128 weights in the 8-row loop; ptxas makes it an
LEA.HI on the same integer pipe, and on the H200 it was no faster: docs/benchmarks.md.)

The K loop either runs four dots of BLOCK_K/4 each, one per slot, against the matching columns of x
(TWO_ACC: slots 0/2 into one accumulator and 1/3 into another, two independent chains of mma.sync, as
the 8-row decode tiles run them with the weights as the A operand of m16n8k16), or (ONE_DOT)
interleaves the four decoded slots back into element order (a relabeling of registers: every thread
already holds the same units of every slot) and runs one dot of K = BLOCK_K against x in element
order. Triton keeps several wgmma groups of the one dot in flight while the next k16 step is
decoded; the four-dot loop waits for each slot's wgmmas. With PERM_K (four dots only) each slot's K
axis is reordered (`quad_k`; x gathered to match) so that every thread of an MMA quad holds whole
groups and converts only those groups' scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Scale bias folded into the decoded weights (see the module docstring), undone in the epilogue.
OUT_BIAS = tl.constexpr(16384.0)  # 2^14

_DECODE_ASM = tl.constexpr("""{
    .reg .b32 t0, t1, t2, t3;
    and.b32 t0, $4, 0x81C081C0;
    mul.rn.bf16x2 $0, t0, $5;
    shl.b32 t1, $4, 3;
    and.b32 t1, t1, 0x81C081C0;
    mul.rn.bf16x2 $1, t1, $5;
    shl.b32 t2, $4, 6;
    and.b32 t2, t2, 0x81C081C0;
    mul.rn.bf16x2 $2, t2, $6;
    and.b32 t3, $4, 0x6C006C00;
    shr.b32 t3, t3, 7;
    mul.lo.u32 t3, t3, 2081;
    and.b32 t3, t3, 0x81C081C0;
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
        em3 = (((u >> 10) & 1) << 2) | (((u >> 14) & 1) << 1) | ((u >> 13) & 1)
        v3 = _e2m1_arith((u >> 11) & 1, em3, s_b).to(tl.bfloat16)
    return v0, v1, v2, v3


@triton.jit
def decode_tile(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """A K tile's four decoded slots [BN, BLOCK_K // 4] each (`decode_k32`) from its units w and its
    scale pairs s [BN, BLOCK_K // 32]: slots 0/1 take scale 2g of their group g, slots 2/3 scale 2g + 1."""
    BG: tl.constexpr = BLOCK_K // 32
    BQ: tl.constexpr = BLOCK_K // 4
    s_a, s_b = scales_k32(s, USE_ASM)  # [BN, BG]: slots 0/1 and 2/3 of each group
    s_a = tl.broadcast_to(s_a[:, :, None], (BLOCK_N, BG, 8)).reshape(BLOCK_N, BQ)
    s_b = tl.broadcast_to(s_b[:, :, None], (BLOCK_N, BG, 8)).reshape(BLOCK_N, BQ)
    return decode_k32(w, s_a, s_b, USE_ASM)


TILE_UNITS = tl.constexpr(32)  # units per row of a storage tile (128 elements)
TILE_PAIRS = tl.constexpr(4)  # scale pairs per row of a storage tile


@triton.jit
def tile_row_bases(n, Kp):
    """Offsets of row n's first unit (16-bit units) and first scale pair (int16) in the tiled storage
    of a [Np, Kp] weight (n int64): the tiles of the row blocks before it, then its row in the first
    tile. The K step at element k (a multiple of 128) adds k * 16 units and k * 2 pairs
    (`fp4_tile_loop`)."""
    row = (n // 64) * (Kp // 128) * 64 + n % 64  # in tile rows
    return row * TILE_UNITS, row * TILE_PAIRS


@triton.jit
def tile_step_offsets(BQ: tl.constexpr, BG: tl.constexpr):
    """Offsets, from a row's `tile_row_bases`, of the BQ units and BG scale pairs of a K step that
    starts at element 0 (a step at element k adds k * 16 units and k * 2 pairs): unit c sits in the
    step's storage tile c // 32 (each tile 64 rows of 32 units), scale pair t in tile t // 4."""
    c = tl.arange(0, BQ)
    t = tl.arange(0, BG)
    cw = (c // TILE_UNITS) * (64 * TILE_UNITS) + c % TILE_UNITS
    ts = (t // TILE_PAIRS) * (64 * TILE_PAIRS) + t % TILE_PAIRS
    return cw, ts


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
                 W_AS_A: tl.constexpr, USE_ASM: tl.constexpr, ONE_DOT: tl.constexpr,
                 PERM_K: tl.constexpr = False):
    """acc += the tile's four slot products. ONE_DOT: x0 is the tile's x in element order [BM, BK]
    (x1..x3 unused) and the decoded slots, interleaved back into element order, go to one dot of
    K = BLOCK_K; else four dots of BLOCK_K / 4."""
    BG: tl.constexpr = BLOCK_K // 32
    v0, v1, v2, v3 = decode_tile(w, s, BLOCK_N, BLOCK_K, USE_ASM)
    if ONE_DOT:
        # [BN, BQ, 2 (slot bit 0), 2 (slot bit 1)] -> [BN, tile, group, unit, j & 1, j >> 1]
        # -> [BN, tile, j >> 1, group, j & 1, unit] (element order, `k32.element_of`) -> [BN, BK].
        v = tl.join(tl.join(v0, v1), tl.join(v2, v3)).reshape(BLOCK_N, BG // 4, 4, 8, 2, 2)
        v = v.permute(0, 1, 5, 2, 4, 3).reshape(BLOCK_N, BLOCK_K)
        acc = _mma(acc, v, x0, W_AS_A)
    else:
        if PERM_K:
            v0, v1, v2, v3 = _quad_k_slots(v0, v1, v2, v3, BLOCK_N, BLOCK_K // 4)
        acc = _mma(acc, v0, x0, W_AS_A)
        acc = _mma(acc, v1, x1, W_AS_A)
        acc = _mma(acc, v2, x2, W_AS_A)
        acc = _mma(acc, v3, x3, W_AS_A)
    return acc


@triton.jit
def quad_k(v, R: tl.constexpr, BQ: tl.constexpr):
    """Reorder the K axis of a [R, BQ] slot tensor (BQ a multiple of 64) from unit order to the order
    in which each thread of a 16x16 MMA operand quad holds whole groups: dot position
    (a, b, e, t, h) [BQ // 64, 4, 2, 4, 2] takes unit (t, a, e, b, h). A thread t holds K positions
    16b + 8e + 2t + h (the A fragment of m16n8k16 and of wgmma, and the B fragment), i.e. units
    8 g + 2b + h of its 2 * BQ / 64 groups g = t * BQ / 32 + 2a + e: it converts those groups' scales
    only, where in unit order every thread of the quad needs every group's."""
    A: tl.constexpr = BQ // 64
    return v.reshape(R, 4, A, 2, 4, 2).permute(0, 2, 4, 3, 1, 5).reshape(R, BQ)


@triton.jit
def _quad_k_slots(v0, v1, v2, v3, R: tl.constexpr, BQ: tl.constexpr):
    return quad_k(v0, R, BQ), quad_k(v1, R, BQ), quad_k(v2, R, BQ), quad_k(v3, R, BQ)


@triton.jit
def _dequant_mma_two(acc, acc_b, w, s, x0, x1, x2, x3, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     W_AS_A: tl.constexpr, USE_ASM: tl.constexpr, PERM_K: tl.constexpr = False):
    """The four-dot tile product with slots 0 and 2 into acc and slots 1 and 3 into acc_b: two
    independent accumulator chains (mma.sync dots wait on their accumulator)."""
    v0, v1, v2, v3 = decode_tile(w, s, BLOCK_N, BLOCK_K, USE_ASM)
    if PERM_K:
        v0, v1, v2, v3 = _quad_k_slots(v0, v1, v2, v3, BLOCK_N, BLOCK_K // 4)
    acc = _mma(acc, v0, x0, W_AS_A)
    acc_b = _mma(acc_b, v1, x1, W_AS_A)
    acc = _mma(acc, v2, x2, W_AS_A)
    acc_b = _mma(acc_b, v3, x3, W_AS_A)
    return acc, acc_b


@triton.jit
def fp4_tile_loop(
    acc, acc2, x_ptr, x_rows, x_mask, w_ptr, w_rows, w_rows2, s_ptr, s_rows, s_rows2,
    k_lo, num_iters, K, Kp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, W_AS_A: tl.constexpr, USE_ASM: tl.constexpr, DUAL: tl.constexpr,
    ONE_DOT: tl.constexpr = False, TWO_ACC: tl.constexpr = False, PERM_K: tl.constexpr = False,
):  # EVEN_K: K == Kp, x needs no column mask; TWO_ACC (four dots, not DUAL): acc2 is a second chain
    """acc += x[rows, k_lo : k_lo + num_iters*BLOCK_K] @ dequant(W[w_rows, same]).T, without the
    global scale; with DUAL also acc2 for the weight rows w_rows2 (x is loaded once for both).

    x_rows [BM]: int64 offsets of x's rows (elements); w_rows / s_rows [BN]: the weight rows' bases in
    the tiled storage (`tile_row_bases`: 16-bit units, int16 scale pairs; BLOCK_K a multiple of 128,
    so a K step covers whole storage tiles); x_mask [BM]: rows to read (others load zeros). acc/acc2
    are [BN, BM] when W_AS_A, else [BM, BN]. Weights, scales and x go through Triton's cp.async
    pipeline (num_stages)."""
    BQ: tl.constexpr = BLOCK_K // 4
    c = tl.arange(0, BQ)  # k32 unit within the tile: group c // 8, unit c % 8
    if PERM_K:  # x loaded in quad_k's order (its columns gathered; k32.quad_k_units), the weights reordered
        cu = (((c // 2) % 4 * (BQ // 64) + c // 64) * 2 + (c // 8) % 2) * 8 + (c // 16) % 4 * 2 + c % 2
    else:
        cu = c
    xc = (cu // 32) * 128 + (cu // 8) % 4 * 16 + cu % 8  # element of slot 0 of unit cu; slot j: + XJ
    if PERM_K:
        xc = tl.max_contiguous(tl.multiple_of(xc, 2), 2)
    cw, ts = tile_step_offsets(BQ, BLOCK_K // 32)  # the tiled storage; a step moves BQ // 32 tiles on
    W_STEP: tl.constexpr = BQ * 64
    S_STEP: tl.constexpr = (BLOCK_K // 32) * 64
    w_ptrs = w_ptr + w_rows[:, None] + ((k_lo // 4) * 64 + cw)[None, :]
    s_ptrs = s_ptr + s_rows[:, None] + ((k_lo // 32) * 64 + ts)[None, :]
    if DUAL:
        w_ptrs2 = w_ptr + w_rows2[:, None] + ((k_lo // 4) * 64 + cw)[None, :]
        s_ptrs2 = s_ptr + s_rows2[:, None] + ((k_lo // 32) * 64 + ts)[None, :]
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
            x2 = tl.load(x_ptrs + 64, mask=xm, other=0.0)
            x3 = tl.load(x_ptrs + 72, mask=xm, other=0.0)
        else:
            xk = k0 + xc
            x0 = tl.load(x_ptrs, mask=xm & (xk < K)[None, :], other=0.0)
            x1 = tl.load(x_ptrs + 8, mask=xm & (xk + 8 < K)[None, :], other=0.0)
            x2 = tl.load(x_ptrs + 64, mask=xm & (xk + 64 < K)[None, :], other=0.0)
            x3 = tl.load(x_ptrs + 72, mask=xm & (xk + 72 < K)[None, :], other=0.0)
        x0 = x0.to(tl.bfloat16)
        x1 = x1.to(tl.bfloat16)
        x2 = x2.to(tl.bfloat16)
        x3 = x3.to(tl.bfloat16)
        if TWO_ACC:
            acc, acc2 = _dequant_mma_two(acc, acc2, w, s0, x0, x1, x2, x3, BLOCK_N, BLOCK_K, W_AS_A,
                                         USE_ASM, PERM_K)
        else:
            acc = _dequant_mma(acc, w, s0, x0, x1, x2, x3, BLOCK_N, BLOCK_K, W_AS_A, USE_ASM, ONE_DOT, PERM_K)
        if DUAL:
            w2 = tl.load(w_ptrs2)
            r0 = tl.load(s_ptrs2)
            acc2 = _dequant_mma(acc2, w2, r0, x0, x1, x2, x3, BLOCK_N, BLOCK_K, W_AS_A, USE_ASM,
                                 ONE_DOT, PERM_K)
            w_ptrs2 += W_STEP
            s_ptrs2 += S_STEP
        w_ptrs += W_STEP
        s_ptrs += S_STEP
        x_ptrs += BLOCK_K
        xs_ptrs += BLOCK_K
    return acc, acc2
