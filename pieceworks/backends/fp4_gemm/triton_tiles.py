"""Tile tables for the Triton NVFP4 kernels, tuned on an H200 (see docs/benchmarks.md).

Plain data, read at plan time (never autotuned at run time). Each table is a list of buckets, smallest
first; a call takes the first bucket whose `max_m` is at least its row count (None = no upper bound).
Keys: kind ("fused": dequantize in registers and feed tensor-core dots; "dequant": dequantize the whole
weight to bf16, then torch.matmul, for compute-bound sizes), block_m/n/k, group_m (tile order: tiles
of group_m row blocks share a column sweep, for L2 reuse), num_warps, num_stages, w_as_a (weights as
the register operand: the accumulator is [block_n, block_m]), asm (PTX bit-twiddling decode, else
plain Triton arithmetic), one_dot (the four decoded slots of a K tile feed one dot of K = block_k in
element order, which lets Triton keep several wgmma groups in flight; else four dots), two_acc (four
dots into two accumulators, slots 0/2 and 1/3, summed after the K loop: two independent mma.sync
chains; not with one_dot), target_ctas (split K until at least this many programs; 0 = never),
max_split, min_split_iters (BLOCK_K iterations a split keeps at least), balance_waves (among the split
counts giving at least 3/4 of target_ctas programs, the one that spreads them most evenly over the
SMs: `choose_split_k`), perm_k (four-dot tiles: the K order in which each thread of an MMA quad holds
whole groups, so it converts a quarter of the scales; see `triton_k32.quad_k`).
"""

# Swept on an H200 (2026-12-01, `python benchmarks/fp4_gemm.py --sweep`): each bucket is the config with
# the lowest geometric-mean time over the Llama-3.1-8B and DeepSeek-V3 expert shapes at the bucket's
# tuning M (1, 16, 64, 256, 1024, 16384). From M = 1024 up, dequantize + cuBLAS beat the fused kernel.
# The buckets up to M = 256 were swept again after the one-dot K loop and uneven, in-kernel split-K
# (`--sweep --sweep-m 1,16,64`, then `--sweep-m 256`, same day); one_dot won all four.
# The first bucket (8-row tiles, M <= 8) was swept on 2026-12-01 (eighth session, `--sweep --sweep-m 1`):
# with 8 x rows Triton runs the dot as mma.sync m16n8k16, the decoded weights the register A operand
# and x an n8 B operand (half the tensor work of the 16-column wgmma, 2.98 SASS instructions per
# weight against 3.94), four dots per K tile into two accumulators (`two_acc`).
# The 8- and 16-row buckets take wave-balanced split counts (tenth session, `--sweep --sweep-m 1,16,64`):
# geometric mean over the six shapes 12.02 -> 11.12 us at M = 1, 13.60 -> 12.58 at M = 16. The 64-row
# bucket kept the plain count then: balanced, its GEMMs were faster alone (M = 32: qkv 14.3 against 16.5
# us) but the batch-32 decode step slower (replay 5.32 / 5.34 ms against 5.20, same session).
# The 32-row bucket (M = 17..32) was added in the twelfth session (`--sweep --sweep-m 1,16,32`, branch
# exp/s11-combined): a 32-row one_dot tile with block_k 256 against the 64-row tile that those Ms took
# before (half its rows were padding). Batch-32 decode replay 5.188 -> 3.941 ms and 5.188 -> 3.958
# (interleaved in one call, 512 tokens); M = 32 gate_up 36.5 us. A second sweep the same session
# (`--sweep --sweep-m 32,64`) gave both buckets wave-balanced splits (block_k 256 for 32 rows; the
# 64-row bucket, now M = 33..64 only, at 396 programs): geometric mean 16.86 -> 15.70 us at M = 32 and
# 24.02 -> 23.43 at M = 64; decode replay, interleaved: batch 32 3.948 / 3.937 -> 3.844 / 3.853 ms, batch
# 64 5.892 / 5.896 -> 5.758 / 5.794. Two 32-row tiles at M = 64 (weights read twice): 23.69.
# On the tiled weight storage (thirteenth session) a re-sweep of the 32-row bucket (`--sweep --sweep-m
# 32`) preferred block_k 128 at 396 programs (gate_up 33.8 us against 38.0 for this tile), but the
# batch-32 decode step was slower with it (replay 3.931 / 3.961 / 3.937 ms against 3.898 / 3.878 /
# 3.907, interleaved in one call): this tile stays. The other buckets' sweep (M = 1, 16, 64) kept theirs.
FP4_GEMM_TILES = [
    dict(max_m=8, kind="fused", block_m=8, block_n=64, block_k=256, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=False, target_ctas=396, max_split=16, two_acc=True,
         balance_waves=True, min_split_iters=4),
    dict(max_m=16, kind="fused", block_m=16, block_n=64, block_k=256, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=396, max_split=16,
         balance_waves=True, min_split_iters=4),
    dict(max_m=32, kind="fused", block_m=32, block_n=64, block_k=256, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=264, max_split=8,
         balance_waves=True, min_split_iters=2),
    dict(max_m=64, kind="fused", block_m=64, block_n=64, block_k=128, group_m=1, num_warps=4,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=396, max_split=8,
         balance_waves=True, min_split_iters=4),
    dict(max_m=256, kind="fused", block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8,
         num_stages=3, w_as_a=True, asm=True, one_dot=True, target_ctas=132, max_split=4),
    dict(max_m=1024, kind="dequant"),
    dict(max_m=None, kind="dequant"),
]

# Grouped MoE GEMMs, by token count T (swept with `python benchmarks/moe.py --sweep` on the
# DeepSeek-V3 layer, tuning T = 1, 16, 64, 256, 1024, 16384; same date and machine; the buckets up to
# T = 256 again with one_dot candidates, `--sweep --sweep-t 1,16,64,256`).
# The buckets up to T = 64 became 8-row four-dot tiles (mma.sync, as the dense GEMM's first bucket) in
# the eighth session (`--sweep --sweep-t 1`, then `--sweep-t 16,64`; experts-only us, 8-row against the
# best 16-row tile: 76.5 / 85.9 at T = 1, 698 / 792 at T = 16, 1530 / 1771 at T = 64).
# The T = 16 and 64 buckets take perm_k (tenth session, two sweeps: experts-only 680-711 us against
# 704-723 at T = 16, 1559 against 1610 at T = 64; at T = 1 within 1%).
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
