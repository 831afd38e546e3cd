"""The Engine's features together, in seeded random combinations on the tiny model (CPU): page size, KV budget
(small enough to preempt), tokens and sequences per step (chunked prefill), async steps, prefix caching over shared
prompt heads, an FP8 pool, n-gram speculation over repetitive prompts, and an abort mid-run. Every greedy completion
must equal what a roomy engine of the same pool dtype generates for its prompt alone (an aborted one: a prefix of
it), and every page must be free at the end. Seeded sampled requests (temperature, top-k/p, min-p, penalties, bias,
stop ids, min_tokens, n = 2; no speculation, which changes a seeded row's draws) must draw the same tokens as alone.
The greedy rounds run on the tiny DeepSeek-V3 too (MLA's latent pool, MoE; no FP8 pool: MLA keeps its latents in the
model dtype). Each feature has its own tests; this one looks for their interactions.
"""

from __future__ import annotations

import random

import pytest

from pieceworks import Engine, SamplingParams

ROUNDS = 80  # greedy rounds (about 0.15 s each); seeded sampling runs half as many
MLA_ROUNDS = 16  # greedy rounds on the tiny DeepSeek-V3 (about 0.6 s each)


def make(num_tokens: int, page_size: int, kv: dict | None = None, arch: str = "llama", **sections) -> Engine:
    cfg = {"model": {"arch": arch, "preset": "tiny"}, "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": num_tokens, "page_size": page_size, **(kv or {})}, **sections}
    return Engine.from_config(cfg, progress=False)


@pytest.fixture(scope="module")
def references():
    return {}


def alone(references: dict, page_size: int, fp8: bool, prompt: list[int], params: SamplingParams,
          arch: str = "llama") -> list[list[int]]:
    """The tokens of each completion of `prompt` on a roomy engine of the same model, page size and pool dtype."""
    key = (arch, page_size, fp8)
    if key not in references:
        references[key] = make(8192, page_size, {"dtype": "fp8"} if fp8 else None, arch)
    return [list(o.token_ids) for o in references[key].generate([prompt], params)]


def run_steps(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], abort_at: int | None = None):
    """Every completion's tokens per request (None if it never returned a final output), and whether the first
    request was aborted."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    final, aborted, steps = {}, False, 0
    while engine.has_unfinished():
        final.update(((o.request_id, o.index), list(o.token_ids)) for o in engine.step() if o.finished)
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        if steps == abort_at and len(ids) > 1:
            aborted = True
            engine.abort(ids[0])
    return [[final.get((i, k)) for k in range(q.n)] for i, q in zip(ids, params)], aborted


def random_batch(rng: random.Random) -> tuple[int, list[list[int]]]:
    """A page size and prompts, some behind a shared head."""
    page_size = rng.choice([4, 16])
    shared = [rng.randrange(512) for _ in range(rng.choice([0, 0, 7, 20, 40]))]
    count = rng.randint(1, 8)
    return page_size, [shared + [rng.randrange(512) for _ in range(rng.randint(1, 50))] for _ in range(count)]


def random_engine(rng: random.Random, page_size: int, need: int, fp8: bool, arch: str = "llama",
                  **extra) -> tuple[Engine, str]:
    num_tokens = max(rng.choice([64, 128, 256, 4096]), need + 2 * page_size)
    conf = dict(scheduler={"max_num_batched_tokens": rng.choice([8, 16, 33, 64, 2048]),
                           "max_num_seqs": rng.choice([1, 2, 3, 64]), "async_steps": rng.choice([True, False])},
                kv={"prefix_caching": rng.choice([True, False]), **({"dtype": "fp8"} if fp8 else {})}, **extra)
    return make(num_tokens, page_size, arch=arch, **conf), f"{arch}, page {page_size}, {num_tokens} tokens, {conf}"


@pytest.mark.parametrize("arch, seeds", [*(("llama", range(b * ROUNDS // 4, (b + 1) * ROUNDS // 4)) for b in range(4)),
                                         ("deepseek_v3", range(MLA_ROUNDS))], ids=["0", "1", "2", "3", "mla"])
def test_random_feature_combinations_keep_greedy_outputs(references, arch, seeds):
    for seed in seeds:
        rng = random.Random(seed)
        page_size, prompts = random_batch(rng)
        spec = rng.random() < 0.3
        if spec:  # a repeated tail gives the n-gram drafter matches
            prompts = [p + p[-rng.randint(1, len(p)):] for p in prompts]
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 16), ignore_eos=True) for _ in prompts]
        fp8 = rng.random() < 0.3 and arch == "llama"
        engine, conf = random_engine(rng, page_size, max(len(p) + q.max_tokens for p, q in zip(prompts, params)), fp8,
                                     arch, **({"speculative": {"method": "ngram"}} if spec else {}))
        abort_at = rng.choice([None, None, 1, 3, 6])
        got, aborted = run_steps(engine, prompts, params, abort_at)
        want = [alone(references, page_size, fp8, p, q, arch) for p, q in zip(prompts, params)]
        case = f"seed {seed}: {conf}, abort at {abort_at}"
        if aborted:
            assert got[0][0] is not None and got[0][0] == want[0][0][: len(got[0][0])], case
            got, want = got[1:], want[1:]
        assert got == want, case
        assert engine.stats()["kv_pages_used"] == 0, case


def random_params(rng: random.Random) -> SamplingParams:
    """Seeded, with each optional field at its chance (n = 2 and stop ids among them)."""
    kw = dict(temperature=rng.choice([0.0, 0.5, 1.0, 1.5]), seed=rng.randrange(1 << 30), max_tokens=rng.randint(1, 16),
              ignore_eos=True)
    for name, p, value in (("top_p", 0.5, rng.choice([0.5, 0.9])), ("top_k", 0.5, rng.choice([1, 5, 50])),
                           ("min_p", 0.3, 0.05), ("repetition_penalty", 0.3, 1.3), ("presence_penalty", 0.3, 0.5),
                           ("frequency_penalty", 0.3, 0.5), ("n", 0.2, 2),
                           ("logit_bias", 0.2, {rng.randrange(512): 5.0}),
                           ("stop_token_ids", 0.2, [rng.randrange(512) for _ in range(20)]),
                           ("min_tokens", 0.2, min(2, kw["max_tokens"]))):
        if rng.random() < p:
            kw[name] = value
    return SamplingParams(**kw)


@pytest.mark.parametrize("block", range(2))  # ROUNDS / 2 seeds
def test_random_feature_combinations_keep_seeded_draws(references, block):
    for seed in range(block * ROUNDS // 4, (block + 1) * ROUNDS // 4):
        rng = random.Random(10_000 + seed)
        page_size, prompts = random_batch(rng)
        params = [random_params(rng) for _ in prompts]
        fp8 = rng.random() < 0.3
        need = max(len(p) + q.max_tokens for p, q in zip(prompts, params))
        engine, conf = random_engine(rng, page_size, need, fp8)
        got, _ = run_steps(engine, prompts, params)
        want = [alone(references, page_size, fp8, p, q) for p, q in zip(prompts, params)]
        assert got == want, f"seed {10_000 + seed}: {conf}, {params}"
        assert engine.stats()["kv_pages_used"] == 0, conf
