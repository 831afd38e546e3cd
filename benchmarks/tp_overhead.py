"""What the distributed path costs at world size 1: decode steps of a plain executor against the same
model built through a process group of one (`executor.distributed.one_rank`): "distributed" as a run of
one rank takes it (rank 0 of 1's layout and the leader's step, which has no follower to send a message
to; a group of one skips the collectives), and "+ collectives" with the models' NCCL collectives kept
(each a copy of one rank, inside the full decode graphs), which shows what they cost per step.

    python benchmarks/tp_overhead.py --preset llama-3.1-8b --format nvfp4 --batch 1 8 32 --steps 100

The plain executor stays alive while the others are built in turn (a process has one default process
group: "distributed", then "+ collectives"), and the two run alternately: `--rounds` rounds per batch
size, each timing `--steps` decode steps of one, then of the other (the order flips every round), so a
drift of the machine falls on both. Per batch size: the median over rounds of each round's median ms
(`common.wall_ms`, synchronized), and the median of the per-round ratios to plain with their range.
The verdict line per batch size compares that median with the target (within 2% of plain).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from common import md_table, wall_ms

from pieceworks import Executor
from pieceworks.config import load_config
from pieceworks.core.batch import ForwardBatch

TARGET = 1.02  # the distributed step within 2% of the plain one


def decoder(ex: Executor, batch: int, context: int):
    """(one decode step of `batch` sequences after a `context`-token prefill each, those sequences)."""
    gen = torch.Generator().manual_seed(0)
    seqs = [ex.new_sequence() for _ in range(batch)]
    for s in seqs:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,), generator=gen).tolist()]))
    toks = [[int(t)] for t in torch.randint(0, ex.vocab_size, (batch,), generator=gen)]
    return (lambda: ex.forward(ForwardBatch(seqs, toks))), seqs


def rounds(plain: Executor, other: Executor, args) -> dict[int, list[tuple[float, float]]]:
    """Per batch size, (plain ms, other ms) of each round (each the median of `args.steps` steps)."""
    out = {}
    for b in args.batch:
        (p, p_seqs), (o, o_seqs) = decoder(plain, b, args.context), decoder(other, b, args.context)
        out[b] = []
        for r in range(args.rounds):
            first, second = (p, o) if r % 2 == 0 else (o, p)
            t = {fn: wall_ms(fn, args.steps) for fn in (first, second)}
            out[b].append((t[p], t[o]))
        for ex, seqs in ((plain, p_seqs), (other, o_seqs)):
            for s in seqs:
                ex.free(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--format", default="nvfp4", choices=["none", "nvfp4"])
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers override")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100, help="decode steps per executor and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--collectives", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the executor with the NCCL collectives of one rank kept")
    args = ap.parse_args()
    start = time.perf_counter()
    from pieceworks.executor.distributed import one_rank

    sizes = {"num_hidden_layers": args.layers} if args.layers else {}
    grow = args.rounds * (args.steps + 3)  # the decode steps each sequence takes after its prefill
    cfg = load_config({
        "model": {"arch": args.arch, "preset": args.preset, "sizes": sizes, "max_context": 4096},
        "quantization": {"format": args.format},
        "runtime": {"device": "cuda"},
        "kv_cache": {"num_tokens": max(args.batch) * (args.context + grow + 64) + 1024},
        "cuda_graph": {"decode": {"batch_sizes": sorted(set(args.batch))}, "piecewise": {"enabled": "off"}},
    })
    plain = Executor.from_config(cfg, progress=False)
    print(f"{args.arch} {args.preset} {args.format} layers={args.layers or 'all'} context={args.context} "
          f"{args.rounds} rounds x {args.steps} steps on {torch.cuda.get_device_name()}", flush=True)
    head, rows, verdicts = ["batch", "plain ms"], {b: [b] for b in args.batch}, []
    for label in ("distributed", "+ collectives")[:2 if args.collectives else 1]:
        other = one_rank(Executor, cfg, progress=False, collectives=label != "distributed")
        for b, times in rounds(plain, other, args).items():
            ratios = [o / p for p, o in times]
            med, spread = statistics.median(ratios), f"{min(ratios):.3f}-{max(ratios):.3f}"
            if len(rows[b]) == 1:  # plain's column: its rounds against "distributed"
                rows[b].append(f"{statistics.median(p for p, _ in times):.3f}")
            rows[b] += [f"{statistics.median(o for _, o in times):.3f}", f"{med:.3f}", spread]
            print(f"{label}, batch {b}, per round (plain / {label} ms): "
                  + ", ".join(f"{p:.3f} / {o:.3f}" for p, o in times), flush=True)
            verdict = f": {'within' if med <= TARGET else 'NOT within'} 2%" if label == "distributed" else ""
            verdicts.append(f"{label} / plain, batch {b}: median {med:.3f} (rounds {spread}){verdict}")
        head += [f"{label} ms", "ratio (median)", "ratio (rounds)"]
        other.close()
        del other
        gc.collect()
        torch.cuda.empty_cache()
    print(md_table(head, list(rows.values())))
    print("\n".join(verdicts))
    print(f"{time.perf_counter() - start:.0f} s in all (builds, graph captures, prefills, steps)")


if __name__ == "__main__":
    main()
