"""GPU time per kernel of one DeepSeek-V3 MoE layer (the shapes of benchmarks/moe.py), by torch.profiler.

    python benchmarks/moe_profile.py --tokens 1,4 --out DIR                  # moe.triton as configured by default
    python benchmarks/moe_profile.py --backend cuda --tokens 1 --out DIR     # moe.cuda (r16c64 experts)
    python benchmarks/moe_profile.py --cuda-moe-max-t 0 --tokens 1 --out DIR # moe.triton on its Triton kernels

Runs the whole op (routing included) eagerly `--calls` times per T over 8 routing draws, with PDL off (so
that each kernel's time is its own, not overlapped with the one before), and prints each kernel's mean
duration and its count per call. Eager launches add host gaps between kernels but do not change the
kernels' durations; benchmarks/moe.py times the op itself (graph replays).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe import DRAWS, Bench, draws  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--backend", default="triton", choices=("triton", "cuda"))
    parser.add_argument("--cuda-moe-max-t", type=int, default=None)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    from pieceworks.backends import pdl

    pdl.configure("off", "cuda")
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    bench = Bench(gen, args.backend, args.cuda_moe_max_t)
    report = {}
    for t in [int(v) for v in args.tokens.split(",")]:
        sets = draws(t, gen, DRAWS)
        for i in range(len(sets)):  # compile and warm up outside the profile
            bench.full(*sets[i])
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(args.calls):
                bench.full(*sets[i % len(sets)])
            torch.cuda.synchronize()
        times = collections.defaultdict(list)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                times[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
        rows = sorted(((sum(v) / len(v), len(v) / args.calls, name) for name, v in times.items()), reverse=True)
        total = sum(mean * per for mean, per, _ in rows)
        print(f"T={t}: {total:.1f} us of kernels per call ({args.backend}, cuda_moe_max_t {args.cuda_moe_max_t})")
        for mean, per, name in rows:
            print(f"  {mean:8.2f} us x {per:4.1f}  {name[:110]}")
        report[t] = [dict(us=mean, per_call=per, kernel=name) for mean, per, name in rows]
    with open(os.path.join(args.out, "moe_profile.json"), "w") as f:
        json.dump(dict(report=report, device=torch.cuda.get_device_name(), args=vars(args)), f, indent=1)


if __name__ == "__main__":
    main()
