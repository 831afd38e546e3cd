"""Sweep attention.triton decode launch (splits, block_n, warps, stages) at serving batch sizes."""
import sys, time, itertools
sys.path.insert(0, "benchmarks")
import torch
import triton_decode_attention as bench
from pieceworks.backends.attention import triton_decode_kernel as tk
from pieceworks.backends.attention.triton import num_splits
bench.tk = tk
HKV, D = 8, 128
shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1].split(",")]
for batch, ctx in shapes:
    policy = num_splits(batch, HKV)
    state = bench.setup(batch, ctx, 16)
    gb = batch * ctx * HKV * D * 2 * 2 / 1e9
    out = state[1][0]
    base = bench.time_variant(state, policy, True)
    ref = out.clone()
    res = []
    for s, bn, w, st in itertools.product((1, 2, 4, 8), (32, 64, 128), (4, 8), (1, 2, 3)):
        if -(-ctx // s) < bn // 2:
            continue
        try:
            us = bench.time_variant(state, s, True, block_n=bn, num_warps=w, num_stages=st)
        except Exception as e:
            print(f"  {batch}x{ctx} s{s} bn{bn} w{w} st{st}: {type(e).__name__}", flush=True)
            continue
        err = (out.float() - ref.float()).abs().max().item()
        res.append((us, s, bn, w, st, err))
    res.sort()
    print(f"== {batch}x{ctx}: policy s{policy} bn64 w4 st2 {base:.2f} us ({gb / base * 1e6 / 1e3:.0f} GB/s... {gb*1e3/base:.2f} TB/s)")
    for us, s, bn, w, st, err in res[:8]:
        print(f"  s{s} bn{bn} w{w} st{st}: {us:.2f} us ({gb*1e3/us:.2f} TB/s) maxdiff {err:.1e}")
    del state; torch.cuda.empty_cache()
