"""A w4a16 NVFP4 GEMM tile for 17..512 rows of x on Hopper, in Triton: every token of x in one MMA tile,
so each weight is decoded once per call (twice above 256 rows) where the `triton` tiles of
triton_tiles.py decode it once per 64 rows. Not wired into a backend; `benchmarks/fp4_gemm.py --w4a16`
times it beside the shipped path and bf16.

It reads the k32 weights every other path reads (k32.py; decoded by triton_k32.py) and computes
out^T = dequant(W) @ x^T: the decoded weight tile [BLOCK_N, BLOCK_K] is the register A operand of
wgmma (BLOCK_N weight rows are the MMA's M, in 64-row warpgroup slices) and x^T [BLOCK_K, BLOCK_M] the
shared-memory B operand, the token count its N (wgmma takes up to 256). The shipped 64 x 128 tile has
the same operand roles and the same in-register decode; what differs:

- BLOCK_M covers all rows up to 256, so the decode (the K loop's integer work) runs once per weight
  instead of M / 64 times. In ptxas's sm_90a code (Triton 3.6 compiled offline, pointers 16-byte
  aligned as at run time), the K loop issues 0.0005 warp instructions per weight and row of x at
  256 x 128 x 128 (8 warps) against 0.0021 for the shipped 64 x 128 x 128 tile.
- x comes in by TMA through a host tensor descriptor (`tma_x`: zero-filled past M and K): no
  addresses, masks or cp.async of x in the loop (the weights and scales keep Triton's cp.async
  pipeline: their tiled storage order is not one TMA box). At 64 x 64 x 128 (4 warps) the loop is
  263 warp instructions per K step against 277 with pointer loads of x and 295 for the shipped one-dot
  loop of that tile.
- Weight tiles of 128 rows: two 64-row wgmma slices for one warpgroup (0.103 instructions a weight
  against 0.128 at 64 rows, 64 x 128 x 128) or one slice each for two warpgroups. With 8 warps and
  64 rows, Triton splits the token axis between the warpgroups and both decode the same weights (0.25
  instructions a weight against 0.13 with 4 warps).

Triton 3.6's warp specialization (`tl.range(..., warp_specialize=True)`) does not serve this loop on
sm_90: with 4 warps its Hopper pass aborts (WSDataPartition.cpp: "Unexpected op"), with 8 it leaves
the loop as it is. Few (M tile, N tile) programs at these sizes, so K is split (`choose_split_k`) and
the last split to arrive reduces, as in triton_kernels.py.

Imports triton at the top (imported when first launched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pieceworks.backends.fp4_gemm.k32 import TILE_ROWS
from pieceworks.backends.fp4_gemm.triton import TileConfig, choose_split_k
from pieceworks.backends.fp4_gemm.triton_k32 import OUT_BIAS, _dequant_mma, tile_row_bases, tile_step_offsets
from pieceworks.backends.fp4_gemm.triton_kernels import _splitk_reduce_kernel, _store_out, publish_and_count


@dataclass(frozen=True)
class W4a16Tile:
    """One configuration of `w4a16_gemm`. block_m: rows of x per program (a power of two, 16..256; the
    MMA's N); block_n: weight rows per program (64-row multiples: one wgmma M slice each per
    warpgroup); block_k: a multiple of 128 (the weights' storage tiles); tma_x: x through a TMA
    descriptor (needs x's row stride a multiple of 8 elements), else pointer loads; target_ctas /
    max_split / min_split_iters: the K split (`choose_split_k`: ceil(target_ctas / tiles), capped)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    tma_x: bool = True
    target_ctas: int = 132
    max_split: int = 8
    min_split_iters: int = 4
    asm: bool = True

    def split_k(self, m: int, n: int, k_padded: int, sms: int = 132) -> int:
        cfg = TileConfig(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                         target_ctas=self.target_ctas, max_split=self.max_split,
                         min_split_iters=self.min_split_iters)
        return choose_split_k(cfg, m, n, k_padded, sms)


def tile_for(m: int, **overrides) -> W4a16Tile:
    """The tile for m rows of x: block_m the power of two covering them (at least 32, at most 256);
    8 warps (two warpgroups of 64 weight rows) from block_m 128 up, which keeps the float32
    accumulator [block_n, block_m] at 64-128 registers a thread; 2 stages at block_m 256 (x's 64 KB
    a stage: three would not fit in the 227 KB of shared memory). K splits up to 3 programs per SM where
    three fit (block_m <= 64: at most 68 KB of shared memory and 143 registers a thread, ptxas for
    sm_90a), else one (117-140 KB). `overrides`: other W4a16Tile fields."""
    bm = min(256, max(32, triton.next_power_of_2(m)))
    return W4a16Tile(**{"block_m": bm, "num_warps": 8 if bm >= 128 else 4, "num_stages": 2 if bm == 256 else 3,
                        "target_ctas": 396 if bm <= 64 else 132, **overrides})


@triton.jit(do_not_specialize=["M", "iters", "num_splits"])
def _w4a16_kernel(
    x_ptr, x_desc, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, Kp, stride_xm, stride_om, iters, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    TMA_X: tl.constexpr, USE_ASM: tl.constexpr, SPLIT: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Program (pid_m, pid_n, pid_k): x rows pid_m * BLOCK_M.., weight rows pid_n * BLOCK_N.., the
    pid_k-th of `num_splits` K ranges (whole BLOCK_K iterations, sizes differing by at most one). A split
    writes its float32 partial to part [splits, M, N]; with FUSED_REDUCE the last split to arrive at
    count_ptr[tile] sums them in split order and resets the counter (`triton_kernels._fp4_gemm_kernel`)."""
    BQ: tl.constexpr = BLOCK_K // 4
    BG: tl.constexpr = BLOCK_K // 32
    pid_m = tl.program_id(0)  # the M tiles of one weight tile run next to each other: it is read once from HBM
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_c = tl.where(rn < N, rn, N - 1).to(tl.int64)  # rows past N re-read row N - 1, never stored
    base = iters // num_splits
    extra = iters % num_splits
    it_lo = pid_k * base + tl.minimum(pid_k, extra)
    num_iters = base + (pid_k < extra).to(tl.int32)
    w_rows, s_rows = tile_row_bases(n_c, Kp)
    cw, ts = tile_step_offsets(BQ, BG)
    W_STEP: tl.constexpr = BQ * 64  # 16-bit units of a K step over BLOCK_N rows' storage tiles
    S_STEP: tl.constexpr = BG * 64
    w_ptrs = w_ptr + w_rows[:, None] + (it_lo * W_STEP + cw)[None, :]
    s_ptrs = s_ptr + s_rows[:, None] + (it_lo * S_STEP + ts)[None, :]
    xk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (it_lo * BLOCK_K + xk)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in tl.range(0, num_iters, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs + i * W_STEP)
        s = tl.load(s_ptrs + i * S_STEP)
        if TMA_X:
            x = x_desc.load([pid_m * BLOCK_M, (it_lo + i) * BLOCK_K])
        elif EVEN_K:
            x = tl.load(x_ptrs + i * BLOCK_K, mask=(rm < M)[:, None], other=0.0)
        else:
            k = (it_lo + i) * BLOCK_K + xk
            x = tl.load(x_ptrs + i * BLOCK_K, mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
        # one dot of K = BLOCK_K: the decoded slots interleaved back into element order, acc [BN, BM]
        acc = _dequant_mma(acc, w, s, x.to(tl.bfloat16), x, x, x, BLOCK_N, BLOCK_K, True, USE_ASM, True)
    y = tl.trans(acc) * (tl.load(gs_ptr) * OUT_BIAS)  # [BM, BN]
    if not SPLIT:
        _store_out(out_ptr, y, rm, pid_n * BLOCK_N, M, N, stride_om, BLOCK_M, BLOCK_N, False)
    else:
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None] * N + rn[None, :]  # int32 (M * N < 2^31): int64 offsets of a 256-row tile spill
        mn = M.to(tl.int64) * N
        tl.store(part_ptr + pid_k * mn + offs, y, mask=mask)
        if FUSED_REDUCE:
            tile = pid_n * tl.num_programs(0) + pid_m
            if publish_and_count(count_ptr + tile) == num_splits - 1:
                HALF: tl.constexpr = BLOCK_N // 2  # half the columns at a time: a 256 x 128 sum would spill
                for h in tl.static_range(2):
                    cols = pid_n * BLOCK_N + h * HALF + tl.arange(0, HALF)
                    h_mask = (rm[:, None] < M) & (cols[None, :] < N)
                    h_offs = rm[:, None] * N + cols[None, :]
                    total = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
                    for j in range(num_splits):
                        total += tl.load(part_ptr + j * mn + h_offs, mask=h_mask, other=0.0, cache_modifier=".cg")
                    _store_out(out_ptr, total, rm, pid_n * BLOCK_N + h * HALF, M, N, stride_om, BLOCK_M, HALF, False)
                tl.store(count_ptr + tile, 0)


def w4a16_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
               n: int, tile: W4a16Tile | None = None, counters: torch.Tensor | None = None,
               sms: int = 132) -> torch.Tensor:
    """y = x @ dequant(W).T for a k32 weight (`repack_k32`), rounded to x.dtype.

    x: [M, K] bf16 (or float16 / float32: the MMA takes it as bf16); weight: uint8 [Np, Kp/2] and
    weight_scale: float8_e4m3fn [Np, Kp/16] in the tiled k32 storage; weight_scale_2: float32 scalar
    tensor; n: output columns (<= Np). tile: `tile_for(M)` by default. counters: int32 zeros, one per
    output tile at least, left zero (the split-K handshake, as `TritonFp4GemmBackend.counters`); None:
    a second kernel sums the partials. Returns [M, n] in x.dtype.
    """
    m, k = x.shape
    kp = weight.shape[1] * 2
    assert weight.shape[0] % TILE_ROWS == 0 and n <= weight.shape[0] and k <= kp, \
        "weights must come from repack_k32 and match x"
    assert m * n < 2**31, f"{m} x {n} outputs: the split-K partials are indexed in int32"
    tile = tile_for(m) if tile is None else tile
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    iters = kp // tile.block_k
    split = tile.split_k(m, n, kp, sms)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n), split)
    fused = split > 1 and counters is not None and counters.numel() >= grid[0] * grid[1]
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    tma = tile.tma_x and x.dtype == torch.bfloat16 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    desc = None
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [tile.block_m, tile.block_k])
    _w4a16_kernel[grid](
        x, desc, weight.view(torch.int16), weight_scale.view(torch.int16), weight_scale_2, out, part,
        counters if fused else out, m, n, k, kp, x.stride(0), out.stride(0), iters, split,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
        TMA_X=tma, USE_ASM=tile.asm, SPLIT=split > 1, FUSED_REDUCE=fused,
        EVEN_K=k == kp, num_warps=tile.num_warps,
    )
    if split > 1 and not fused:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(out.numel(), block),)](part, out, m * n, n, SPLIT_K=split, BLOCK=block,
                                                                  num_warps=4)
    return out
