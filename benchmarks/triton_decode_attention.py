"""attention.triton's decode kernel alone: microseconds per call at Llama-3.1-8B head shapes.

    python benchmarks/triton_decode_attention.py [--batches 1,8,32] [--context 512]

Each time is the median of 7 replays of a CUDA graph of 32 back-to-back calls (one per layer, each on
its own K/V cache so L2 holds none of them), per call (`fp4_gemm.graph_time`). Needs a CUDA GPU and
triton.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import graph_time  # noqa: E402

from pieceworks.backends.attention import triton_decode_kernel as tk  # noqa: E402
from pieceworks.backends.attention.triton import num_splits  # noqa: E402

HQ, HKV, D, PS, LAYERS = 32, 8, 128, 16, 32


def time_calls(batch: int, context: int) -> float:
    gen = torch.Generator("cuda").manual_seed(batch)
    width = -(-context // PS)
    pages = batch * width + 1
    caches = [(torch.randn(pages, PS, HKV, D, device="cuda", generator=gen).bfloat16(),
               torch.randn(pages, PS, HKV, D, device="cuda", generator=gen).bfloat16()) for _ in range(LAYERS)]
    table = (torch.arange(batch * width, device="cuda") + 1).view(batch, width).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", generator=gen).bfloat16()
    out = torch.empty_like(q)
    splits = num_splits(batch, HKV)
    part_o = torch.empty(batch * HKV * splits * 16 * D, device="cuda")
    part_lse = torch.empty(batch * HKV * splits * 16, device="cuda")
    counters = torch.zeros(batch * HKV, dtype=torch.int32, device="cuda")
    return graph_time(lambda i: tk.decode(q, *caches[i], out, table, lens, D**-0.5, splits, part_o, part_lse,
                                          counters), LAYERS) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; context {args.context}, "
          f"{HQ}/{HKV} heads, head_dim {D}, page size {PS}")
    print("| batch | splits | us per call |\n|---:|---:|---:|")
    for b in (int(x) for x in args.batches.split(",")):
        print(f"| {b} | {num_splits(b, HKV)} | {time_calls(b, args.context):.2f} |", flush=True)


if __name__ == "__main__":
    main()
