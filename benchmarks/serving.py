"""Serving benchmark through AsyncEngine: N requests arriving as a Poisson process (or all at once,
under a concurrency cap), random prompt and output lengths, an optional shared system prompt.

Prints `pieceworks bench`'s table (pieceworks.serve.stats: TTFT, TPOT, ITL, E2E mean/p50/p90/p99, request
and token throughput), the first request's TTFT against the later ones', the prefix cache's hit tokens, and
where the time went (`StepLog`): steps that compute prompt tokens against decode-only steps.

    # CPU, tiny preset (seconds)
    python benchmarks/serving.py model.arch=llama model.preset=tiny runtime.device=cpu \\
        kv_cache.num_tokens=4096 --num-requests 16 --input-len 16 64 --output-len 16
    # H200, Llama-3.1-8B shape NVFP4: 64 requests of 256-768 prompt tokens, 128 new; then behind a
    # 2,000-token shared system prompt, one request at a time (TTFT first vs later)
    python benchmarks/serving.py configs/llama-3.1-8b-random-fp4.yaml --num-requests 64 --input-len 256 768 --output-len 128
    python benchmarks/serving.py configs/llama-3.1-8b-random-fp4.yaml --num-requests 16 \\
        --input-len 256 768 --output-len 128 --shared-prefix 2000 --max-concurrency 1
    # host time of a decode step outside the graph replay, at batch 1 and 32, as a share of the step (on a
    # CPU: the tiny model with 32 layers, an eager forward in place of the replay)
    python benchmarks/serving.py configs/llama-3.1-8b-random-fp4.yaml --host-overhead 1 32
    # scheduler.async_steps=false: synchronous steps; --executor-generate: Executor.generate (the baseline)
Prompts are random token ids; every request generates its output length (ignore_eos), greedy by default.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
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


class StepLog:
    """Where the serving time goes: steps that compute prompt tokens against decode-only steps.

    Wraps `Engine._forward`: each step's prompt tokens (the positions below its requests' prompt lengths
    that it computes) and decode rows, and a mark at the end of its forward's launches: a CUDA event on a
    GPU (the stream's time from the previous step's forward end: this step's forward plus the previous
    step's sampling, and any wait for the host), the host clock on a CPU. With async steps the host
    launches step k before step k - 1 ends; the events still follow the GPU's order.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine, self.cuda = engine, engine.executor.device.type == "cuda"
        self.steps: list[tuple[int, int, object]] = []  # (prompt tokens, decode rows, mark)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __enter__(self) -> "StepLog":
        forward = self.engine._forward
        self.start = self._mark()

        def logged(scheduled):
            prompt = rows = 0
            for req, toks in scheduled:
                done = req.seq.kv_len
                computed = max(0, min(done + len(toks), len(req.prompt)) - done)
                prompt += computed
                rows += computed == 0
            out = forward(scheduled)
            self.steps.append((prompt, rows, self._mark()))
            return out

        self.engine._forward = logged
        return self

    def __exit__(self, *exc) -> None:
        del self.engine._forward  # the class's method again

    def summary(self) -> dict:
        """Steps, seconds and tokens of both kinds (call after the GPU finished the steps)."""
        if self.cuda:
            torch.cuda.synchronize()
        marks = [self.start] + [m for _, _, m in self.steps]
        secs = [b - a if not self.cuda else a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        prompt = [(n, s) for (n, _, _), s in zip(self.steps, secs) if n]
        decode = [(r, s) for (n, r, _), s in zip(self.steps, secs) if not n]
        return {"prompt_steps": len(prompt), "prompt_steps_s": sum(s for _, s in prompt),
                "prompt_tokens_computed": sum(t for t, _ in prompt),
                "decode_steps": len(decode), "decode_steps_s": sum(s for _, s in decode),
                "decode_rows_mean": statistics.fmean(r for r, _ in decode) if decode else 0.0}


def phases_line(ph: dict) -> str:
    total = ph["prompt_steps_s"] + ph["decode_steps_s"]
    share = ph["prompt_steps_s"] / total if total else math.nan
    per = 1e3 * ph["decode_steps_s"] / ph["decode_steps"] if ph["decode_steps"] else math.nan
    return (f"steps computing prompt tokens: {ph['prompt_steps']}, {ph['prompt_steps_s']:.3f} s of {total:.3f} "
            f"({share:.0%}), {ph['prompt_tokens_computed']} prompt tokens; decode-only steps: {ph['decode_steps']}, "
            f"{ph['decode_steps_s']:.3f} s, {per:.2f} ms each, {ph['decode_rows_mean']:.1f} rows on average")


def report(records: list[RequestRecord], duration: float, stats: dict) -> dict:
    """`pieceworks bench`'s table and numbers, plus first-vs-later TTFT and the prefix cache's hits."""
    row = {**summarize(records, duration), **stats}
    print(format_table(row, "AsyncEngine serving benchmark"))
    ttft = [1e3 * r.ttft for r in records]
    row["ttft_first_ms"] = ttft[0]
    row["ttft_later_median_ms"] = statistics.median(ttft[1:]) if len(ttft) > 1 else math.nan
    print(f"TTFT first request {ttft[0]:.2f} ms, later requests median {row['ttft_later_median_ms']:.2f} ms; prefix "
          f"cache: {stats['prefix_cache_hit_tokens']} of {stats['prefix_cache_queried_tokens']} prompt tokens hit; "
          f"{stats['num_preemptions']} preemptions; {stats['num_async_steps']} of {stats['num_steps']} steps async")
    return row


# Host calls timed one by one in --host-overhead (inclusive wall time, so a part's time holds its
# sub-parts' (a/b in a/b/c); the table prints each part's own time).
PARTS = (("schedule", "pieceworks.engine.scheduler:Scheduler.schedule"),
         ("forward", "pieceworks.executor.runner:Executor.forward"),
         ("forward/validate", "pieceworks.executor.runner:Executor._validate"),
         ("forward/reserve pages", "pieceworks.executor.runner:Executor._reserve_pages"),
         ("forward/decode runner", "pieceworks.executor.cuda_graph:DecodeGraphRunner.run"),
         ("forward/decode runner/plan", "pieceworks.executor.cuda_graph:DecodeGraphRunner._plan"),
         ("forward/decode runner/replay", "pieceworks.executor.cuda_graph:DecodeGraphRunner.replay"),
         ("sample", "pieceworks.engine.sampler:Sampler.sample"),
         ("sample/wait for the GPU (tolist)", "torch:Tensor.tolist"),
         ("outputs", "pieceworks.engine.engine:Engine._accept"),
         ("wait for the previous step's ids (scheduler.async_steps)", "pieceworks.engine.async_steps:AsyncSteps.await_ids"))


ROUNDS = 5  # --host-overhead: timed steps and back-to-back replays alternate this many times


def replay_times(graph, n: int) -> list[float]:
    """ms of each of `n` back-to-back replays of `graph`, each between its own pair of CUDA events: a
    stall of the host or the GPU inside the window moves one sample, not the median (one pair of events
    around all n replays measures their mean, and with it any stall inside the window)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


class TimedGraph:
    """A CUDA graph whose replays are bracketed by CUDA events: its GPU time inside real steps."""

    def __init__(self, graph) -> None:
        self.graph, self.events = graph, []

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))

    def median_ms(self) -> float:
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in self.events)


class PartTimer:
    """Wraps the PARTS' methods with perf_counter accumulators while active; `runner_cls` (the decode
    runner's class, a subclass maybe) stands in for DecodeGraphRunner."""

    def __init__(self, runner_cls: type) -> None:
        self.runner_cls = runner_cls
        self.spent: dict[str, float] = {}
        self._saved: list[tuple[type, str, object]] = []

    def __enter__(self) -> "PartTimer":
        import importlib

        for label, target in PARTS:
            module, qual = target.split(":")
            owner_name, name = qual.split(".")
            owner = getattr(importlib.import_module(module), owner_name)
            if owner_name == "DecodeGraphRunner":
                owner = self.runner_cls
            self._saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, self._timed(label, getattr(owner, name)))
        return self

    def _timed(self, label: str, fn):
        spent = self.spent

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        return timed

    def __exit__(self, *exc) -> None:
        for owner, name, own in reversed(self._saved):
            if own is None:
                delattr(owner, name)  # the method was inherited
            else:
                setattr(owner, name, own)
        self._saved = []


def _eager_decode_runner(engine: Engine, batch_sizes: list[int], stub: bool) -> None:
    """Without CUDA: the decode-graph runner's host path with eager forwards in place of replays, or
    with `stub` no forward at all (every step's logits are one fixed random [bs, V] tensor: only the
    host path runs)."""
    from pieceworks.executor.cuda_graph import EagerDecodeRunner, greedy_token_ids

    class StubReplay(EagerDecodeRunner):
        def replay(self, bs, kernels, meta):
            if bs not in self.logits:
                self.logits[bs] = torch.randn(bs, self.model.vocab_size, generator=torch.Generator().manual_seed(bs))
                self.greedy[bs] = greedy_token_ids(self.logits[bs])  # inside the replay on CUDA

    ex = engine.executor
    cls = StubReplay if stub else EagerDecodeRunner
    ex.decode_graphs = cls(ex.model, ex.table, ex.kv, ex.max_context, sorted(set(batch_sizes)))


def host_overhead(engine: Engine, batch_sizes: list[int], context: int, steps: int,
                  stub: bool = False) -> list[dict]:
    """Engine.step of a decode batch against its decode graph's replay: the step's wall time (median,
    ending with the sampled tokens on the host), the replay's time (CUDA: median of back-to-back
    replays, each timed by its own events, in ROUNDS rounds alternating with the timed steps; without
    CUDA: the eager forward that stands in for it), the host time outside the replay as a share of the
    step, and the host time of each part (PARTS) per step, from a second series of steps with those
    calls timed (medians over the steps)."""
    ex = engine.executor
    cuda = ex.device.type == "cuda"
    if ex.decode_graphs is None:
        if cuda:
            raise SystemExit("--host-overhead needs decode graphs: leave cuda_graph.decode enabled")
        _eager_decode_runner(engine, batch_sizes, stub)
        torch.set_num_threads(1)  # the stand-in forward is not what is measured; spare the shared cores
    runner = ex.decode_graphs
    rows = []
    rng = random.Random(0)
    for bs in batch_sizes:
        if not runner.covers(bs):
            raise SystemExit(f"--host-overhead {bs}: above the largest decode graph ({runner.sizes[-1]})")
        ids = [engine.add_request([rng.randrange(ex.vocab_size) for _ in range(context)],
                                  SamplingParams(temperature=0, max_tokens=2 * steps + 10, ignore_eos=True))
               for _ in range(bs)]
        while engine.scheduler.waiting or any(r.seq.kv_len < len(r.prompt) for r in engine.scheduler.running):
            engine.step()
        for _ in range(5):
            engine.step()
        bucket = runner.sizes[bisect.bisect_left(runner.sizes, bs)]
        walls, replays = [], []
        for _ in range(ROUNDS):  # steps and back-to-back replays interleaved: both see the same GPU state
            for _ in range(-(-steps // ROUNDS)):
                t0 = time.perf_counter()
                engine.step()  # ends with the sampled tokens' device-to-host copy
                walls.append(time.perf_counter() - t0)
            if cuda:
                replays += replay_times(runner.graphs[bucket], -(-steps // ROUNDS))
        samples: list[dict[str, float]] = []
        timed_graph = None
        if cuda:
            timed_graph = runner.graphs[bucket] = TimedGraph(runner.graphs[bucket])
        try:
            with PartTimer(type(runner)) as parts:
                for _ in range(steps):
                    parts.spent.clear()
                    t0 = time.perf_counter()
                    engine.step()
                    parts.spent["step"] = time.perf_counter() - t0
                    samples.append(dict(parts.spent))
        finally:
            if timed_graph is not None:
                runner.graphs[bucket] = timed_graph.graph
        per = {k: 1e6 * statistics.median(x.get(k, 0.0) for x in samples) for k in samples[0]}
        timed_step = per.pop("step") / 1e6
        if cuda:
            replay = statistics.median(replays)
        else:
            replay = per.get("forward/decode runner/replay", 0.0) / 1e3  # the stand-in's compute
        step = statistics.median(walls) * 1e3
        for rid in ids:
            engine.abort(rid)
        engine.step()
        row = {"batch": bs, "context": context, "device": str(ex.device), "step_ms": step, "replay_ms": replay,
               "host_us": 1e3 * (step - replay), "host_fraction": (step - replay) / step,
               "parts_us": per, "timed_step_us": 1e6 * timed_step}
        what = "graph replay" if cuda else ("stub replay" if stub else "eager forward standing in for the replay")
        print(f"decode batch {bs:3d} at context {context}: Engine.step {step:.3f} ms, {what} {replay:.3f} ms, "
              f"host outside the replay {1e3 * (step - replay):.0f} us = {100 * row['host_fraction']:.1f}% of the step")
        if timed_graph is not None:
            row["replay_in_step_ms"] = in_step = timed_graph.median_ms()
            row["replay_min_max_ms"] = (min(replays), max(replays))
            print(f"  back to back the replay took {replay:.3f} ms (median of {len(replays)}, each between its own "
                  f"events, in {ROUNDS} rounds between the timed steps; min {min(replays):.3f}, max "
                  f"{max(replays):.3f}); inside the timed steps {in_step:.3f} ms, from an event recorded just before "
                  f"the launch call to one after it; the rest of the timed step, "
                  f"{1e3 * (timed_step * 1e3 - in_step):.0f} us, is host work before the replay, the copy of the "
                  "tokens back and the work after it")
            if abs(in_step - replay) > 0.1 * replay:
                print("  WARNING: the replay's time back to back and inside the steps differ by more than 10%")
        print(_parts_table(per, 1e6 * timed_step, cuda))
        rows.append(row)
    return rows


def _parts_table(per: dict[str, float], timed_step_us: float, cuda: bool) -> str:
    """Markdown table of each part's own host us per step (its median time less its timed sub-parts'
    medians)."""
    labels = [label for label, _ in PARTS]
    per = {**per, "step": timed_step_us}
    lines = ["| part of Engine.step (own host time) | us per step |", "|---|---:|"]
    for label in ["step"] + labels:
        depth = 0 if label == "step" else label.count("/") + 1
        children = [k for k in labels
                    if k.count("/") + 1 == depth + 1 and (label == "step" or k.startswith(label + "/"))]
        own = per.get(label, 0.0) - sum(per.get(k, 0.0) for k in children)
        name = "rest of the step" if label == "step" else label
        if label.endswith("replay"):
            name += " (launch)" if cuda else " (what stands in for it: not host time)"
        lines.append(f"| {name} | {own:.1f} |")
    lines.append(f"| whole step, timed | {timed_step_us:.1f} |")
    return "\n".join(lines)


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
    p.add_argument("--stub-forward", action="store_true",
                   help="--host-overhead without CUDA: no forward in place of the replay, fixed logits "
                        "(the host path only)")
    p.add_argument("--executor-generate", action="store_true",
                   help="run the same prompts through Executor.generate instead (output tok/s only)")
    p.add_argument("--out", type=Path, help="write the results as JSON")
    args = p.parse_args()
    config = args.config[0] if args.config and "=" not in args.config[0] else None
    overrides = [c for c in args.config if "=" in c]
    engine = Engine.from_config(config, overrides)
    if args.host_overhead:
        result = {"host_overhead": host_overhead(engine, args.host_overhead, args.context, args.steps,
                                                        args.stub_forward)}
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
        with StepLog(engine) as log, AsyncEngine(engine) as aeng:
            results, duration = asyncio.run(serve(aeng, reqs, args))
            after = aeng.stats()
        stats = {k: after[k] - before[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens",
                                                   "num_preemptions", "num_steps", "num_async_steps")}
        row = report(results, duration, stats)
        row["phases"] = log.summary()
        print(phases_line(row["phases"]))
        result = {"serving": row, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
