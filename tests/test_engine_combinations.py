"""The Engine's features together, in seeded random combinations on the tiny model (CPU): page size, KV budget
(small enough to preempt), tokens and sequences per step (chunked prefill), async steps, prefix caching over shared
prompt heads, an FP8 pool, n-gram speculation over repetitive prompts, and an abort mid-run. Every greedy completion
must equal what a roomy engine of the same pool dtype generates for its prompt alone (an aborted one: a prefix of
it), and every page must be free at the end. Each feature has its own tests; this one looks for their interactions.
"""

from __future__ import annotations

import random

import pytest

from pieceworks import Engine, SamplingParams

ROUNDS = 80  # about 0.15 s each


def make(num_tokens: int, page_size: int, kv: dict | None = None, **sections) -> Engine:
    cfg = {"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": num_tokens, "page_size": page_size, **(kv or {})}, **sections}
    return Engine.from_config(cfg, progress=False)


@pytest.fixture(scope="module")
def references():
    return {}


def alone(references: dict, page_size: int, fp8: bool, prompt: list[int], max_tokens: int) -> list[int]:
    key = (page_size, fp8)
    if key not in references:
        references[key] = make(8192, page_size, {"dtype": "fp8"} if fp8 else None)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return references[key].generate([prompt], params)[0].token_ids


def run_steps(engine: Engine, prompts: list[list[int]], max_tokens: list[int], abort_at: int | None):
    """Every completion's tokens (None if it never returned a final output) and the id aborted, if any."""
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    final, aborted, steps = {}, None, 0
    while engine.has_unfinished():
        final.update((o.request_id, list(o.token_ids)) for o in engine.step() if o.finished)
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        if steps == abort_at and len(ids) > 1:
            aborted = ids[0]
            engine.abort(aborted)
    return [final.get(i) for i in ids], aborted is not None


@pytest.mark.parametrize("block", range(4))
def test_random_feature_combinations_keep_greedy_outputs(references, block):
    for seed in range(block * ROUNDS // 4, (block + 1) * ROUNDS // 4):
        rng = random.Random(seed)
        page_size = rng.choice([4, 16])
        shared = [rng.randrange(512) for _ in range(rng.choice([0, 0, 7, 20, 40]))]
        prompts = [shared + [rng.randrange(512) for _ in range(rng.randint(1, 50))] for _ in range(rng.randint(1, 8))]
        spec = rng.random() < 0.3
        if spec:  # a repeated tail gives the n-gram drafter matches
            prompts = [p + p[-rng.randint(1, len(p)):] for p in prompts]
        max_tokens = [rng.randint(1, 16) for _ in prompts]
        need = max(len(p) + m for p, m in zip(prompts, max_tokens))
        num_tokens = max(rng.choice([64, 128, 256, 4096]), need + 2 * page_size)
        fp8 = rng.random() < 0.3
        conf = dict(scheduler={"max_num_batched_tokens": rng.choice([8, 16, 33, 64, 2048]),
                               "max_num_seqs": rng.choice([1, 2, 3, 64]), "async_steps": rng.choice([True, False])},
                    kv={"prefix_caching": rng.choice([True, False]), **({"dtype": "fp8"} if fp8 else {})},
                    **({"speculative": {"method": "ngram"}} if spec else {}))
        abort_at = rng.choice([None, None, 1, 3, 6])
        engine = make(num_tokens, page_size, **conf)
        got, aborted = run_steps(engine, prompts, max_tokens, abort_at)
        want = [alone(references, page_size, fp8, p, m) for p, m in zip(prompts, max_tokens)]
        case = f"seed {seed}: page {page_size}, {num_tokens} tokens, {conf}, abort at {abort_at}"
        if aborted:
            assert got[0] is not None and got[0] == want[0][: len(got[0])], case
            got, want = got[1:], want[1:]
        assert got == want, case
        assert engine.stats()["kv_pages_used"] == 0, case
