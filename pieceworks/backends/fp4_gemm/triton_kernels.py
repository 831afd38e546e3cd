"""Triton kernels for weight-only NVFP4 GEMM (w4a16): y = x @ dequant(W).T, dequantized in registers.

Imported only by the Triton backends' methods (it imports triton at the top). The weights are in the
"k32" layout; its decode and the K loop are in triton_k32.py. Here: the GEMM kernel with its split-K
reduction (in the kernel by the last split to arrive, or by a second kernel) and optional SwiGLU or rope
epilogue (triton_epilogue.py), the dequantize kernel of the large-M path, and `fp4_gemm`, which launches
them (and the wgmma kernel of cuda_wgmma.py for its buckets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.backends import pdl, pdl_kernels
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
from pieceworks.backends.fp4_gemm.k32 import TILE_ROWS
from pieceworks.backends.fp4_gemm.triton_epilogue import (
    ROPE_EPILOGUE_BLOCK_M,
    publish_and_count,
    rope_cs,
    rope_pair,
    store_out,
    swiglu_values,
)
from pieceworks.backends.fp4_gemm.triton_k32 import (
    OUT_BIAS,
    decode_tile,
    fp4_tile_loop,
    tile_row_bases,
    tile_step_offsets,
)

@triton.jit(do_not_specialize=["M", "iters", "num_splits"])
def _fp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, Kp, stride_xm, stride_om, iters, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr, EVEN_K: tl.constexpr, W_AS_A: tl.constexpr,
    USE_ASM: tl.constexpr, ONE_DOT: tl.constexpr, PDL: tl.constexpr = False, SWIGLU: tl.constexpr = False,
    TWO_ACC: tl.constexpr = False, PERM_K: tl.constexpr = False, ROPE: tl.constexpr = False, cos_ptr=None,
    sin_ptr=None, stride_cos=0, stride_sin=0, rope_cols=0, ROPE_HALF: tl.constexpr = 1,
):
    """One output tile, or (SPLIT) one of `num_splits` K ranges of it; ranges differ by at most one
    BLOCK_K iteration. A split writes its float32 partial to part[pid_k] (laid out [splits, M, N]);
    with FUSED_REDUCE, the split that arrives last at the tile's counter (count_ptr[tile], zero
    before the call and reset by that split) sums the partials in split order and writes out, so
    the result does not depend on which split finishes last; otherwise `_splitk_reduce_kernel` does.
    With PDL (pdl.py) a program waits for the kernel before it first and lets the next one start
    once its K loop is done, so that kernel's launch overlaps this one's epilogue. With SWIGLU the
    weight is a gate/up pair interleaved by rows and out [M, N/2] gets silu(gate) * up (`store_out`);
    partials stay [splits, M, N]. With ROPE (a q/k/v weight in the `interleave_rope_rows` order) out
    gets the columns in checkpoint order, the first rope_cols roped with cos/sin [M, ROPE_HALF]."""
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
    w_rows, s_rows = tile_row_bases(n_c, Kp)
    pdl_kernels.wait(PDL)
    if ROPE:  # loaded before the K loop (a few registers at 8 rows): the epilogue does not wait
        rope_c, rope_s = rope_cs(cos_ptr, sin_ptr, stride_cos, stride_sin, rm, rm < M,
                                 pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2), rope_cols, ROPE_HALF)
    else:
        rope_c = None
        rope_s = None
    acc, acc_b = fp4_tile_loop(
        acc, acc, x_ptr, x_rows, rm < M, w_ptr, w_rows, w_rows, s_ptr, s_rows, s_rows,
        k_lo, num_iters, K, Kp,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, W_AS_A, USE_ASM, False, ONE_DOT, TWO_ACC, PERM_K,
    )
    pdl_kernels.launch_dependents(PDL)
    if TWO_ACC:
        acc = acc + acc_b
    if W_AS_A:
        acc = tl.trans(acc)
    acc = acc * (tl.load(gs_ptr) * OUT_BIAS)
    if not SPLIT:
        store_out(out_ptr, acc, rm, pid_n * BLOCK_N, M, N, stride_om, BLOCK_M, BLOCK_N, SWIGLU, ROPE, rope_c,
                  rope_s, rope_cols, ROPE_HALF)
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
                store_out(out_ptr, total, rm, pid_n * BLOCK_N, M, N, stride_om, BLOCK_M, BLOCK_N, SWIGLU,
                          ROPE, rope_c, rope_s, rope_cols, ROPE_HALF)
                tl.store(count_ptr + pid, 0)


@triton.jit
def _splitk_reduce_kernel(part_ptr, out_ptr, numel, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False, SWIGLU: tl.constexpr = False, ROPE: tl.constexpr = False,
                          cos_ptr=None, sin_ptr=None, stride_cos=0, stride_sin=0, rope_cols=0,
                          ROPE_HALF: tl.constexpr = 1):
    """out = the partials [SPLIT_K, M, N] (numel = M * N) summed in split order; with SWIGLU,
    out [M, N/2] = silu(gate) * up of each interleaved column pair (see `store_out`); with ROPE, out
    [M, N] in checkpoint column order with the rope pairs rotated (`rope_pair`)."""
    pdl_kernels.enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if ROPE:  # grid (rows, column-pair blocks): BLOCK pairs of one row per program
        row = tl.program_id(0)
        p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        pmask = 2 * p < N
        src = row.to(tl.int64) * N + 2 * p
        y1 = tl.load(part_ptr + src, mask=pmask, other=0.0)
        y2 = tl.load(part_ptr + src + 1, mask=pmask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            y1 += tl.load(part_ptr + s * numel + src, mask=pmask, other=0.0)
            y2 += tl.load(part_ptr + s * numel + src + 1, mask=pmask, other=0.0)
        rows = row + tl.arange(0, 1)
        rc, rs = rope_cs(cos_ptr, sin_ptr, stride_cos, stride_sin, rows, rows >= 0, p, rope_cols, ROPE_HALF)
        o1, o2, d1, d2 = rope_pair(y1[None, :], y2[None, :], p, rc, rs, rope_cols, ROPE_HALF,
                                   out_ptr.dtype.element_ty)
        dst = out_ptr + row.to(tl.int64) * N
        tl.store(dst + d1[None, :], o1, mask=pmask[None, :])
        tl.store(dst + d2[None, :], o2, mask=pmask[None, :])
    elif SWIGLU:
        half = N // 2
        mask = offs < numel // 2
        src = (offs // half) * N + 2 * (offs % half)
        g = tl.load(part_ptr + src, mask=mask, other=0.0)
        u = tl.load(part_ptr + src + 1, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            g += tl.load(part_ptr + s * numel + src, mask=mask, other=0.0)
            u += tl.load(part_ptr + s * numel + src + 1, mask=mask, other=0.0)
        tl.store(out_ptr + offs, swiglu_values(g, u, out_ptr.dtype.element_ty), mask=mask)
    else:
        mask = offs < numel
        acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, K, Kp, stride_on,
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
    w_rows, s_rows = tile_row_bases(n_c, Kp)  # the tiled storage (triton_k32.py); BLOCK_K a multiple of 128
    cw, ts = tile_step_offsets(BQ, BG)
    w = tl.load(w_ptr + w_rows[:, None] + ((k0 // 4) * 64 + cw)[None, :])
    s = tl.load(s_ptr + s_rows[:, None] + ((k0 // 32) * 64 + ts)[None, :])
    v0, v1, v2, v3 = decode_tile(w, s, BLOCK_N, BLOCK_K, USE_ASM)
    # Interleave the slots back into element order (`k32.element_of`): [BN, tile, group, unit, j >> 1, j & 1]
    # -> [BN, tile, j >> 1, group, j & 1, unit].
    v = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, BQ, 2 (slot bit 1), 2 (slot bit 0)]
    v = v.reshape(BLOCK_N, BG // 4, 4, 8, 2, 2).permute(0, 1, 4, 2, 5, 3).reshape(BLOCK_N, BLOCK_K)
    gs = tl.load(gs_ptr) * OUT_BIAS
    k = k0 + tl.arange(0, BLOCK_K)
    if SWIGLU:
        dst = (rn % 2) * (N // 2) + rn // 2
    else:
        dst = rn
    tl.store(out_ptr + dst[:, None].to(tl.int64) * stride_on + k[None, :],
             (v.to(tl.float32) * gs).to(out_ptr.dtype.element_ty),
             mask=(rn < N)[:, None] & (k < K)[None, :])


def fp4_gemm(x, weight, weight_scale, weight_scale_2, N, K, cfg, split_k, counters=None, swiglu=False,
             rope=None, workspace=None):
    """Launch the GEMM for x [M, K] and a k32-layout weight; returns [M, N] in x.dtype, or with
    `swiglu` (a gate/up weight of N rows interleaved by `interleave_gate_up`) [M, N/2] =
    silu(x @ gate.T) * (x @ up.T), rounded as the GEMM followed by the silu_mul op. With `rope` =
    (cos, sin, rope_cols, head_dim) (a q/k/v weight in the `interleave_rope_rows` order; cos/sin
    [M, head_dim/2] with unit column stride), [M, N] in checkpoint column order whose first rope_cols
    columns (the q and k heads) are roped, rounded as the GEMM followed by the rope_qk op: in the
    epilogue for tiles of at most ROPE_EPILOGUE_BLOCK_M rows, in the reduction of a wgmma call split over
    K, else by the rope kernel after the GEMM (in place, in its interleaved mode, which also puts the
    columns back in checkpoint order).

    weight: uint8 [Np, Kp/2] (k32 layout, tiled storage: `repack_k32`), weight_scale: float8_e4m3fn
    [Np, Kp/16] (the same storage), weight_scale_2:
    float32 scalar tensor. cfg: a `TileConfig`; split_k: K splits (any count up to the BLOCK_K
    iterations; 1 = none). counters: int32 tensor of zeros, at least one per output tile, that the
    call leaves zero again; with it a split-K call reduces in the same kernel, without it a second
    kernel sums the partials. Calls sharing counters must not run concurrently (under PDL they do
    not: a kernel touches them only after waiting for the one before it). workspace: the stream-K
    workspace of a "wgmma" tile (`cuda_wgmma.gemm`; its flags may be `counters`); without it (or with fewer
    flags than output tiles) calls that `cuda_wgmma.plan` runs stream-K take its splits and tail launch instead.
    """
    M = x.shape[0]
    Kp = weight.shape[1] * 2
    assert weight.shape[0] % TILE_ROWS == 0 and weight.shape[0] >= N, \
        f"weights must come from repack_k32 (rows padded to {TILE_ROWS})"
    assert not swiglu or N % 2 == 0, f"a gate/up weight has an even row count, not {N}"
    assert not (swiglu and rope), "swiglu and rope are epilogues of different weights"
    if rope is not None:
        cos, sin, rope_cols, head_dim = rope
        assert N % 2 == 0 and rope_cols % head_dim == 0 and head_dim % 2 == 0 and cos.stride(-1) == 1 \
            and sin.stride(-1) == 1 and cos.shape == sin.shape == (M, head_dim // 2), "rope arguments"
        rope_args = dict(ROPE=True, cos_ptr=cos, sin_ptr=sin, stride_cos=cos.stride(0), stride_sin=sin.stride(0),
                         rope_cols=rope_cols, ROPE_HALF=head_dim // 2)
        if not ((cfg.kind == "fused" and cfg.block_m <= ROPE_EPILOGUE_BLOCK_M) or _wgmma_splits_all(x, N, Kp, cfg)):
            # the GEMM (q/k columns in pair order), then the rope kernel in place: its interleaved mode
            # reads each pair side by side and writes the halves back in checkpoint order
            from pieceworks.backends import fused_kernels

            y = fp4_gemm(x, weight, weight_scale, weight_scale_2, N, K, cfg, split_k, counters, workspace=workspace)
            q_cols = rope_cols - (N - rope_cols)  # the k heads are as many as the v heads (N - rope_cols)
            q = y[:, :q_cols].view(M, q_cols // head_dim, head_dim)
            fused_kernels.rope_qk(q, y[:, q_cols:rope_cols].view(M, (rope_cols - q_cols) // head_dim, head_dim),
                                  cos, sin, True, in_place=True)
            return y
    else:
        rope_args = {}
    out = torch.empty((M, N // 2 if swiglu else N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    kind = cfg.kind
    if kind == "wgmma":
        if cuda_wgmma.unsupported(x) is None:
            bm, stages, split, (tail, tail_splits), ctas = cuda_wgmma.plan(
                M, N, Kp, cfg.block_m, cfg.num_stages, cfg.narrow_block_m, multiprocessors(x.device))
            blocks = triton.cdiv(N, cuda_wgmma.ROWS)
            if ctas and workspace is not None and workspace[1].numel() >= triton.cdiv(M, bm) * blocks:  # flag per tile
                return cuda_wgmma.gemm(x, weight, weight_scale, weight_scale_2, N, K, bm, stages, swiglu=swiglu,
                                       out=out, stream_k=ctas, workspace=workspace)
            if split == 1:  # all row blocks but the tail's in one launch without splits
                cuda_wgmma.gemm(x, weight, weight_scale, weight_scale_2, N, K, bm, stages,
                                swiglu=swiglu, out=out, row_blocks=(0, blocks - tail))
                if not tail:
                    return out
                split = tail_splits
            first = blocks - tail if tail else 0
            part = cuda_wgmma.gemm(x, weight, weight_scale, weight_scale_2, N, K, bm, stages,
                                   split=split, row_blocks=(first, blocks - first))
            if rope_args:  # every column split (`_wgmma_splits_all`): the reduction ropes
                return _sum_splits_rope(part, out, rope_args)
            cols = part.shape[-1]
            dest = out if not first else torch.empty((M, cols // 2 if swiglu else cols), dtype=out.dtype,
                                                     device=out.device)
            _sum_splits(part, dest, swiglu)
            if first:  # the tail's columns (halved by the SwiGLU) after the first launch's
                out[:, out.shape[1] - dest.shape[1]:].copy_(dest)
            return out
        kind = "dequant"  # not a Hopper GPU, or x not bf16: dequantize + matmul instead
    if kind == "dequant":
        w = torch.empty((N, K), dtype=torch.bfloat16, device=x.device)
        grid = (triton.cdiv(N, 16), triton.cdiv(K, 512))
        _dequant_kernel[grid](weight.view(torch.int16), weight_scale.view(torch.int16), weight_scale_2,
                              w, N, K, Kp, w.stride(0),
                              BLOCK_N=16, BLOCK_K=512, USE_ASM=cfg.asm, SWIGLU=swiglu, num_warps=4)
        y = torch.matmul(x.to(torch.bfloat16), w.t()).to(x.dtype)
        if swiglu:
            from pieceworks.backends import fused_kernels

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
        M, N, K, Kp, x.stride(0), out.stride(0), iters,
        split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SPLIT=split_k > 1, FUSED_REDUCE=fused, EVEN_K=K == Kp, W_AS_A=cfg.w_as_a, USE_ASM=cfg.asm,
        ONE_DOT=cfg.one_dot, PDL=use_pdl, SWIGLU=swiglu, TWO_ACC=cfg.two_acc, PERM_K=cfg.perm_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **rope_args, **launch,
    )
    if split_k > 1 and not fused:
        if rope is not None:
            _splitk_reduce_kernel[(M,)](part, out, M * N, N, SPLIT_K=split_k, BLOCK=triton.next_power_of_2(N // 2),
                                        PDL=use_pdl, **rope_args, num_warps=4, **launch)
        else:
            _sum_splits(part, out, swiglu)
    return out


def _wgmma_splits_all(x: torch.Tensor, N: int, Kp: int, cfg) -> bool:
    """Whether a "wgmma" tile runs x's call as one launch split over K (`cuda_wgmma.plan`), so that the
    reduction of its partials can apply the rope (`_sum_splits_rope`) in place of the rope kernel."""
    return (cfg.kind == "wgmma" and cuda_wgmma.unsupported(x) is None
            and cuda_wgmma.plan(x.shape[0], N, Kp, cfg.block_m, cfg.num_stages, cfg.narrow_block_m,
                                multiprocessors(x.device))[2] > 1)


ROPE_REDUCE_PAIRS = 256
"""Column pairs per program of the rope-applying reduction of the wgmma kernel's partials (programs: rows x
pair blocks, 32 x 12 for a Llama-3.1-8B q/k/v call of 32 rows)."""


def _sum_splits_rope(part: torch.Tensor, out: torch.Tensor, rope_args: dict) -> torch.Tensor:
    """out [M, N] in checkpoint column order = the split-K partials part [splits, M, N] of a q/k/v weight in
    the `interleave_rope_rows` order summed, the q/k pairs roped as the rope kernel rounds (`rope_pair`)."""
    splits, M, N = part.shape
    use_pdl, launch = pdl.launch_options(out.device)
    _splitk_reduce_kernel[(M, triton.cdiv(N // 2, ROPE_REDUCE_PAIRS))](
        part, out, M * N, N, SPLIT_K=splits, BLOCK=ROPE_REDUCE_PAIRS, PDL=use_pdl, num_warps=4, **rope_args,
        **launch)
    return out


def _sum_splits(part: torch.Tensor, out: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """out [M, N] (with swiglu [M, N / 2]) = the sum of the float32 split-K partials part [splits, M, N]."""
    splits, M, N = part.shape
    use_pdl, launch = pdl.launch_options(out.device)
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(out.numel(), block),)](
        part, out, M * N, N, SPLIT_K=splits, BLOCK=block, PDL=use_pdl, SWIGLU=swiglu, num_warps=4, **launch)
    return out
