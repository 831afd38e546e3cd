"""Build many executors with piecewise graphs in one process: each must trace exactly once (no
Dynamo recompiles across executors). `python benchmarks/many_executors.py [--device cuda]`."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks import Executor  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("-n", type=int, default=10)
a = p.parse_args()
cfg = {"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": a.device}, "kv_cache": {"num_tokens": 4096},
       "cuda_graph": {"piecewise": {"enabled": "on", "max_tokens": 16}, "decode": {"batch_sizes": [1, 2]}}}
exs = [Executor.from_config(cfg, progress=False) for _ in range(a.n)]
outs = [e.generate([[1, 2, 3, 4, 5]], 6) for e in exs]
print("compiles per executor:", [e.piecewise.backend.num_compiles for e in exs], "same output:", len({str(o) for o in outs}) == 1)
