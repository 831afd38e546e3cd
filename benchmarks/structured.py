"""What structured outputs cost per decode step: B greedy requests of the same prompt generating M tokens each,
held to a regex by llguidance's bitmask (engine/structured.py), against the same requests without one.

Both sides set min_tokens = max_tokens = M, so both run exactly M tokens (the grammar `[a-z ,]+` never ends by
itself). Where the model has EOS ids, min_tokens puts both sides on the sampler's processed path; a random-weights
model has none, and there the plain side keeps the greedy fast path (the decode graph's own argmax), as a plain
greedy request does. With the grammar the host fills the bitmask (its fill timed here on its own), uploads it, and
the sampler masks the logits. The two sides alternate `--rounds` times (median). Needs llguidance and a tokenizer:
the model's (default: the SmolLM2 demo model), or `--tokenizer DIR` for a random-weights model (the Llama-3.1-8B
shape on the GPU, whose vocabulary holds any tokenizer's ids).

    python benchmarks/structured.py --batch 1,8,32,64 --tokens 64 [--set key=value ...] [--out FILE]
    python benchmarks/structured.py --tokenizer DIR --set model.arch=llama --set model.preset=llama-3.1-8b \
        --set quantization.format=nvfp4
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the checkout first on sys.path)

PROMPT = "Write a long list of fruits, separated by commas."


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8,32", help="requests per run, comma-separated (default 1,8,32)")
    p.add_argument("--tokens", type=int, default=64, help="tokens each request generates (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="alternated runs per side (default 3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (default model: model.path=smollm2-135m)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a Hugging Face tokenizer folder to use instead of the model's (random weights)")
    p.add_argument("--out", default=None, help="also write the table here (markdown)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from pieceworks import Engine, Executor, SamplingParams, StructuredOutputsParams, load_config

    given = any(s.startswith(("model.path=", "model.arch=")) for s in args.set)
    cfg = load_config(None, args.set if given else ["model.path=smollm2-135m", *args.set])
    if args.tokenizer:
        from transformers import AutoTokenizer

        engine = Engine(Executor.from_config(cfg, progress=False), AutoTokenizer.from_pretrained(args.tokenizer))
    else:
        engine = Engine.from_config(cfg, progress=False)
    if engine.tokenizer is None:
        raise SystemExit("this model has no tokenizer: structured outputs need one (--set model.path=...)")
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                  tokenize=False)
    grammar = StructuredOutputsParams(regex=r"[a-z ,]+")
    mask_s = []
    fill = engine.grammars._fill  # the words' fill (on the grammar worker under async steps)

    def timed_fill(reqs, rows):
        t = time.perf_counter()
        out = fill(reqs, rows)
        mask_s.append(time.perf_counter() - t)
        return out

    engine.grammars._fill = timed_fill
    M = args.tokens
    rows = []
    for B in [int(b) for b in args.batch.split(",")]:
        sides = {"plain": SamplingParams(temperature=0, max_tokens=M, min_tokens=M),
                 "grammar": SamplingParams(temperature=0, max_tokens=M, min_tokens=M, structured_outputs=grammar)}
        times: dict[str, list[float]] = {k: [] for k in sides}
        engine.generate([prompt] * B, sides["grammar"])  # warm-up: llguidance's tokenizer, graphs, caches
        mask_s.clear()
        for _ in range(args.rounds):
            for name, params in sides.items():
                t = time.perf_counter()
                outs = engine.generate([prompt] * B, params)
                times[name].append(time.perf_counter() - t)
                assert all(len(o.token_ids) == M for o in outs), [len(o.token_ids) for o in outs]
        plain, constrained = (statistics.median(times[k]) / M * 1e3 for k in ("plain", "grammar"))
        fill_ms = statistics.median(mask_s) * 1e3 if mask_s else float("nan")
        rows.append(f"| {B} | {plain:.3f} | {constrained:.3f} | {constrained / plain:.2f}x | {fill_ms:.3f} |")
    table = "\n".join(["| B | generate ms / M, no grammar | with the grammar | ratio | bitmask fill ms per step |",
                       "|---:|---:|---:|---:|---:|", *rows])
    print(f"{engine.model_name} on {engine.executor.device}, {M} tokens per request, median of {args.rounds}")
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    engine.close()


if __name__ == "__main__":
    main()
