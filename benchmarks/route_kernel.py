"""The DeepSeek-V3 routing kernel alone (`routing_kernel._route_kernel`; 256 experts, groups 8 / 4 kept,
top-8, with bias and renormalization) by warps per program, PDL off and on: microseconds per call.

    python benchmarks/route_kernel.py [--tokens 1,4,16,64] [--warps 1,2,4,8]

Each time is the median of 7 replays of a CUDA graph of 32 back-to-back calls rotating over 8 logit
draws, per call (`fp4_gemm.graph_time`). Every warp count's weights and ids are checked equal to the
first one's. Needs a CUDA GPU and triton.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp4_gemm import graph_time  # noqa: E402

from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.moe import routing_kernel  # noqa: E402

E, TOPK, GROUPS, TOPK_GROUP, SCALE = 256, 8, 8, 4, 2.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--warps", default="1,2,4,8")
    args = ap.parse_args()
    for mode in ("off", "on"):
        pdl.configure(mode, "cuda")
        use_pdl, launch = pdl.launch_options(torch.device("cuda"))
        for tokens in [int(t) for t in args.tokens.split(",")]:
            gen = torch.Generator("cuda").manual_seed(tokens)
            logits = [torch.randn(tokens, E, device="cuda", generator=gen) for _ in range(8)]
            bias = torch.rand(E, device="cuda", generator=gen) * 0.1
            times, first = {}, None
            for warps in [int(w) for w in args.warps.split(",")]:
                w = torch.empty(tokens, TOPK, device="cuda")
                ids = torch.empty(tokens, TOPK, dtype=torch.int64, device="cuda")

                def call(i, warps=warps, w=w, ids=ids):
                    lg = logits[i % len(logits)]
                    routing_kernel._route_kernel[(tokens,)](
                        lg, bias, w, ids, lg.stride(0), SCALE, E=E, G=GROUPS, TOPK=TOPK, TOPK_P2=TOPK,
                        TOPK_GROUP=TOPK_GROUP, HAS_BIAS=True, GROUPED=True, RENORM=True, PDL=use_pdl,
                        num_warps=warps, **launch)

                call(0)
                torch.cuda.synchronize()
                if first is None:
                    first = (w.clone(), ids.clone())
                elif not (torch.equal(w, first[0]) and torch.equal(ids, first[1])):
                    raise SystemExit(f"{warps} warps route differently from {args.warps.split(',')[0]}")
                times[warps] = graph_time(call, 32) * 1e6
            print(f"pdl {mode} T={tokens}: " + ", ".join(f"{k} warps {v:.2f} us" for k, v in times.items()),
                  flush=True)


if __name__ == "__main__":
    main()
