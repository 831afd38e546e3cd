"""Tile tables for the Triton NVFP4 kernels, tuned on an H200 (see docs/benchmarks.md).

Plain data, read at plan time (never autotuned at run time). Each table is a list of buckets, smallest
first; a call takes the first bucket whose `max_m` is at least its row count (None = no upper bound).
Keys: kind ("fused": dequantize in registers and feed tensor-core dots; "dequant": dequantize the whole weight
to bf16, then torch.matmul, for compute-bound sizes; "wgmma": the CUDA kernel of cuda_wgmma.py on sm_90,
block_m tokens (32, 64, 128 or 256; a call's tile from 128 up is shrunk to cover M with fewer padded rows,
`cuda_wgmma.fit_token_tile`) and num_stages per CTA, elsewhere its bucket of WGMMA_FALLBACK_TILES;
narrow_block_m: a smaller token tile, with its most stages, for calls that one block_m tile covers with a grid
that leaves SMs idle: `cuda_wgmma.token_tile`),
block_m/n/k, group_m (tile order: tiles of group_m row blocks share a column sweep, for L2 reuse), num_warps,
num_stages, w_as_a (weights as the register operand: the accumulator is [block_n, block_m]), asm (PTX
bit-twiddling decode, else plain Triton arithmetic), one_dot (the four decoded slots of a K tile feed one dot
of K = block_k in element order, which lets Triton keep several wgmma groups in flight; else four dots),
two_acc (four dots into two accumulators, slots 0/2 and 1/3, summed after the K loop: two independent mma.sync
chains; not with one_dot), target_ctas (split K until at least this many programs; 0 = never), max_split,
min_split_iters (BLOCK_K iterations a split keeps at least), balance_waves (among the split counts giving at
least 3/4 of target_ctas programs, the one that spreads them most evenly over the SMs: `choose_split_k`),
perm_k (four-dot tiles: the K order in which each thread of an MMA quad holds whole groups, so it converts a
quarter of the scales; see `triton_k32.quad_k`).
"""

# Swept on an H200 (2026-12-01, `python benchmarks/fp4_gemm.py --sweep`): each bucket is the config with
# the lowest geometric-mean time over the Llama-3.1-8B and DeepSeek-V3 expert shapes at the bucket's
# tuning M (1, 16, 64, 256, 1024, 16384), with one-dot K loops and uneven, in-kernel split-K among the
# candidates (`--sweep-m 1,16,64`, `--sweep-m 256`); one_dot wins every fused bucket but the first.
# From M = 1024 up, dequantize + cuBLAS beat the fused kernel. Why the buckets are as they are (same
# machine and date, `--sweep --sweep-m ...`; times interleaved in one call):
# - M <= 8, 8-row tiles (`--sweep-m 1`): with 8 x rows Triton runs the dot as mma.sync m16n8k16, the
#   decoded weights the register A operand and x an n8 B operand (half the tensor work of the 16-column
#   wgmma, 2.98 SASS instructions per weight against 3.94), four dots per K tile into two accumulators
#   (`two_acc`).
# - The 8- and 16-row buckets take wave-balanced split counts (`--sweep-m 1,16,64`): geometric mean over
#   the six shapes 12.02 -> 11.12 us at M = 1, 13.60 -> 12.58 at M = 16.
# - The fused 32- and 64-row tiles (M = 17..64 before the wgmma kernel took it; `WGMMA_FALLBACK_TILES`):
#   M = 17..32 has its own 32-row one_dot tile (`--sweep-m 1,16,32`) rather than the 64-row tile (half of
#   whose rows would be padding): batch-32 decode replay 3.941 / 3.958 ms against 5.188 (512 tokens);
#   M = 32 gate_up 36.5 us. Wave-balanced splits for the 32- and 64-row buckets (`--sweep-m 32,64`;
#   block_k 256 for 32 rows, 396 programs for 64): geometric mean 15.70 us against 16.86 at M = 32 and
#   23.43 against 24.02 at M = 64; decode replay batch 32 3.844 / 3.853 ms against 3.948 / 3.937, batch
#   64 5.758 / 5.794 against 5.892 / 5.896. Two 32-row tiles at M = 64 (weights read twice): 23.69.
# - On the tiled weight storage, block_k 128 at 396 programs is faster for the 32-row bucket alone
#   (`--sweep-m 32`: gate_up 33.8 us against 38.0) but the batch-32 decode step is slower with it (replay
#   3.931 / 3.961 / 3.937 ms against 3.898 / 3.878 / 3.907): this tile stays. The sweep at M = 1, 16 and
#   64 on that storage keeps the other buckets.
# - The wgmma kernel (cuda_wgmma.py) took M = 65..1024 first: 2026-12-03 10:33, the removed probe (`git show
#   0fe89aa:benchmarks/wgmma_w4a16.py`, args `64,128,256,512,1024,2048 64x8x0x6,128x5x0x6,256x3x0x6`), geometric
#   mean over the six shapes against the Triton 64x128 tile up to 256 rows and dequantize + cuBLAS above: 27.1
#   / 31.4 us at M = 128 (128-token tiles; 34.5 with 64), 37.2 / 43.6 at 256, 56.2 / 67.9 at 512, 100.7 /
#   109.7 at 1024 (256-token tiles); at 2048 dequantize + cuBLAS stays ahead (195.1 / 198.1).
# - M = 17..64 run its 64-token tile with 8 stages. 2026-12-03 11:46, 99d7489, `fp4_gemm.py --ms 32,64 --pdl on`
#   with this bucket (`--table`) after the fused tiles' run: fp4 / bf16 over the six shapes 1.24x-1.74x at
#   M = 32 (fused 1.00x-1.80x), 1.19x-1.85x at 64 (0.71x-1.35x); the fused 32-row tile stays ahead on
#   q/k/v and gate/up at M = 32 (11.6 / 37.2 us against 12.6 / 40.9).
# - M = 17..32 run a 32-token tile (m64n32k16: half the 64-token tile's tensor work). 2026-12-03 13:40-13:41,
#   `fp4_gemm.py --ms 24,32 --pdl on`, the 64-token bucket and this one alternated twice: 5-11% faster on all six
#   shapes, us at M = 32: q/k/v 12.7 -> 11.7, gate/up 40.2 -> 37.1, down 20.0 -> 18.3, expert down 8.4 -> 8.0.
# - M = 129..256 take 128-token tiles where 256-token tiles would leave SMs idle and their CTAs run short K
#   loops (`narrow_block_m`, `cuda_wgmma.token_tile`). 2026-12-03 12:24-12:25, before fitted tiles,
#   `fp4_gemm.py --ms 128,256 --pdl on`, the table before and with 128-token tiles for 129..256 alternated
#   twice, us at M = 256: q/k/v 29.1-29.2 -> 26.1-26.3, o 21.8-22.0 -> 18.1, expert gate/up 29.3-29.5 -> 26.6,
#   expert down 19.5-19.7 -> 15.3, gate/up 91.3-92.4 -> 103.0-103.8 (224 row blocks fill the SMs with
#   256-token tiles: it keeps them). With fitted wide tiles (2026-12-04 09:08-09:09, `--ms
#   144,176,200,240,...`, this table without narrow_block_m against it, alternated twice) the narrow tile lost
#   where the wide tile's CTAs run long K loops: down (28 K tiles each) 1.05-1.24x slower at 144-240, q/k/v
#   and the expert gate/up 1.03-1.08x slower at 144-176; hence the K-loop rule (NARROW_K_TILES), which at
#   136-256 rows (09:13, alternated twice against the rule before it) ran down 1.02-1.28x and q/k/v and
#   the expert gate/up 1.03-1.10x faster where it changed the tile, level elsewhere. At M = 128, 64-token tiles
#   won on o and the expert down only (13.4 / 11.5 against 14.8 / 12.8 us) and lost on gate/up (76.9 against
#   53.6-53.9).
# - M = 257..1024 keep 256-token tiles, fitted (`cuda_wgmma.fit_token_tile`). 2026-12-04 03:01-03:02,
#   `fp4_gemm.py --ms 288,320,352,416,448,544,640,700 --pdl on`, the table with 128-token tiles where those
#   padded fewer unfitted rows (288..384, 544..640) against this one, alternated twice: this one 1.10-1.32x
#   faster at 288-352 and 1.08-1.19x at 544 on all six shapes (gate/up 125.4 -> 107.7 us at 288, down 112.1
#   -> 94.2 at 544), 1.03-1.11x at 640 on gate/up, down and the expert gate/up; level (0.995-1.025) on the
#   other three at 640 and on all at 416, 448 and 700, where both tables ran the same tiles.
FP4_GEMM_TILES = [
    dict(max_m=8, kind="fused", block_m=8, block_n=64, block_k=256, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=False, target_ctas=396, max_split=16, two_acc=True,
         balance_waves=True, min_split_iters=4),
    dict(max_m=16, kind="fused", block_m=16, block_n=64, block_k=256, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=396, max_split=16,
         balance_waves=True, min_split_iters=4),
    dict(max_m=32, kind="wgmma", block_m=32, num_stages=8),
    dict(max_m=64, kind="wgmma", block_m=64, num_stages=8),
    dict(max_m=128, kind="wgmma", block_m=128, num_stages=5),
    dict(max_m=256, kind="wgmma", block_m=256, num_stages=3, narrow_block_m=128),
    dict(max_m=1024, kind="wgmma", block_m=256, num_stages=3),
    dict(max_m=None, kind="dequant"),
]

# What a "wgmma" bucket runs where the wgmma kernel can't (not sm_90, x not bf16, NVRTC missing): the buckets
# it replaced on the H200 (the fused 32- and 64-row tiles, the fused 64x128 tile up to 256 rows, dequantize +
# cuBLAS above).
WGMMA_FALLBACK_TILES = [
    dict(max_m=32, kind="fused", block_m=32, block_n=64, block_k=256, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=264, max_split=8,
         balance_waves=True, min_split_iters=2),
    dict(max_m=64, kind="fused", block_m=64, block_n=64, block_k=128, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=396, max_split=8,
         balance_waves=True, min_split_iters=4),
    dict(max_m=256, kind="fused", block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=132, max_split=4),
    dict(max_m=None, kind="dequant"),
]

# Grouped MoE GEMMs, by token count T (swept with `python benchmarks/moe.py --sweep` on the
# DeepSeek-V3 layer, tuning T = 1, 16, 64, 256, 1024, 16384; same date and machine; the buckets up to
# T = 256 with one_dot candidates too, `--sweep --sweep-t 1,16,64,256`).
# The buckets up to T = 64 are 8-row four-dot tiles (mma.sync, as the dense GEMM's first bucket;
# `--sweep --sweep-t 1`, then `--sweep-t 16,64`; experts-only us, 8-row against the best 16-row tile:
# 76.5 / 85.9 at T = 1, 698 / 792 at T = 16, 1530 / 1771 at T = 64).
# The T = 16 and 64 buckets take perm_k (two sweeps: experts-only 680-711 us against 704-723 without it
# at T = 16, 1559 against 1610 at T = 64; at T = 1 within 1%).
MOE_TILES = [
    dict(max_m=4, block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=3, w_as_a=True, one_dot=False),
    dict(max_m=16, block_m=8, block_n=128, block_k=256, num_warps=4, num_stages=3, w_as_a=True, one_dot=False,
         perm_k=True),
    dict(max_m=64, block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=3, w_as_a=True, one_dot=False,
         perm_k=True),
    dict(max_m=256, block_m=16, block_n=64, block_k=256, num_stages=3, w_as_a=True, one_dot=True),
    dict(max_m=1024, block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3, w_as_a=True),
    dict(max_m=None, block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, w_as_a=True),
]
