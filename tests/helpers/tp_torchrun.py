"""Run by tests/test_parallel.py under `torchrun --nproc-per-node N`: every rank builds its shard, rank 0
prints the greedy tokens and how its step messages travel (the other ranks follow its steps inside
from_config and exit there)."""

import json
import sys

from pieceworks import Executor

with Executor.from_config(None, sys.argv[1:], progress=False) as ex:
    print("TOKENS " + json.dumps(ex.generate([[5, 6, 7], [9, 10]], max_new_tokens=4)), flush=True)
    print("QUEUE " + json.dumps(ex.groups.queue.count if ex.groups.queue is not None else None), flush=True)
