"""attention.triton's decode kernel alone: microseconds per call at Llama-3.1-8B head shapes.

    python benchmarks/triton_decode_attention.py [--batches 1,8,32] [--context 512]
    python benchmarks/triton_decode_attention.py --sweep --shapes 1x512,32x4096   # launch variants
    python benchmarks/triton_decode_attention.py --write   # as the backend calls it: the kernel writes
                                                           # the step's K/V rows (positions as lengths)
    python benchmarks/triton_decode_attention.py --kv fp8  # an FP8 pool (e4m3 K/V, scales folded in)
    python benchmarks/triton_decode_attention.py --kv fp8 --fp8-read both   # word reads against Triton's .to()
    python benchmarks/triton_decode_attention.py --kv fp8 --write apart     # the quantizing write kernel first

--sweep times, per batch x context, the kernel with other split counts, keys per loop step (block_n)
and pipeline stages than the backend uses (same kernel, same results), to tune `num_splits` and the
launch.

Each time is the median of 7 replays of a CUDA graph of 32 back-to-back calls (one per layer, each on
its own K/V cache so L2 holds none of them), per call (`common.graph_time`). Needs a CUDA GPU and
triton.
"""

from __future__ import annotations

import argparse
import inspect

import torch
from common import graph_time, ints

HQ, HKV, D, PS, LAYERS = 32, 8, 128, 16, 32
FP8_WORDS = True


FP8_SCALES = (0.0125, 0.01)


def setup(batch: int, context: int, max_splits: int):
    gen = torch.Generator("cuda").manual_seed(batch)
    width = -(-context // PS)
    pages = batch * width + 1
    store = (lambda x, s: x.bfloat16()) if KV == "bf16" else quantize_kv
    caches = [(store(torch.randn(pages, PS, HKV, D, device="cuda", generator=gen), FP8_SCALES[0]),
               store(torch.randn(pages, PS, HKV, D, device="cuda", generator=gen), FP8_SCALES[1]))
              for _ in range(LAYERS)]
    table = (torch.arange(batch * width, device="cuda") + 1).view(batch, width).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    kv_new = torch.randn(2, batch, HKV, D, device="cuda", generator=gen).bfloat16()
    positions = lens.long() - 1
    slots = table.long().gather(1, (positions // PS)[:, None])[:, 0] * PS + positions % PS
    part_o = torch.empty(batch * HKV * max_splits * 16 * D, device="cuda")
    part_lse = torch.empty(batch * HKV * max_splits * 16, device="cuda")
    counters = torch.zeros(batch * HKV, dtype=torch.int32, device="cuda")
    return caches, (out, table, lens, D**-0.5), (part_o, part_lse, counters), q, (kv_new, positions, slots)


def time_variant(state, splits: int, write: str = "", **launch) -> float:
    caches, (out, table, lens, scale), parts, q, (kv_new, positions, slots) = state
    if write:  # the backend's call: lengths as the new tokens' positions
        lens = positions
    if write == "fused":  # the new K/V rows passed in, written by the kernel
        launch = dict(launch, k_new=kv_new[0], v_new=kv_new[1], lens_are_positions=True, slots=slots)
    elif write == "apart":  # written first by the K/V write kernel
        launch = dict(launch, lens_are_positions=True)
    scales = FP8_SCALES if KV == "fp8" else (1.0, 1.0)
    if KV == "fp8":
        launch = dict(launch, kv_scales=FP8_SCALES, fp8_words=FP8_WORDS)

    def call(i: int) -> None:
        if write == "apart":
            kc, vc = caches[i]
            width = HKV * D
            write_rows(kc.view(-1, width), kv_new[0].reshape(-1, width), vc.view(-1, width),
                       kv_new[1].reshape(-1, width), slots, scales)
        tk.decode(q, *caches[i], out, table, lens, scale, splits, *parts, **launch)

    return graph_time(call, LAYERS) * 1e6


def sweep(shapes: list[tuple[int, int]], block_ns: list[int], warps: list[int], policy_only: bool,
          stage_counts: list[int]) -> None:
    print("| batch x context | splits | block_n | stages | warps | us per call |\n|---|---:|---:|---:|---:|---:|")
    for batch, context in shapes:
        policy = num_splits(batch, HKV)
        state = setup(batch, context, 32)
        best = None
        every = {policy} if policy_only else {policy, 2, 4, 8, 16, 32} - ({32} if batch > 1 else set())
        for splits in sorted(every):
            for block_n in block_ns:
                for stages in stage_counts:
                    for w in warps:
                        us = time_variant(state, splits, block_n=block_n, num_stages=stages, num_warps=w)
                        mark = " (backend)" if (splits, block_n, stages, w) == (policy, *BACKEND_LAUNCH) else ""
                        print(f"| {batch} x {context} | {splits} | {block_n} | {stages} | {w} | {us:.2f}{mark} |",
                              flush=True)
                        if best is None or us < best[0]:
                            best = (us, splits, block_n, stages, w)
        print(f"best for {batch} x {context}: {best[0]:.2f} us with splits {best[1]}, block_n {best[2]}, "
              f"stages {best[3]}, warps {best[4]} (backend: splits {policy})", flush=True)
        del state
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--sweep", action="store_true", help="time launch variants (--shapes)")
    p.add_argument("--write", nargs="?", const="fused", choices=("fused", "apart"), default="",
                   help="the step's K/V rows written too: by the kernel (fused, as the backend calls it) or by the "
                        "K/V write kernel first (apart)")
    p.add_argument("--shapes", default="1x512,8x512,32x512,32x4096", help="batch x context, for --sweep")
    p.add_argument("--block-n", default="16,32,64", help="keys per loop step to sweep")
    p.add_argument("--warps", default="4", help="warps per program to sweep")
    p.add_argument("--stages", default="1,2", help="pipeline stages to sweep")
    p.add_argument("--policy-splits", action="store_true", help="sweep only the backend's split count")
    p.add_argument("--kv", choices=("bf16", "fp8"), default="bf16", help="the pool's dtype (fp8: e4m3 K/V with "
                   "scales, as kv_cache.dtype: fp8 stores them; with --write the kernel quantizes the rows it writes)")
    p.add_argument("--fp8-read", choices=("words", "convert", "both"), default="words", help="an FP8 pool's K/V "
                   "reads: words decoded by bit moves (the backend's), Triton's conversion, or each in turn")
    args = p.parse_args()
    # triton is imported once the arguments are read: --help needs none
    global tk, num_splits, quantize_kv, KV, FP8_WORDS, write_rows, BACKEND_LAUNCH
    from pieceworks.backends.attention import triton_decode_kernel as tk
    from pieceworks.backends.attention.triton import num_splits
    from pieceworks.backends.kv_write import write_rows
    from pieceworks.core.kv import quantize_kv

    # attention.triton launches with decode()'s defaults: (block_n, num_stages, num_warps)
    defaults = inspect.signature(tk.decode).parameters
    BACKEND_LAUNCH = tuple(defaults[k].default for k in ("block_n", "num_stages", "num_warps"))

    KV = args.kv

    if args.sweep:
        sweep([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")], ints(args.block_n),
              ints(args.warps), args.policy_splits, ints(args.stages))
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; context {args.context}, "
          f"{HQ}/{HKV} heads, head_dim {D}, page size {PS}, {KV} K/V"
          f"{f', K/V write {args.write}' if args.write else ''}")
    reads = {"words": [True], "convert": [False], "both": [True, False]}[args.fp8_read] if KV == "fp8" else [None]
    print("| batch | splits | K/V read | us per call |\n|---:|---:|---|---:|")
    for b in ints(args.batches):
        splits = num_splits(b, HKV)
        state = setup(b, args.context, splits)
        for FP8_WORDS in reads:
            us = time_variant(state, splits, args.write, num_stages=BACKEND_LAUNCH[1])
            how = {None: KV, True: "e4m3 words", False: "e4m3 convert"}[FP8_WORDS]
            print(f"| {b} | {splits} | {how} | {us:.2f} |", flush=True)


if __name__ == "__main__":
    main()
