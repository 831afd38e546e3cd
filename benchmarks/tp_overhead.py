"""What the distributed path costs at world size 1: decode steps of a plain executor against the same
model built through a process group of one (`executor.distributed.one_rank`): "distributed" as a run of
one rank takes it (rank 0 of 1's layout and the leader's step message, pickled into the shared-memory
queue as for followers on the same host; a group of one skips the collectives), and "+ collectives" with the models' NCCL collectives kept (each a copy of one
rank, inside the full decode graphs), which shows what they cost per step.

    python benchmarks/tp_overhead.py --preset llama-3.1-8b --format nvfp4 --batch 1 8 32

Per batch size: median wall time of one `Executor.forward` decode step (synchronized; `common.wall_ms`)
of each and the ratios to plain. The executors are built one after the other in one process.
"""

from __future__ import annotations

import argparse
import gc

import torch
from common import md_table, wall_ms

from pieceworks import Executor
from pieceworks.config import load_config
from pieceworks.core.batch import ForwardBatch


def decode_ms(ex: Executor, batch: int, context: int, steps: int) -> float:
    """Median ms of a decode step of `batch` sequences after a `context`-token prefill each."""
    vocab = ex.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs = [ex.new_sequence() for _ in range(batch)]
    for s in seqs:
        ex.forward(ForwardBatch([s], [torch.randint(0, vocab, (context,), generator=gen).tolist()]))
    toks = [[int(t)] for t in torch.randint(0, vocab, (batch,), generator=gen)]
    ms = wall_ms(lambda: ex.forward(ForwardBatch(seqs, toks)), steps)
    for s in seqs:
        ex.free(s)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--format", default="nvfp4", choices=["none", "nvfp4"])
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    from pieceworks.executor.distributed import one_rank

    sizes = {"num_hidden_layers": args.layers} if args.layers else {}
    cfg = load_config({
        "model": {"arch": args.arch, "preset": args.preset, "sizes": sizes, "max_context": 4096},
        "quantization": {"format": args.format},
        "runtime": {"device": "cuda"},
        "kv_cache": {"num_tokens": max(args.batch) * (args.context + 300) + 1024},
        "cuda_graph": {"decode": {"batch_sizes": sorted(set(args.batch))}, "piecewise": {"enabled": "off"}},
    })
    results: dict[str, dict[int, float]] = {}
    for label in ("plain", "distributed", "collectives"):
        if label == "plain":
            ex = Executor.from_config(cfg, progress=False)
        else:
            ex = one_rank(Executor, cfg, progress=False, collectives=label == "collectives")
        results[label] = {b: decode_ms(ex, b, args.context, args.steps) for b in args.batch}
        ex.close()
        del ex
        gc.collect()
        torch.cuda.empty_cache()
    print(f"{args.arch} {args.preset} {args.format} layers={args.layers or 'all'} context={args.context} "
          f"on {torch.cuda.get_device_name()}")
    plain, dist, coll = (results[k] for k in ("plain", "distributed", "collectives"))
    rows = [[b, f"{plain[b]:.3f}", f"{dist[b]:.3f}", f"{dist[b] / plain[b]:.3f}", f"{coll[b]:.3f}",
             f"{coll[b] / plain[b]:.3f}"] for b in args.batch]
    print(md_table(["batch", "plain ms", "distributed ms", "ratio", "+ collectives ms", "ratio"], rows))


if __name__ == "__main__":
    main()
