"""Where the host time of one piecewise extend step goes (cProfile), for tuning graph overheads.

    python benchmarks/profile_step.py --tokens 16 --set backends.attention=flashinfer
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks import Executor  # noqa: E402
from pieceworks.executor.batch import ForwardMode, GraphMode  # noqa: E402
from pieceworks.executor.context import ForwardContext, forward_context  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--arch", default="llama")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", "model.max_context=4096",
                 "kv_cache.num_tokens=16384", "cuda_graph.piecewise.max_tokens=256",
                 "cuda_graph.decode.enabled=off", *args.set]
    ex = Executor.from_config(None, overrides, progress=False)
    toks = torch.randint(0, ex.vocab_size, (args.tokens,)).tolist()
    seq = ex.new_sequence()
    ex._reserve_pages([seq], [toks])
    pad = ex.piecewise.padded_size(args.tokens)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], [toks], pad)
    kernels = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)

    def step():
        for b in (kernels.attention, kernels.mla):
            if b is not None:
                b.plan(meta)
        with forward_context(ForwardContext(kernels, meta, ex.kv)):
            ex.piecewise(ids, meta.positions)

    for _ in range(5):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - t0) / args.steps
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    print(f"host time per step {host * 1e3:.3f} ms (launch-bound if close to wall {wall * 1e3:.3f} ms)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    main()
