"""Serving benchmark through AsyncEngine: N requests arriving as a Poisson process (or all at once,
under a concurrency cap), random prompt and output lengths, an optional shared system prompt.

Prints `pieceworks bench`'s table (pieceworks.serve.stats: TTFT, TPOT, ITL, E2E mean/p50/p90/p99, request
and token throughput), the first request's TTFT against the later ones' and the prefix cache's hit tokens.

    # CPU, tiny preset (seconds)
    python benchmarks/serving.py model.arch=llama model.preset=tiny runtime.device=cpu \\
        kv_cache.num_tokens=4096 --num-requests 16 --input-len 16 64 --output-len 16
    # H200, Llama-3.1-8B shape NVFP4: 64 requests of 256-768 prompt tokens, 128 new
    python benchmarks/serving.py configs/llama-3.1-8b-random-fp4.yaml --num-requests 64 \\
        --input-len 256 768 --output-len 128
    # the same behind a 2,000-token shared system prompt, one request at a time (TTFT first vs later)
    python benchmarks/serving.py configs/llama-3.1-8b-random-fp4.yaml --num-requests 16 \\
        --input-len 256 768 --output-len 128 --shared-prefix 2000 --max-concurrency 1
    # --executor-generate: the same prompts through Executor.generate (the baseline); --host-overhead 1 32:
    # Engine.step against the decode graph's replay alone at batch 1 and 32
Prompts are random token ids; every request generates its output length (ignore_eos), greedy by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks import AsyncEngine, Engine, SamplingParams  # noqa: E402
from pieceworks.serve.stats import RequestRecord, format_table, summarize  # noqa: E402


def make_requests(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    shared = [rng.randrange(vocab) for _ in range(args.shared_prefix)]
    out = []
    for _ in range(args.num_requests):
        n_in = rng.randint(*args.input_len)
        n_out = rng.randint(*args.output_len) if len(args.output_len) == 2 else args.output_len[0]
        out.append((shared + [rng.randrange(vocab) for _ in range(n_in)], n_out))
    return out


async def run_one(aeng: AsyncEngine, prompt: list[int], n_out: int, delay: float, sem, params: dict):
    await asyncio.sleep(delay)
    async with sem:
        rec = RequestRecord(prompt_tokens=len(prompt), start=time.perf_counter())
        async for out in aeng.generate(prompt, SamplingParams(max_tokens=n_out, ignore_eos=True, **params)):
            rec.add_chunk(time.perf_counter(), len(out.new_token_ids))
        rec.end = time.perf_counter()
        return rec


async def serve(aeng: AsyncEngine, reqs, args) -> tuple[list[dict], float]:
    rng = random.Random(args.seed + 1)
    delays, t = [], 0.0
    for _ in reqs:
        delays.append(t)
        if args.rate != float("inf"):
            t += rng.expovariate(args.rate)
    sem = asyncio.Semaphore(args.max_concurrency or len(reqs))
    params = {"temperature": args.temperature}
    t0 = time.perf_counter()
    results = await asyncio.gather(*(run_one(aeng, p, n, d, sem, params) for (p, n), d in zip(reqs, delays)))
    return results, time.perf_counter() - t0


def report(records: list[RequestRecord], duration: float, stats: dict) -> dict:
    """`pieceworks bench`'s table and numbers, plus first-vs-later TTFT and the prefix cache's hits."""
    row = {**summarize(records, duration), **stats}
    print(format_table(row, "AsyncEngine serving benchmark"))
    ttft = [1e3 * r.ttft for r in records]
    row["ttft_first_ms"] = ttft[0]
    row["ttft_later_median_ms"] = statistics.median(ttft[1:]) if len(ttft) > 1 else math.nan
    print(f"TTFT first request {ttft[0]:.2f} ms, later requests median {row['ttft_later_median_ms']:.2f} ms; prefix "
          f"cache: {stats['prefix_cache_hit_tokens']} of {stats['prefix_cache_queried_tokens']} prompt tokens hit; "
          f"{stats['num_preemptions']} preemptions")
    return row


def host_overhead(engine: Engine, batch_sizes: list[int], context: int, steps: int) -> list[dict]:
    """Engine.step wall time of a decode batch against the replay of its decode graph alone."""
    ex = engine.executor
    if ex.decode_graphs is None:
        raise SystemExit("--host-overhead needs CUDA decode graphs (a CUDA device)")
    rows = []
    rng = random.Random(0)
    for bs in batch_sizes:
        ids = [engine.add_request([rng.randrange(ex.vocab_size) for _ in range(context)],
                                  SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True))
               for _ in range(bs)]
        while engine.scheduler.waiting or any(r.seq.kv_len < len(r.prompt) for r in engine.scheduler.running):
            engine.step()
        for _ in range(5):
            engine.step()
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()  # ends with the sampled tokens' device-to-host copy
            walls.append(time.perf_counter() - t0)
        graph = ex.decode_graphs.graphs[ex.decode_graphs.sizes[next(i for i, s in enumerate(ex.decode_graphs.sizes) if s >= bs)]]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay = start.elapsed_time(end) / steps
        step = statistics.median(walls) * 1e3
        for rid in ids:
            engine.abort(rid)
        engine.step()
        row = {"batch": bs, "context": context, "step_ms": step, "replay_ms": replay,
               "host_fraction": (step - replay) / step}
        print(f"decode batch {bs:3d} at context {context}: Engine.step {step:.3f} ms, graph replay {replay:.3f} ms, "
              f"host outside the replay {100 * row['host_fraction']:.1f}%")
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="*", help="optional YAML config, then key.sub=value overrides")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight; 0: no cap")
    p.add_argument("--input-len", type=int, nargs=2, default=[256, 768], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs="+", default=[128], help="N, or MIN MAX")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt every request starts with")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests run before timing")
    p.add_argument("--host-overhead", type=int, nargs="*", metavar="BATCH",
                   help="measure Engine.step vs decode graph replay at these batch sizes instead")
    p.add_argument("--context", type=int, default=512, help="--host-overhead: prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=50, help="--host-overhead: timed steps per batch size")
    p.add_argument("--executor-generate", action="store_true",
                   help="run the same prompts through Executor.generate instead (output tok/s only)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = p.parse_args()
    config = args.config[0] if args.config and "=" not in args.config[0] else None
    overrides = [c for c in args.config if "=" in c]
    engine = Engine.from_config(config, overrides)
    if args.host_overhead:
        result = {"host_overhead": host_overhead(engine, args.host_overhead, args.context, args.steps)}
    elif args.executor_generate:
        reqs = make_requests(args, engine.executor.vocab_size)
        n_new = max(n for _, n in reqs)
        engine.executor.generate([p for p, _ in reqs[: args.warmup]], 4)
        t0 = time.perf_counter()
        outs = engine.executor.generate([p for p, _ in reqs], n_new)
        duration = time.perf_counter() - t0
        n_out = sum(map(len, outs))
        print(f"Executor.generate: {len(reqs)} prompts, {n_out} tokens in {duration:.2f} s = "
              f"{n_out / duration:.1f} output tok/s")
        result = {"executor_generate": {"duration_s": duration, "output_tok_s": n_out / duration}}
    else:
        reqs = make_requests(args, engine.executor.vocab_size)
        rng = random.Random(args.seed + 2)  # warm-up prompts share nothing with the timed ones
        engine.generate([[rng.randrange(engine.executor.vocab_size) for _ in range(args.input_len[0])]
                         for _ in range(args.warmup)], SamplingParams(max_tokens=4, ignore_eos=True))
        before = engine.stats()
        with AsyncEngine(engine) as aeng:
            results, duration = asyncio.run(serve(aeng, reqs, args))
            after = aeng.stats()
        stats = {k: after[k] - before[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens",
                                                   "num_preemptions")}
        result = {"serving": report(results, duration, stats), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
