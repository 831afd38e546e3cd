"""Experiment (twelfth session, 2026-12-01): the 8-row decode GEMM (M <= 8) written in Gluon with explicit
layouts, so that the weights go from global memory straight into the registers of the mma.sync A
operand (no shared memory, no barrier, prefetched by hand), against the shipped Triton kernel. Not
used by the library; results and conclusions in docs/benchmarks.md ("Twelfth session").

Weight layout: the k32 units (triton_k32.py) in their group order before the twenty-third session (group g
= elements 32g .. 32g + 31; `run` repacks a column-permuted weight, `v1_order`, to get it from today's
repack) with each 64-unit block (BLOCK_K = 256) permuted so that
the units a thread holds in the m16n8k16 A fragment are contiguous (two 16-byte loads per row):
  - `permute_units` (probe_kernel, probe32_kernel, probe3_kernel): old unit c = 16b + 8e + 2t + h at
    p = 16t + 4b + 2e + h (t: the thread in its MMA quad, b: the k16 step, e / h: fragment halves).
  - `permute_units_v2` (probe4_kernel): the MMA's K index c = 16b + 8e + 2t + h takes unit
    4 (t & 1) + 2e + h of group 4 (t >> 1) + b, so x comes in 8-byte loads (4 consecutive columns)
    and a thread converts 4 scale pairs per row instead of 8.
No split-K (one program per 64 weight rows), so only shapes with enough rows (gate_up) compare.

    python benchmarks/gluon_probe.py sass [KERNEL]   # offline sm_90 compile: loop SASS instructions, registers
                                                     # KERNEL: 16 (probe_kernel, DEPTH=2), 32 (probe32,
                                                     # DEPTH=2), 3 (probe3), 4 (probe4; default)
    python benchmarks/gluon_probe.py run [--all]     # GPU: same bits as the shipped kernel, then times
                                                     # (--all: also the int16 and the depth-3 variants)
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pieceworks.backends.fp4_gemm import triton_k32  # noqa: E402

# the k32 decode (triton_k32.py): the same PTX serves a pair of int16 units (pack=2) and an int32 word
_DECODE_ASM = gl.constexpr(triton_k32._DECODE_ASM.value)
_SCALE_ASM = gl.constexpr(triton_k32._SCALE_ASM.value)

_SCALE32_ASM = gl.constexpr("""{
    .reg .b32 h, lo, hi;
    .reg .b16 l16, h16;
    cvt.rn.f16x2.e4m3x2 h, $2;
    shr.b32 h, h, 3;
    or.b32 h, h, 0x70007000;
    mov.b32 {l16, h16}, h;
    mov.b32 $0, {l16, l16};
    mov.b32 $1, {h16, h16};
}""")


# Layouts (64 weight rows x 4 warps, 8 x rows): the mma.sync m16n8k16 accumulator and operands; LW the
# weights' memory order p = 16t + 4b + 2e + h as int16 units, L32 the same as int32 words (q = p >> 1).
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]))
LA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
LB = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
LW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
L32 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32]))

_SPLIT_ASM = gl.constexpr("mov.b32 {$0, $1}, $2;")


@gluon.jit
def _x_ptrs(x_ptr, M, stride_x):
    # x for slot j at + 8 j: x[m, 32 (c // 8) + 8 j + c % 8], c the MMA K index (unit order v1); rows
    # past M read row M - 1 (no masks: their outputs are not stored)
    cb = gl.arange(0, 64, layout=gl.SliceLayout(1, LB))
    mb = gl.arange(0, 8, layout=gl.SliceLayout(0, LB))
    return x_ptr + gl.minimum(mb, M - 1)[None, :] * stride_x + (32 * (cb // 8) + cb % 8)[:, None]


@gluon.jit
def _ws_ptrs32(w_ptr, s_ptr, n0, stride_w, stride_s):
    # int32 weight words [64, 32] (q = p >> 1 = 8t + g) and the int16 scale pair of each word's group
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L32))
    q = gl.arange(0, 32, layout=gl.SliceLayout(0, L32))
    w_ptrs = w_ptr + (n0 + r).to(gl.int64)[:, None] * stride_w + q[None, :]
    s_ptrs = s_ptr + (n0 + r).to(gl.int64)[:, None] * stride_s + (q % 8)[None, :]
    return w_ptrs, s_ptrs


@gluon.jit
def _store(acc_a, acc_b, gs_ptr, y_ptr, n0, M, stride_y):
    acc = (acc_a + acc_b) * (gl.load(gs_ptr) * 16384.0)
    rn = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    mo = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    y_ptrs = y_ptr + mo[None, :] * stride_y + (n0 + rn)[:, None]
    gl.store(y_ptrs, acc.to(gl.bfloat16), mask=(mo < M)[None, :])


@gluon.jit
def _halves(v, LW: gl.constexpr):
    # int32 [64, 32] of bf16 pairs -> bf16 [64, 64] in memory order (p = 2q + h)
    lo, hi = gl.inline_asm_elementwise(asm=_SPLIT_ASM, constraints="=h,=h,r", args=[v],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [64, 64]), LW)


@gluon.jit
def _relabel(v, LA: gl.constexpr):
    # memory order p = 16t + 4b + 2e + h -> MMA order c = 16b + 8e + 2t + h (a register relabeling)
    v = gl.reshape(v, [64, 4, 4, 2, 2])
    v = gl.permute(v, (0, 2, 3, 1, 4))
    v = gl.reshape(v, [64, 64])
    return gl.convert_layout(v, LA)


@gluon.jit
def probe_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, stride_x, stride_w, stride_s, stride_y, num_iters,
                 DEPTH: gl.constexpr, XPF: gl.constexpr):
    LS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])

    n0 = gl.program_id(0) * 64
    rw = gl.arange(0, 64, layout=gl.SliceLayout(1, LW))
    pw = gl.arange(0, 64, layout=gl.SliceLayout(0, LW))
    w_ptrs = w_ptr + (n0 + rw).to(gl.int64)[:, None] * stride_w + pw[None, :]
    rs = gl.arange(0, 64, layout=gl.SliceLayout(1, LS))
    qs = gl.arange(0, 32, layout=gl.SliceLayout(0, LS))
    s_ptrs = s_ptr + (n0 + rs).to(gl.int64)[:, None] * stride_s + (qs % 8)[None, :]
    x_ptrs = _x_ptrs(x_ptr, M, stride_x)

    acc_a = gl.zeros([64, 8], gl.float32, MMA)
    acc_b = gl.zeros([64, 8], gl.float32, MMA)
    last = num_iters - 1
    # DEPTH iterations of weights and scales in flight (loads past the end re-read the last tile)
    w = gl.load(w_ptrs)
    s = gl.load(s_ptrs)
    w1 = gl.load(w_ptrs + 64 * gl.minimum(1, last))
    s1 = gl.load(s_ptrs + 8 * gl.minimum(1, last))
    if DEPTH >= 3:
        w2 = gl.load(w_ptrs + 64 * gl.minimum(2, last))
        s2 = gl.load(s_ptrs + 8 * gl.minimum(2, last))
    x0 = gl.load(x_ptrs)
    x1 = gl.load(x_ptrs + 8)
    x2 = gl.load(x_ptrs + 16)
    x3 = gl.load(x_ptrs + 24)
    for it in range(num_iters):
        ahead = gl.minimum(it + DEPTH, last)
        w_next = gl.load(w_ptrs + 64 * ahead)
        s_next = gl.load(s_ptrs + 8 * ahead)
        if XPF:
            xo = 256 * gl.minimum(it + 1, last)
            y0 = gl.load(x_ptrs + xo)
            y1 = gl.load(x_ptrs + xo + 8)
            y2 = gl.load(x_ptrs + xo + 16)
            y3 = gl.load(x_ptrs + xo + 24)
        else:
            xo = 256 * it
            x0 = gl.load(x_ptrs + xo)
            x1 = gl.load(x_ptrs + xo + 8)
            x2 = gl.load(x_ptrs + xo + 16)
            x3 = gl.load(x_ptrs + xo + 24)
        s_a, s_b = gl.inline_asm_elementwise(asm=_SCALE_ASM, constraints="=h,=h,h", args=[s],
                                             dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        s_a = gl.convert_layout(gl.reshape(gl.join(s_a, s_a), [64, 64]), LW)
        s_b = gl.convert_layout(gl.reshape(gl.join(s_b, s_b), [64, 64]), LW)
        v0, v1, v2, v3 = gl.inline_asm_elementwise(
            asm=_DECODE_ASM, constraints="=r,=r,=r,=r,r,r,r", args=[w, s_a, s_b],
            dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=2)
        acc_a = mma_v2(_relabel(v0, LA), x0, acc_a)
        acc_b = mma_v2(_relabel(v1, LA), x1, acc_b)
        acc_a = mma_v2(_relabel(v2, LA), x2, acc_a)
        acc_b = mma_v2(_relabel(v3, LA), x3, acc_b)
        if DEPTH >= 3:
            w = w1
            s = s1
            w1 = w2
            s1 = s2
            w2 = w_next
            s2 = s_next
        else:
            w = w1
            s = s1
            w1 = w_next
            s1 = s_next
        if XPF:
            x0 = y0
            x1 = y1
            x2 = y2
            x3 = y3
    _store(acc_a, acc_b, gs_ptr, y_ptr, n0, M, stride_y)


@gluon.jit
def probe32_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, stride_x, stride_w, stride_s, stride_y, num_iters,
                   DEPTH: gl.constexpr, XPF: gl.constexpr):
    """As probe_kernel, with the weights loaded and carried as int32 words (two units each)."""

    n0 = gl.program_id(0) * 64
    w_ptrs, s_ptrs = _ws_ptrs32(w_ptr, s_ptr, n0, stride_w, stride_s)
    x_ptrs = _x_ptrs(x_ptr, M, stride_x)

    acc_a = gl.zeros([64, 8], gl.float32, MMA)
    acc_b = gl.zeros([64, 8], gl.float32, MMA)
    last = num_iters - 1
    w = gl.load(w_ptrs)
    s = gl.load(s_ptrs)
    w1 = gl.load(w_ptrs + 32 * gl.minimum(1, last))
    s1 = gl.load(s_ptrs + 8 * gl.minimum(1, last))
    if DEPTH >= 3:
        w2 = gl.load(w_ptrs + 32 * gl.minimum(2, last))
        s2 = gl.load(s_ptrs + 8 * gl.minimum(2, last))
    for it in range(num_iters):
        ahead = gl.minimum(it + DEPTH, last)
        w_next = gl.load(w_ptrs + 32 * ahead)
        s_next = gl.load(s_ptrs + 8 * ahead)
        xo = 256 * it
        x0 = gl.load(x_ptrs + xo)
        x1 = gl.load(x_ptrs + xo + 8)
        x2 = gl.load(x_ptrs + xo + 16)
        x3 = gl.load(x_ptrs + xo + 24)
        s_a, s_b = gl.inline_asm_elementwise(asm=_SCALE32_ASM, constraints="=r,=r,h", args=[s],
                                             dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        v0, v1, v2, v3 = gl.inline_asm_elementwise(
            asm=_DECODE_ASM, constraints="=r,=r,=r,=r,r,r,r", args=[w, s_a, s_b],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        acc_a = mma_v2(_relabel(_halves(v0, LW), LA), x0, acc_a)
        acc_b = mma_v2(_relabel(_halves(v1, LW), LA), x1, acc_b)
        acc_a = mma_v2(_relabel(_halves(v2, LW), LA), x2, acc_a)
        acc_b = mma_v2(_relabel(_halves(v3, LW), LA), x3, acc_b)
        if DEPTH >= 3:
            w = w1
            s = s1
            w1 = w2
            s1 = s2
            w2 = w_next
            s2 = s_next
        else:
            w = w1
            s = s1
            w1 = w_next
            s1 = s_next
    _store(acc_a, acc_b, gs_ptr, y_ptr, n0, M, stride_y)


@gluon.jit
def _body(acc_a, acc_b, w, s, x_ptrs, xo, LA: gl.constexpr, LW: gl.constexpr):
    x0 = gl.load(x_ptrs + xo)
    x1 = gl.load(x_ptrs + xo + 8)
    x2 = gl.load(x_ptrs + xo + 16)
    x3 = gl.load(x_ptrs + xo + 24)
    s_a, s_b = gl.inline_asm_elementwise(asm=_SCALE32_ASM, constraints="=r,=r,h", args=[s],
                                         dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    v0, v1, v2, v3 = gl.inline_asm_elementwise(
        asm=_DECODE_ASM, constraints="=r,=r,=r,=r,r,r,r", args=[w, s_a, s_b],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    acc_a = mma_v2(_relabel(_halves(v0, LW), LA), x0, acc_a)
    acc_b = mma_v2(_relabel(_halves(v1, LW), LA), x1, acc_b)
    acc_a = mma_v2(_relabel(_halves(v2, LW), LA), x2, acc_a)
    acc_b = mma_v2(_relabel(_halves(v3, LW), LA), x3, acc_b)
    return acc_a, acc_b


@gluon.jit
def probe3_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, stride_x, stride_w, stride_s, stride_y, num_iters,
                  DEPTH: gl.constexpr, XPF: gl.constexpr):
    """probe32 with the K loop unrolled by 3 over three weight buffers (no register moves): each buffer is
    reloaded right after its tile is used, for the tile three iterations later. num_iters % 3 == 0 is not
    required: a remainder loop runs the last iterations one at a time."""

    n0 = gl.program_id(0) * 64
    w_ptrs, s_ptrs = _ws_ptrs32(w_ptr, s_ptr, n0, stride_w, stride_s)
    x_ptrs = _x_ptrs(x_ptr, M, stride_x)

    acc_a = gl.zeros([64, 8], gl.float32, MMA)
    acc_b = gl.zeros([64, 8], gl.float32, MMA)
    last = num_iters - 1
    w0 = gl.load(w_ptrs)
    s0 = gl.load(s_ptrs)
    w1 = gl.load(w_ptrs + 32 * gl.minimum(1, last))
    s1 = gl.load(s_ptrs + 8 * gl.minimum(1, last))
    w2 = gl.load(w_ptrs + 32 * gl.minimum(2, last))
    s2 = gl.load(s_ptrs + 8 * gl.minimum(2, last))
    main_iters = num_iters - num_iters % 3
    for it in range(0, main_iters, 3):
        acc_a, acc_b = _body(acc_a, acc_b, w0, s0, x_ptrs, 256 * it, LA, LW)
        a3 = gl.minimum(it + 3, last)
        w0 = gl.load(w_ptrs + 32 * a3)
        s0 = gl.load(s_ptrs + 8 * a3)
        acc_a, acc_b = _body(acc_a, acc_b, w1, s1, x_ptrs, 256 * (it + 1), LA, LW)
        a4 = gl.minimum(it + 4, last)
        w1 = gl.load(w_ptrs + 32 * a4)
        s1 = gl.load(s_ptrs + 8 * a4)
        acc_a, acc_b = _body(acc_a, acc_b, w2, s2, x_ptrs, 256 * (it + 2), LA, LW)
        a5 = gl.minimum(it + 5, last)
        w2 = gl.load(w_ptrs + 32 * a5)
        s2 = gl.load(s_ptrs + 8 * a5)
    if main_iters < num_iters:
        acc_a, acc_b = _body(acc_a, acc_b, w0, s0, x_ptrs, 256 * main_iters, LA, LW)
    if main_iters + 1 < num_iters:
        acc_a, acc_b = _body(acc_a, acc_b, w1, s1, x_ptrs, 256 * (main_iters + 1), LA, LW)
    _store(acc_a, acc_b, gs_ptr, y_ptr, n0, M, stride_y)


@gluon.jit
def _xrelabel(v, LB: gl.constexpr):
    # x tile [m, g, u] (g = 4 t1 + b, u = 4 t0 + 2 e + h) -> the B operand [c, m], c = 16 b + 8 e + 2 t + h
    v = gl.reshape(v, [8, 2, 2, 2, 2, 2, 2])
    v = gl.permute(v, (2, 3, 5, 1, 4, 6, 0))
    v = gl.reshape(v, [64, 8])
    return gl.convert_layout(v, LB)


@gluon.jit
def _body4(acc_a, acc_b, w, s, x_ptrs, xo, LA: gl.constexpr, LB: gl.constexpr, LW: gl.constexpr,
           L32: gl.constexpr):
    x0 = _xrelabel(gl.load(x_ptrs + xo), LB)
    x1 = _xrelabel(gl.load(x_ptrs + xo + 8), LB)
    x2 = _xrelabel(gl.load(x_ptrs + xo + 16), LB)
    x3 = _xrelabel(gl.load(x_ptrs + xo + 24), LB)
    s_a, s_b = gl.inline_asm_elementwise(asm=_SCALE32_ASM, constraints="=r,=r,h", args=[s],
                                         dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    s_a = gl.convert_layout(gl.reshape(gl.join(s_a, s_a), [64, 32]), L32)
    s_b = gl.convert_layout(gl.reshape(gl.join(s_b, s_b), [64, 32]), L32)
    v0, v1, v2, v3 = gl.inline_asm_elementwise(
        asm=_DECODE_ASM, constraints="=r,=r,=r,=r,r,r,r", args=[w, s_a, s_b],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    acc_a = mma_v2(_relabel(_halves(v0, LW), LA), x0, acc_a)
    acc_b = mma_v2(_relabel(_halves(v1, LW), LA), x1, acc_b)
    acc_a = mma_v2(_relabel(_halves(v2, LW), LA), x2, acc_a)
    acc_b = mma_v2(_relabel(_halves(v3, LW), LA), x3, acc_b)
    return acc_a, acc_b


@gluon.jit
def probe4_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, stride_x, stride_w, stride_s, stride_y, num_iters,
                  DEPTH: gl.constexpr, XPF: gl.constexpr):
    """Unit order v2 (permute_units_v2): thread t of a quad holds units 4 (t & 1) .. + 3 of groups
    4 (t >> 1) + b, so x comes in 8-byte loads and each thread converts 4 scales per row, not 8. The
    K loop unrolled by 2 over two weight buffers, each reloaded right after its tile is used."""
    LS: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])
    LX: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0]],
        lane_bases=[[0, 0, 4], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[8, 8, 8])

    n0 = gl.program_id(0) * 64
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L32))
    q = gl.arange(0, 32, layout=gl.SliceLayout(0, L32))
    w_ptrs = w_ptr + (n0 + r).to(gl.int64)[:, None] * stride_w + q[None, :]
    rs = gl.arange(0, 64, layout=gl.SliceLayout(1, LS))
    qs = gl.arange(0, 16, layout=gl.SliceLayout(0, LS))  # q' = 4 t + b: group 4 (t >> 1) + b
    s_ptrs = s_ptr + (n0 + rs).to(gl.int64)[:, None] * stride_s + (4 * (qs // 8) + qs % 4)[None, :]
    xm = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
    xg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
    xu = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))
    x_ptrs = (x_ptr + gl.minimum(xm, M - 1)[:, None, None] * stride_x + (32 * xg)[None, :, None]
              + xu[None, None, :])

    acc_a = gl.zeros([64, 8], gl.float32, MMA)
    acc_b = gl.zeros([64, 8], gl.float32, MMA)
    last = num_iters - 1
    w0 = gl.load(w_ptrs)
    s0 = gl.load(s_ptrs)
    w1 = gl.load(w_ptrs + 32 * gl.minimum(1, last))
    s1 = gl.load(s_ptrs + 8 * gl.minimum(1, last))
    main_iters = num_iters - num_iters % 2
    for it in range(0, main_iters, 2):
        acc_a, acc_b = _body4(acc_a, acc_b, w0, s0, x_ptrs, 256 * it, LA, LB, LW, L32)
        a2 = gl.minimum(it + 2, last)
        w0 = gl.load(w_ptrs + 32 * a2)
        s0 = gl.load(s_ptrs + 8 * a2)
        acc_a, acc_b = _body4(acc_a, acc_b, w1, s1, x_ptrs, 256 * (it + 1), LA, LB, LW, L32)
        a3 = gl.minimum(it + 3, last)
        w1 = gl.load(w_ptrs + 32 * a3)
        s1 = gl.load(s_ptrs + 8 * a3)
    if main_iters < num_iters:
        acc_a, acc_b = _body4(acc_a, acc_b, w0, s0, x_ptrs, 256 * main_iters, LA, LB, LW, L32)
    _store(acc_a, acc_b, gs_ptr, y_ptr, n0, M, stride_y)


def permute_units_v2(w_units: torch.Tensor) -> torch.Tensor:
    """k32 units [N, Kp/4] int16 -> probe4's order: old unit 32 t1 + 8 b + 4 t0 + 2 e + h of each 64-unit
    block (group 4 t1 + b, unit 4 t0 + 2 e + h) at 32 t1 + 16 t0 + 4 b + 2 e + h."""
    n, q = w_units.shape
    v = w_units.reshape(n, q // 64, 2, 4, 2, 2, 2)  # t1, b, t0, e, h
    return v.permute(0, 1, 2, 4, 3, 5, 6).reshape(n, q).contiguous()  # t1, t0, b, e, h


SIGNATURE = dict(x_ptr="*bf16", w_ptr="*i16", s_ptr="*i16", gs_ptr="*fp32", y_ptr="*bf16", M="i32",
                 stride_x="i32", stride_w="i32", stride_s="i32", stride_y="i32", num_iters="i32",
                 DEPTH="constexpr", XPF="constexpr")
DIVISIBLE = ("x_ptr", "w_ptr", "s_ptr", "gs_ptr", "y_ptr", "stride_x", "stride_w", "stride_s", "stride_y")


def compile_offline(which: str):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(SIGNATURE)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    fn = {"16": probe_kernel, "32": probe32_kernel, "3": probe3_kernel, "4": probe4_kernel}[which]
    sig = SIGNATURE if which == "16" else dict(SIGNATURE, w_ptr="*i32")
    src = GluonASTSource(fn, sig, dict(DEPTH=2, XPF=False), attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def permute_units(w_units: torch.Tensor) -> torch.Tensor:
    """k32 units [N, Kp/4] int16 -> the probe's order within each 64-unit block."""
    n, q = w_units.shape
    v = w_units.reshape(n, q // 64, 4, 2, 4, 2)  # b, e, t, h
    return v.permute(0, 1, 4, 2, 3, 5).reshape(n, q).contiguous()  # t, b, e, h


def probe_gemm(x, w_units_perm, s_pairs, gs, n, depth=2, xpf=False, words=0):
    """y [M, N] bf16 for M <= 8. words: 0 probe_kernel (int16 units), 1 probe32_kernel, 3 probe3_kernel,
    4 probe4_kernel (permute_units_v2 order); depth: tiles in flight (probe_kernel, probe32_kernel)."""
    m, k = x.shape
    kp = w_units_perm.shape[1] * 4
    assert m <= 8 and n % 64 == 0 and kp % 256 == 0
    y = torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    if words:
        kern = {1: probe32_kernel, 3: probe3_kernel, 4: probe4_kernel}[words]
        kern[(n // 64,)](x, w_units_perm.view(torch.int32), s_pairs, gs, y, m, x.stride(0),
                         w_units_perm.stride(0) // 2, s_pairs.stride(0), y.stride(0), kp // 256,
                         DEPTH=depth, XPF=False, num_warps=4)
        return y
    probe_kernel[(n // 64,)](x, w_units_perm, s_pairs, gs, y, m, x.stride(0), w_units_perm.stride(0),
                             s_pairs.stride(0), y.stride(0), kp // 256, DEPTH=depth, XPF=xpf, num_warps=4)
    return y


def v1_order(packed: torch.Tensor, scale: torch.Tensor):
    """(packed [N, K/2], scales [N, K/16], K a multiple of 128) -> the column-permuted weight whose `repack_k32`
    (group t of a tile: blocks t and t + 4, `k32.element_of`) holds the original's elements in the order the
    probes decode (group t: elements 32t .. 32t + 31, slot j of unit u = 32t + 8j + u; pair t: blocks 2t, 2t + 1)."""
    from pieceworks.backends.fp4_gemm.k32 import element_of
    from pieceworks.quant import nvfp4

    n, k = packed.shape[0], packed.shape[1] * 2
    src = torch.empty(128, dtype=torch.long)  # new position p takes old element src[p] of each 128
    for t in range(4):
        for j in range(4):
            for u in range(8):
                src[element_of(t, j, u)] = 32 * t + 8 * j + u
    codes = nvfp4.unpack(packed).view(n, k // 128, 128)[:, :, src.to(packed.device)].reshape(n, k)
    blocks = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7], device=packed.device)  # new block b takes old block blocks[b]
    s = scale.view(torch.uint8).view(n, k // 128, 8)[:, :, blocks].reshape(n, k // 16).view(scale.dtype)
    return nvfp4.pack(codes), s


def run(all_variants: bool):
    import fp4_gemm as fb

    from pieceworks.backends.base import BackendSpec
    from pieceworks.backends.fp4_gemm.k32 import repack_k32, untile_k32
    from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend
    from pieceworks.quant import nvfp4

    gen = torch.Generator("cuda").manual_seed(0)
    backend = TritonFp4GemmBackend(BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
    for n, k in ((1024, 4096), (28672, 4096), (4096, 14336)):
        wf = torch.randn(n, k, device="cuda", generator=gen)
        packed, scale, gs = nvfp4.quantize_weight(wf)
        gs = gs.float().reshape(())
        wk, sk = repack_k32(packed, scale)  # tiled storage (the shipped kernel's); the probes read row-major
        # the probes were written for the k32 group order before the twenty-third session (group g = elements
        # 32g .. 32g + 31, pair g = blocks 2g, 2g + 1): repack a column-permuted copy so that its units hold
        # this weight in that order
        wo, so = repack_k32(*v1_order(packed, scale))
        units = permute_units(untile_k32(wo).view(torch.int16))
        units2 = permute_units_v2(untile_k32(wo).view(torch.int16))
        sk_rows = untile_k32(so)
        for m in (1, 3, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = backend.forward(x, wk, sk, gs, gs, n).float()
            for words in (1, 4):
                y = probe_gemm(x, units2 if words == 4 else units, sk_rows.view(torch.int16), gs, n, words=words).float()
                print(f"check words={words} n={n} k={k} m={m}: rel err vs shipped "
                      f"{float((y - ref).norm() / ref.norm()):.2e}", flush=True)
    for name in ("llama.gate_up", "llama.down", "dsv3.expert.gate_up"):
        n, k = fb.SHAPES[name]
        ws = fb.weights_for(n, k, gen)
        wsp = [(permute_units(w.view(torch.int16)), s.view(torch.int16), g) for w, s, g in ws]
        wsp2 = [(permute_units_v2(w.view(torch.int16)), s.view(torch.int16), g) for w, s, g in ws]
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            for rep in range(2):
                t = fb.graph_time(lambda i: backend.forward(x, *ws[i % len(ws)], ws[0][2], n), len(ws))
                row = [f"shipped {t * 1e6:.1f}"]
                variants = [("int32 d2", dict(words=1, depth=2)), ("v2 unroll2", dict(words=4))]
                if all_variants:
                    variants[:0] = [("int16 d2", dict(words=0, depth=2)), ("int32 d3", dict(words=1, depth=3)),
                                    ("unroll3", dict(words=3))]
                for label, kw in variants:
                    wl = wsp2 if kw["words"] == 4 else wsp
                    t = fb.graph_time(lambda i: probe_gemm(x, *wl[i % len(wl)], n, **kw), len(wl))
                    row.append(f"{label} {t * 1e6:.1f}")
                print(f"{name} M={m} us: " + ", ".join(row), flush=True)


def sass_report(which: str) -> None:
    import collections

    import sass_count

    kernel = compile_offline(which)
    loop = sass_count.hottest_loop(kernel.asm["sass"])
    ops = collections.Counter((i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0] for i in loop)
    print(f"loop {len(loop)} SASS instructions (an iteration is 128 weights per thread; probe3 runs 3 and probe4 2 "
          f"per loop), registers {sass_count.registers(kernel)}")
    print(ops.most_common(16))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("sass", "run"):
        sys.exit(__doc__)
    if sys.argv[1] == "sass":
        sass_report(sys.argv[2] if len(sys.argv) > 2 else "4")
    elif not torch.cuda.is_available():
        sys.exit("gluon_probe.py run needs a CUDA GPU (sm_80 or newer); `sass` compiles without one")
    else:
        run("--all" in sys.argv)
