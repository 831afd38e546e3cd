"""Speculative decoding with n-gram drafts (engine/speculative.py) against plain decoding, through the Engine.

B greedy chat requests per run (or `--temperature T`: seeded, EOS ignored), each generating up to M tokens
(EOS ends them): `--task copy` asks the model to copy a paragraph of pieceworks/data/english.txt (its output
repeats its prompt, where prompt lookup drafts well), `--task story` asks for a short story (little to look
up). `--task scripted` serves models without a tokenizer or sense (random weights, e.g. the Llama-3.1-8B shape
on the GPU): B random prompts of `--input-len` tokens and random drafts, of which a verify step accepts each next
one with probability `--accept` (`script_drafts`), so that the cost of a step with drafts shows at a chosen
acceptance. One engine built with `speculative.method=ngram`; its plain side drafts at no batch size (steps as
without speculation: no drafts, asynchronous), its speculative side as configured (`--set speculative.max_batch=N`
limits drafting to batches of at most N running requests), flipped between runs so that the sides alternate
`--rounds` times on one model (median). Per side: output tok/s and engine steps; for the speculative
side drafts fed and accepted, and whether each request's tokens equal the plain side's.

    python benchmarks/speculative.py --task copy --batch 1,8 --tokens 128 [--set key=value ...] [--out FILE]
    python benchmarks/speculative.py --task scripted --accept 0.6,0.9 --batch 1,16 --set model.arch=llama \
        --set model.preset=llama-3.1-8b --set quantization.format=nvfp4
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the checkout first on sys.path)

STORIES = ["a lighthouse keeper", "a lost robot", "a chess match", "a mountain village", "a night train",
           "a baker's apprentice", "a comet", "an old map"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=("copy", "story", "scripted"), default="copy")
    p.add_argument("--accept", default="0.8", help="scripted: chance that a draft token is right, comma-separated")
    p.add_argument("--input-len", type=int, default=256, help="scripted: prompt tokens (default 256)")
    p.add_argument("--batch", default="1,8", help="requests per run, comma-separated (default 1,8)")
    p.add_argument("--tokens", type=int, default=128, help="most tokens a request generates (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--k", type=int, default=3, help="speculative.num_speculative_tokens (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="alternated runs per side (default 3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (default model: model.path=smollm2-135m)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    return p.parse_args()


def paragraphs(n: int) -> list[str]:
    from importlib.resources import files

    text = (files("pieceworks.data") / "english.txt").read_text()
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    paras = [p for p in paras if 300 <= len(p) <= 700]
    return [paras[i % len(paras)] for i in range(n)]


def prompts(tokenizer, task: str, B: int) -> list[str]:
    if task == "copy":
        asks = [f"Copy the following text exactly, word for word, with no comment:\n\n{p}" for p in paragraphs(B)]
    else:
        asks = [f"Write a short story about {STORIES[i % len(STORIES)]}." for i in range(B)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=False)
            for a in asks]


def random_prompts(B: int, n: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(B)]


def script_drafts(engine, vocab: int) -> dict:
    """Scripted drafts at acceptance p (the returned dict's "accept"): each drafting row proposes k random tokens,
    and at its verify step the first j of them are accepted, j counted by coin flips that each succeed with
    probability p (the sampler's ids at those positions are replaced by the drafts; the next keeps its drawn id).
    The steps then cost what the engine's steps cost at that acceptance, whatever the random weights' near-tied
    logits do: their greedy tokens are not stable across the verify step's and the decode step's kernels in bf16
    (drafts copied from the plain side's tokens were accepted 0-2% on an H100 at "80%")."""
    import random

    from pieceworks.engine.speculative import NgramIndex

    rng, scripted = random.Random(0), {"accept": 1.0}
    NgramIndex.propose = lambda self, req, k: [rng.randrange(vocab) for _ in range(k)]
    spec, sampler = engine.speculator, engine.sampler
    real_step, real_sample = spec.step, sampler.sample

    def step(eng, scheduled, outputs, stream):
        drafting = [r for r, _ in scheduled if r.draft]

        def sample(logits, states, greedy=None, mask=None):
            result = real_sample(logits, states, greedy, mask)
            ids = result.token_ids
            i = len(states) - sum(len(r.draft) + 1 for r in drafting)  # the plain rows come first
            for r in drafting:
                for j, d in enumerate(r.draft):
                    if rng.random() >= scripted["accept"]:
                        break
                    ids[i + j] = d
                i += len(r.draft) + 1
            return result

        sampler.sample = sample
        try:
            return real_step(eng, scheduled, outputs, stream)
        finally:
            del sampler.sample

    spec.step = step
    return scripted


def set_speculation(engine, on: bool, max_batch: int | None) -> None:
    """The plain side drafts at no batch size (its steps run as without speculation, asynchronously where
    scheduler.async_steps allows); the speculative side as configured (speculative.max_batch)."""
    engine.speculator.max_batch = max_batch if on else 0


def main() -> None:
    args = parse_args()
    from pieceworks import Engine, SamplingParams, load_config

    given = any(s.startswith(("model.path=", "model.arch=")) for s in args.set)
    # drafts at every batch size unless a --set speculative.max_batch=N (after these) says otherwise
    cfg = load_config(None, [*([] if given else ["model.path=smollm2-135m"]), "speculative.method=ngram",
                             "speculative.max_batch=null", f"speculative.num_speculative_tokens={args.k}", *args.set])
    engine = Engine.from_config(cfg, progress=False)
    scripted = args.task == "scripted"
    if engine.tokenizer is None and not scripted:
        raise SystemExit("this model has no tokenizer; the prompts are chat text (--set model.path=..., or --task "
                         "scripted)")
    spec = engine.speculator
    max_batch = cfg.speculative.max_batch
    # sampled runs ignore EOS, so that both sides generate M tokens per request (their texts differ)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, seed=0,
                            ignore_eos=scripted or args.temperature > 0)
    rows = []
    cases = [(int(b), float(a)) for b in args.batch.split(",") for a in (args.accept.split(",") if scripted else [0])]
    script = script_drafts(engine, engine.executor.vocab_size) if scripted else None
    for B, accept in cases:
        if scripted:
            ps = random_prompts(B, args.input_len, engine.executor.vocab_size)
            script["accept"] = accept
        else:
            ps = prompts(engine.tokenizer, args.task, B)
        results: dict[str, list] = {"plain": [], "ngram": []}
        for name in results:  # warm-up: graphs, caches
            set_speculation(engine, name == "ngram", max_batch)
            engine.generate(ps, params)
        for _ in range(args.rounds):
            for name in results:
                set_speculation(engine, name == "ngram", max_batch)
                before = (engine.num_steps, spec.num_draft_tokens, spec.num_accepted_tokens)
                t = time.perf_counter()
                outs = engine.generate(ps, params)
                wall = time.perf_counter() - t
                after = (engine.num_steps, spec.num_draft_tokens, spec.num_accepted_tokens)
                results[name].append((wall, outs, *[a - b for a, b in zip(after, before)]))
        ref = [o.token_ids for o in results["plain"][0][1]]
        row = {"B": B, "case": f"{B} (p {accept:g})" if scripted else str(B)}
        for name, runs in results.items():
            tokens = sum(len(o.token_ids) for o in runs[0][1])
            wall = statistics.median(r[0] for r in runs)
            steps = runs[0][2]
            row[name] = (tokens / wall, steps, tokens)
            if name == "ngram":
                row["drafts"] = (runs[0][3], runs[0][4])
                same = sum(o.token_ids == r for o, r in zip(runs[0][1], ref))
                row["same"] = "n/a (scripted)" if scripted else f"{same} of {B}" if params.greedy else "n/a (sampled)"
        rows.append(row)
    model = cfg.model.path or f"{cfg.model.arch}-{cfg.model.preset}"
    task = args.task if not scripted else f"scripted drafts over {args.input_len}-token random prompts"
    how = "greedy" if params.greedy else f"temperature {args.temperature:g}"
    lines = [f"{model}, {cfg.quantization.format}, task {task}, {how}, up to {args.tokens} tokens, k = {args.k}, "
             f"median of {args.rounds}",
             "", "| B | plain tok/s | ngram tok/s | x plain | steps plain / ngram | drafts accepted / fed | "
             "same tokens |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        (pt, ps_, _), (nt, ns, _) = r["plain"], r["ngram"]
        acc, fed = r["drafts"][1], r["drafts"][0]
        lines.append(f"| {r['case']} | {pt:.1f} | {nt:.1f} | {nt / pt:.2f} | {ps_} / {ns} | {acc} / {fed} "
                     f"({acc / max(fed, 1):.0%}) | {r['same']} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    engine.close()


if __name__ == "__main__":
    main()
