"""The Engine on the tiny Llama preset (CPU): greedy output equals Executor.generate, streaming, abort,
per-request seeds, prefix caching, preemption under a small pool, n > 1, stop ids, non-finite logits,
the thread guard, and AsyncEngine with many coroutines."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pieceworks import AsyncEngine, Engine, SamplingParams
from pieceworks.core.batch import ForwardBatch
from pieceworks.errors import RequestError

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def make(num_tokens: int = 512, page_size: int = 4, **sections) -> Engine:
    cfg = {"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": num_tokens, "page_size": page_size}, **sections}
    return Engine.from_config(cfg, progress=False)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(n, i) for i, n in enumerate((5, 17, 9, 30, 3, 12))]


@pytest.fixture(scope="module")
def engine():
    return make(scheduler={"max_num_batched_tokens": 16})  # prompts prefill in chunks


@pytest.fixture(scope="module")
def reference(engine):
    return engine.executor.generate(PROMPTS, 8)


def drained(engine: Engine) -> None:
    assert not engine.has_unfinished()
    s = engine.stats()
    assert (s["running"], s["waiting"], s["kv_pages_used"]) == (0, 0, 0)
    assert not engine.executor._live  # no sequence handle left


def test_greedy_matches_executor_generate(engine, reference):
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finished and o.finish_reason == "length" and o.text is None for o in outs)
    drained(engine)


def test_model_name_is_the_preset_built(engine):
    assert engine.model_name == "llama-tiny"
    unnamed = Engine.from_config({"model": {"arch": "llama"}, "runtime": {"device": "cpu"},
                                  "kv_cache": {"num_tokens": 64}}, progress=False)
    assert unnamed.model_name == "llama-tiny"  # the preset model.preset=None builds


def test_streaming_one_output_per_token(engine, reference):
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    seen: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    for rid, ref in zip(ids, reference):
        outs = seen[rid]
        assert [o.new_token_ids for o in outs] == [[t] for t in ref]
        assert [o.token_ids for o in outs] == [ref[: i + 1] for i in range(len(ref))]
        assert [o.finished for o in outs] == [False] * (len(ref) - 1) + [True]
    drained(engine)


def test_abort_mid_flight_returns_every_page(engine):
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=50)) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    assert engine.stats()["kv_pages_used"] > 0
    for rid in ids:
        engine.abort(rid)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert all(o.finished and o.finish_reason == "abort" and o.new_token_ids == [] for o in outs)
    drained(engine)


def test_seeded_request_same_tokens_alone_and_batched(engine):
    p = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=10)
    alone = engine.generate([PROMPTS[1]], p)[0].token_ids
    others = [engine.add_request(q, SamplingParams(temperature=0.8, max_tokens=12)) for q in PROMPTS]
    with pytest.raises(RequestError, match="generate needs the engine to itself"):
        engine.generate([PROMPTS[1]], p)  # it would consume the others' outputs
    rid = engine.add_request(PROMPTS[1], p)  # runs while the others run too
    batched, finished = [], set()
    while engine.has_unfinished():
        for o in engine.step():
            batched += o.new_token_ids if o.request_id == rid else []
            finished |= {o.request_id} if o.finished else set()
    assert alone == batched and finished == {*others, rid}
    assert engine.generate([PROMPTS[1]], SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=10))[0].token_ids != alone
    drained(engine)


def test_prefix_cache_same_logits_and_hits_counted():
    on, off = make(), make(kv_cache={"num_tokens": 512, "page_size": 4, "prefix_caching": False})
    system = prompt(22, 7)
    users = [system + prompt(5, 8), system + prompt(9, 9)]
    ex_on, ex_off = on.executor, off.executor
    first = ex_on.new_sequence(users[0])
    assert first.kv_len == 0  # nothing cached yet
    ex_on.forward(ForwardBatch([first], [users[0]]))
    seq = ex_on.new_sequence(users[1])
    assert seq.num_cached_tokens == 20 and seq.pages == first.pages[:5]  # 5 full pages of the system prompt
    assert all(ex_on.kv.allocator.refcount(p) == 2 for p in seq.pages)
    got = ex_on.forward(ForwardBatch([seq], [users[1][20:]], return_all_logits=True))
    ref_seq = ex_off.new_sequence(users[1])
    assert ref_seq.kv_len == 0  # prefix caching off: no sharing
    want = ex_off.forward(ForwardBatch([ref_seq], [users[1]], return_all_logits=True))[20:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for s in (first, seq):
        ex_on.free(s)
    ex_off.free(ref_seq)
    # through the engine: the same greedy tokens, and the hits counted
    outs_on = on.generate(users, GREEDY)
    outs_off = off.generate(users, GREEDY)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    # both prompts were computed above: every full page short of the last token is a hit
    assert [o.num_cached_tokens for o in outs_on] == [24, 28]
    assert [o.num_cached_tokens for o in outs_off] == [0, 0]
    s = on.stats()
    assert s["prefix_cache_hit_tokens"] == 52 and s["prefix_cache_queried_tokens"] == 27 + 31
    assert off.stats()["prefix_cache_hit_tokens"] == 0
    drained(on)


def test_prefix_lookup_hashes_pages_only_while_they_hit(monkeypatch):
    """new_sequence hashes a prompt's pages while they hit: one hash for a prompt that shares nothing,
    hits + 1 for one behind a cached prefix; the keys it keeps are block_keys' for those pages."""
    from pieceworks.executor import kv_cache

    ex = make().executor
    system = prompt(22, 7)
    first_prompt = system + prompt(5, 8)
    first = ex.new_sequence(first_prompt)
    ex.forward(ForwardBatch([first], [first_prompt]))  # caches its 6 full pages
    calls = []
    real = kv_cache._key  # one call per page hashed
    monkeypatch.setattr(kv_cache, "_key", lambda parent, page: calls.append(1) or real(parent, page))
    fresh = ex.new_sequence(prompt(30, 11))
    assert fresh.num_cached_tokens == 0 and len(calls) == 1
    calls.clear()
    user = system + prompt(9, 9)
    seq = ex.new_sequence(user)
    assert seq.num_cached_tokens == 20 and len(calls) == 6  # 5 pages of the system prompt, then the miss
    assert seq.block_keys == kv_cache.block_keys(user, 4)[:5] == first.block_keys[:5]
    for s in (first, fresh, seq):
        ex.free(s)


def test_block_keys_chain_block_key_page_by_page():
    """block_keys (the token ids turned into bytes once) gives the chain of block_key over the pages,
    from any start page and parent; a partial last page has no key."""
    from pieceworks.executor.kv_cache import block_key, block_keys

    toks = prompt(4 * 5 + 3, 12)
    chain, parent = [], None
    for i in range(5):
        parent = block_key(parent, toks[4 * i : 4 * i + 4])
        chain.append(parent)
    assert block_keys(toks, 4) == chain and len(set(chain)) == 5
    assert block_keys(toks, 4, chain[1], start_page=2) == chain[2:]
    assert block_keys(toks[:3], 4) == [] and block_keys(toks, 4, chain[-1], start_page=5) == []
    assert block_keys([t + 1 for t in toks], 4)[0] != chain[0]


def test_prefix_cache_evicts_lru_under_pressure():
    eng = make(num_tokens=64)  # 16 pages of 4
    alloc = eng.executor.kv.allocator
    a, b = prompt(21, 1), prompt(21, 2)
    eng.generate([a], GREEDY)
    eng.generate([b], GREEDY)
    cached = alloc.num_cached
    assert cached >= 10 and alloc.num_used == 0 and alloc.num_free == alloc.capacity
    ref = make(num_tokens=64, kv_cache={"num_tokens": 64, "page_size": 4, "prefix_caching": False})
    c = prompt(40, 3)
    assert eng.generate([c], GREEDY)[0].token_ids == ref.generate([c], GREEDY)[0].token_ids
    assert alloc.num_evicted > 0
    # least recently used first: a's pages went, b's first pages stayed
    assert eng.executor.new_sequence(a).num_cached_tokens == 0
    assert eng.executor.new_sequence(b).num_cached_tokens > 0
    for s in list(eng.executor._live.values()):
        eng.executor.free(s)


def test_preemption_gives_the_same_greedy_tokens():
    prompts = [prompt(7, 20 + i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=9)
    big = make(num_tokens=256)
    small = make(num_tokens=32)  # 8 pages; the batch needs 8 x 4 = 32 at once: 4x too small
    want = [o.token_ids for o in big.generate(prompts, params)]
    got = small.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert small.stats()["num_preemptions"] > 0
    drained(small)


def test_fp8_kv_pool_under_preemption_and_prefix_hits_gives_the_same_greedy_tokens():
    """Over an FP8 pool, recomputed (preempted) and shared (prefix-cache hit) K/V are quantized as they were the
    first time: the same greedy tokens as an unpressured run without sharing."""
    system = prompt(12, 30)
    prompts = [system + prompt(7, 40 + i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=9)
    fp8 = {"page_size": 4, "dtype": "fp8"}
    big = make(kv_cache={"num_tokens": 512, "prefix_caching": False, **fp8})
    small = make(kv_cache={"num_tokens": 48, **fp8})  # 12 pages for 8 prompts of 5 pages each
    assert small.executor.kv.dtype == torch.float8_e4m3fn
    want = [o.token_ids for o in big.generate(prompts, params)]
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    stats = small.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    drained(small)


def test_prompt_logprobs_survive_preemption_mid_prompt(monkeypatch):
    """Requests preempted while their prompt logprobs are partly recorded compute their prompt again and
    record each position once: the same lists (and tokens) as without preemption."""
    prompts = [prompt(11, 40 + i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1)
    want = make(num_tokens=512, scheduler={"max_num_batched_tokens": 6}).generate(prompts, params)
    small = make(num_tokens=32, scheduler={"max_num_batched_tokens": 6})
    mid_prompt = []
    real = small.scheduler._preempt
    monkeypatch.setattr(small.scheduler, "_preempt", lambda r: (mid_prompt.append(
        r.needs_prompt_logits and len(r.prompt_logprobs) > 1), real(r)))
    got = small.generate(prompts, params)
    assert any(mid_prompt), mid_prompt
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and len(g.prompt_logprobs) == len(w.prompt_logprobs)
        assert g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    drained(small)


def _finish_order(eng: Engine, requests: list[tuple[list[int], int]], params: SamplingParams) -> list[str]:
    ids = [eng.add_request(p, params, priority=prio) for p, prio in requests]
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    return [ids.index(r) for r in order]


def test_priority_policy_admits_and_serves_in_priority_order():
    """One sequence per step: requests finish in (priority, arrival) order under policy priority, in
    arrival order under fcfs; the tokens are those of the same requests run alone."""
    reqs = [(PROMPTS[0], 2), (PROMPTS[1], 1), (PROMPTS[2], 0), (PROMPTS[4], 1)]
    eng = make(scheduler={"policy": "priority", "max_num_seqs": 1})
    assert _finish_order(eng, reqs, GREEDY) == [2, 1, 3, 0]
    assert _finish_order(make(scheduler={"max_num_seqs": 1}), [(p, 0) for p, _ in reqs], GREEDY) == [0, 1, 2, 3]
    drained(eng)


def test_priority_policy_preempts_the_lowest_priority(monkeypatch):
    """Under a pool too small for all, the request preempted is always the lowest-priority one running
    (here admitted before the others arrived), and greedy tokens stay those of an unconstrained run."""
    prompts = [prompt(7, 60 + i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=9)
    want = [o.token_ids for o in make(num_tokens=256).generate(prompts, params)]
    small = make(num_tokens=32, scheduler={"policy": "priority"})
    victims = []
    real = small.scheduler._preempt

    def preempt(req):
        victims.append((req.priority, max(r.priority for r in small.scheduler.running)))
        real(req)

    monkeypatch.setattr(small.scheduler, "_preempt", preempt)
    ids = [small.add_request(p, params, priority=2) for p in prompts[:3]]
    small.step()
    small.step()  # the low-priority requests run before the others arrive
    ids += [small.add_request(p, params, priority=i % 2) for i, p in enumerate(prompts[3:])]
    done = {}
    while small.has_unfinished():
        done |= {o.request_id: o.token_ids for o in small.step() if o.finished}
    assert victims and all(mine == lowest for mine, lowest in victims), victims
    assert [done[i] for i in ids] == want
    drained(small)


def test_async_engine_takes_a_priority(reference):
    eng = make(scheduler={"policy": "priority"})

    async def main(aeng):
        return [o async for o in aeng.generate(PROMPTS[0], GREEDY, priority=-3)]

    with AsyncEngine(eng) as aeng:
        outs = asyncio.run(main(aeng))
    assert outs[-1].finished and outs[-1].token_ids == reference[0]


def test_priority_needs_the_priority_policy(engine):
    for bad, needle in ((1, "scheduler.policy is fcfs"), (True, "must be an int"), (1.0, "must be an int")):
        with pytest.raises(RequestError, match=needle):
            engine.add_request(PROMPTS[0], GREEDY, priority=bad)
    assert not engine.has_unfinished()


def test_n_completions_share_the_prompt_pages(engine):
    p = prompt(13, 5)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    outs = engine.generate([p], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    assert [o.index for o in outs] == [0, 1, 2] and len({o.request_id for o in outs}) == 1
    assert len({tuple(o.token_ids) for o in outs}) == 3  # each its own stream
    assert [o.num_cached_tokens for o in outs][1:] == [12, 12]
    assert engine.stats()["prefix_cache_hit_tokens"] - hits >= 24
    one = engine.generate([p], SamplingParams(n=1, temperature=1.0, seed=6, max_tokens=6))[0]
    assert one.token_ids == outs[1].token_ids  # completion 1 draws from seed + 1
    drained(engine)


def test_a_request_lives_until_its_last_completion_finishes(engine):
    p = prompt(13, 5)
    full = engine.generate([p], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    stop = full[1].token_ids[0]  # completion 1 stops at its first token; 0 and 2 run on
    assert stop not in full[0].token_ids[:3] + full[2].token_ids[:3]
    rid = engine.add_request(p, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, stop_token_ids=[stop]))
    done: list[int] = []
    while 1 not in done:
        done += [o.index for o in engine.step() if o.finished]
    assert done == [1] and engine.has_unfinished()
    engine.step()
    engine.abort(rid)
    outs = engine.step()
    assert sorted((o.index, o.finish_reason) for o in outs) == [(0, "abort"), (2, "abort")]
    assert all(0 < len(o.token_ids) < 6 and o.token_ids == full[o.index].token_ids[: len(o.token_ids)] for o in outs)
    drained(engine)


def test_finished_requests_are_freed_without_the_garbage_collector(engine):
    """A request's n completions share one group list that holds them: a finished, aborted or stopped completion leaves
    it, so nothing of a finished request waits for a gc pass (its prompt copies, detokenizer, grammar matcher)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        kept = []
        for i, n in enumerate((1, 3, 2)):
            rid = engine.add_request(prompt(9, 40 + i), SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=5))
            kept += [weakref.ref(r) for r in engine._requests[rid]]
            if i == 2:
                engine.step()
                engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        assert [r() for r in kept] == [None] * len(kept)
    finally:
        gc.enable()
    drained(engine)


def test_admission_passes_a_completion_waiting_for_its_prompt(engine):
    """Completion 1 waits in the queue until completion 0 computed the prompt; the request behind it is
    admitted past it in the same step and leaves the queue, completion 1 stays at its front and runs next;
    every output is what it is alone."""
    p, q = prompt(13, 5), PROMPTS[0]
    pair = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=4)
    want_pair = [o.token_ids for o in engine.generate([p], pair)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    want_q = engine.generate([q], greedy)[0].token_ids
    drained(engine)
    engine.add_request(p, pair)
    engine.add_request(q, greedy)
    waiting = engine.scheduler.waiting
    first, second, later = waiting
    finished = [o for o in engine.step() if o.finished]
    assert list(waiting) == [second] and engine.scheduler.running == [first, later]
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    got = {(o.index if o.prompt_token_ids == p else "q"): o.token_ids for o in finished}
    assert got == {0: want_pair[0], 1: want_pair[1], "q": want_q}
    drained(engine)


def test_stop_ids_eos_and_length(engine, reference):
    first, second = reference[0][:2]
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[second]))[0]
    assert out.token_ids == [first, second] and out.finish_reason == "stop"
    engine.eos_token_ids = frozenset([first])
    try:
        assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == [first]
        assert engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids == reference[0]
        assert engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, min_tokens=3))[0].token_ids[:1] != [first]
    finally:
        engine.eos_token_ids = frozenset()
    short = make(model={"arch": "llama", "preset": "tiny", "max_context": 12})
    out = short.generate([PROMPTS[1][:9]], SamplingParams(temperature=0, max_tokens=None))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_logit_bias_steers_greedy_requests_next_to_plain_ones(engine, reference):
    """A banned token is never generated, the one it leaves is forced, and the request without a bias
    in the same steps (async steps, the decode rows' shared argmax) keeps its tokens."""
    first = reference[0][0]
    forced = (first + 1) % 512
    biased = [SamplingParams(temperature=0, max_tokens=8, logit_bias={first: -100.0}),
              SamplingParams(temperature=0, max_tokens=8, logit_bias={forced: 100.0})]
    outs = [engine.generate([PROMPTS[0]], p)[0] for p in biased]
    assert first not in outs[0].token_ids and outs[0].token_ids != reference[0]
    assert outs[1].token_ids == [forced] * 8
    ids = [engine.add_request(PROMPTS[0], biased[1]), engine.add_request(PROMPTS[1], GREEDY)]
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert [done[i] for i in ids] == [[forced] * 8, reference[1]]
    drained(engine)


def test_allowed_token_ids_end_to_end(engine, reference):
    allowed = sorted(set(range(20)) - set(reference[0]))[:4]
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed))[0]
    assert len(out.token_ids) == 8 and set(out.token_ids) <= set(allowed)
    out = engine.generate([PROMPTS[0]], SamplingParams(seed=3, max_tokens=8, allowed_token_ids=allowed))[0]
    assert set(out.token_ids) <= set(allowed)
    drained(engine)


def _scored(engine, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every prompt position, one forward of the whole prompt."""
    seq = engine.executor.new_sequence()
    try:
        return engine.executor.forward(ForwardBatch([seq], [prompt], True)).log_softmax(-1)
    finally:
        engine.executor.free(seq)


@pytest.mark.parametrize("caching", [False, True])
def test_prompt_logprobs_match_one_scoring_forward(caching, monkeypatch):
    """Over chunked prefill (16-token steps, scored in blocks of 5 rows), next to a request without them that
    runs on, with and without prefix caching (a cached prefix of the same prompt is computed again): the
    prompt token's logprob and the top k at every position; the first entry None; the generated tokens
    unchanged."""
    from pieceworks.engine import logprobs

    monkeypatch.setattr(logprobs, "PROMPT_ROWS_PER_PASS", 5)
    eng = make(scheduler={"max_num_batched_tokens": 16}, kv_cache={"num_tokens": 512, "page_size": 4,
                                                                   "prefix_caching": caching})
    prompt = PROMPTS[3]  # 30 tokens: two chunks
    plain = eng.generate([prompt], GREEDY)[0]  # fills the prefix cache when it is on
    other = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20))
    eng.step()
    eng.step()  # the other request runs (and decodes asynchronously) when the scoring one arrives
    scored = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.prompt_logprobs is None or o.request_id == scored
            if o.finished:
                done[o.request_id] = o
    out, ref = done[scored], _scored(eng, prompt)
    assert out.token_ids == plain.token_ids and out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        d = out.prompt_logprobs[j]
        assert d[prompt[j]] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-5)
        top2 = ref[j - 1].topk(2).indices.tolist()
        assert set(d) == {prompt[j], *top2}
    assert done[other].token_ids == engine_reference(PROMPTS[1], 20)
    drained(eng)


def test_prompt_logprobs_keep_the_pipeline_running():
    """Scoring requests among sampling ones, with chunked prefill: every step runs asynchronously (a step
    whose rows give prompt logprobs reads them before sampling, the pipeline goes on), and the tokens and
    prompt logprobs are those of synchronous steps."""
    def run(eng: Engine) -> list:
        ids, final = [], {}
        for i, p in enumerate(PROMPTS):
            scored = i % 2 == 1
            ids.append(eng.add_request(p, SamplingParams(temperature=0 if scored else 0.8, seed=i, max_tokens=6,
                                                         prompt_logprobs=2 if scored else None)))
            final |= {o.request_id: o for o in eng.step() if o.finished}
        while eng.has_unfinished():
            final |= {o.request_id: o for o in eng.step() if o.finished}
        drained(eng)
        return [final[i] for i in ids]

    sync_eng = make(scheduler={"max_num_batched_tokens": 16, "async_steps": False})
    want, async_eng = run(sync_eng), make(scheduler={"max_num_batched_tokens": 16})
    got = run(async_eng)
    stats = async_eng.stats()
    assert stats["num_async_steps"] == stats["num_steps"] > 10 and sync_eng.stats()["num_async_steps"] == 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        for a, b in zip(g.prompt_logprobs or [], w.prompt_logprobs or []):
            assert a == b or (a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a))


def test_prompt_logits_steps_are_capped(monkeypatch):
    """A request's prompt chunks carry at most PROMPT_LOGITS_STEP_TOKENS tokens while its prompt logprobs
    are computed (each returns that many logits rows), whatever the step budget; the logprobs are the same."""
    from pieceworks.engine import scheduler

    monkeypatch.setattr(scheduler, "PROMPT_LOGITS_STEP_TOKENS", 7)
    eng = make(scheduler={"max_num_batched_tokens": 64})
    sizes, real = [], eng.executor.forward

    def forward(batch, **kw):
        if isinstance(batch.return_all_logits, list):
            sizes.extend(len(t) for t, a in zip(batch.tokens, batch.return_all_logits) if a)
        return real(batch, **kw)

    monkeypatch.setattr(eng.executor, "forward", forward)
    prompt = PROMPTS[3]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert sizes == [7, 7, 7, 7, 2], sizes
    ref = _scored(eng, prompt)
    assert [d[t] for d, t in zip(out.prompt_logprobs[1:], prompt[1:])] == pytest.approx(
        [float(ref[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=1e-5)
    drained(eng)


def engine_reference(prompt: list[int], n: int) -> list[int]:
    return make().executor.generate([prompt], n)[0]


def test_prompt_logprobs_with_n_and_abort(engine):
    outs = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=0))
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs and len(outs[0].prompt_logprobs) == len(PROMPTS[0])
    assert all(len(d) == 1 for d in outs[0].prompt_logprobs[1:])  # k = 0: the prompt token's own only
    rid = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine.step()
    engine.abort(rid)
    assert rid not in {r.request_id for r in [*engine.scheduler.waiting, *engine.scheduler.running]}
    while engine.has_unfinished():
        engine.step()
    drained(engine)


def test_non_finite_prompt_logprobs_fail_their_request(engine, monkeypatch, reference):
    """An inf in the logits of one prompt position (not the sampled row): the request asked for its prompt
    logprobs, which would carry NaN; it fails as a non-finite sampled row does, naming the position."""
    ex, prompt = engine.executor, PROMPTS[1]
    real = ex.model.compute_logits

    def poisoned(hidden):
        logits = real(hidden)
        if logits.shape[0] > 1:  # a step that scores prompt rows: its row 3 predicts prompt position 4
            logits[3, 7] = float("inf")
        return logits

    monkeypatch.setattr(ex.model, "compute_logits", poisoned)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    monkeypatch.setattr(ex.model, "compute_logits", real)
    assert out.finish_reason == "error" and out.token_ids == [], out
    assert out.error.endswith("NaN or inf logits at prompt position 4 (its prompt_logprobs)"), out.error
    drained(engine)


def test_logprobs_passed_through(engine, reference):
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
    assert out.token_ids == reference[0][:3] and len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and max(lp.values()) == lp[tok] and 2 <= len(lp) <= 3


def test_non_finite_logits_fail_only_their_request(engine, monkeypatch, reference):
    ex = engine.executor
    real = ex.model.compute_logits
    bad_row = {"i": 0}

    def poisoned(hidden):
        logits = real(hidden)
        logits[bad_row["i"]] = float("nan")
        return logits

    monkeypatch.setattr(ex.model, "compute_logits", poisoned)
    a = engine.add_request(PROMPTS[0], GREEDY)
    b = engine.add_request(PROMPTS[2], GREEDY)
    outs = engine.step()  # both prompts fit one 16-token step; row 0 is a's
    monkeypatch.setattr(ex.model, "compute_logits", real)
    while not outs:  # async steps: that step's tokens come with the next call
        outs = engine.step()
    by_id = {o.request_id: o for o in outs}
    assert by_id[a].finish_reason == "error" and "NonFiniteLogits" in by_id[a].error and by_id[a].token_ids == []
    assert by_id[a].error_param is None  # the engine's fault, not the request's
    assert not by_id[b].finished
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert rest[-1].request_id == b and rest[-1].token_ids == reference[2]
    drained(engine)


def test_bad_requests_refused(engine):
    for kwargs, needle in [
        ({"prompt": []}, "empty"),
        ({"prompt": [1, 600]}, "vocabulary"),
        ({"prompt": "hello"}, "needs a tokenizer"),
        ({"prompt": [1], "params": SamplingParams(stop=["x"])}, "needs a tokenizer"),
        ({"prompt": [1] * 510, "params": GREEDY}, "context limit"),
        ({"prompt": [1], "params": {"temperature": 0}}, "SamplingParams"),
        ({"prompt": b"hi"}, "got bytes"),  # would iterate as the ids 104, 105
        ({"prompt": {5: "a", 7: "b"}}, "got dict"),
        ({"prompt": {9, 3, 7}}, "got set"),
        ({"prompt": [1] * engine.max_context, "params": SamplingParams(max_tokens=None)}, "no room"),
        ({"prompt": [1] * 10, "params": SamplingParams(max_tokens=None, min_tokens=engine.max_context - 9)},
         rf"min_tokens: prompt \(10 tokens\) \+ min_tokens \({engine.max_context - 9}\) exceed the context limit"),
        ({"prompt": [1], "params": SamplingParams(logit_bias={3: 1.0, 512: 5.0})}, r"logit_bias: token ids \[512\]"),
        ({"prompt": [1], "params": SamplingParams(allowed_token_ids=[600, 2])},
         r"allowed_token_ids: token ids \[600\]"),
        ({"prompt": [1], "params": SamplingParams(stop_token_ids=[2, 10**9])},
         r"stop_token_ids: token ids \[1000000000\] are outside the vocabulary \[0, 512\)"),
        ({"prompt": [1], "params": SamplingParams(allowed_token_ids=[3], stop_token_ids=[3], min_tokens=1)},
         "no token could be generated"),
    ]:
        with pytest.raises(RequestError, match=needle):
            engine.add_request(**kwargs)
    engine.add_request([1, 2], GREEDY, request_id="dup")
    with pytest.raises(RequestError, match="already running"):
        engine.add_request([1, 2], GREEDY, request_id="dup")
    with pytest.raises(RequestError, match="abort takes one request id"):
        engine.abort(["dup"])
    engine.abort("dup")
    with pytest.raises(RequestError, match="just aborted"):  # its abort output would mix into the new one's
        engine.add_request([1, 2], GREEDY, request_id="dup")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("dup", "abort")]
    engine.add_request([1, 2], GREEDY, request_id="dup")  # free again once the step returned it
    engine.abort("dup")
    engine.step()
    drained(engine)


def test_generate_and_the_constructor_refuse_what_they_cannot_use(engine):
    """generate names what it was given instead of a TypeError from iterating it (or, for bytes and sets,
    a message about their elements); a dict for params and a tokenizer without decode are refused up front."""
    for bad, name in [(None, "NoneType"), (5, "int"), (torch.tensor(3), "Tensor"), (b"ab", "bytes"), ({1, 2}, "set")]:
        with pytest.raises(RequestError, match=f"prompts must be .* got {name}$"):
            engine.generate(bad)
    with pytest.raises(RequestError, match="params must be a SamplingParams, got dict"):
        engine.generate([[1, 2]], {"temperature": 0})
    with pytest.raises(TypeError, match="tokenizer must be"):
        Engine(engine.executor, tokenizer=5)

    async def unhashable_id() -> None:
        with AsyncEngine(engine) as aeng:
            with pytest.raises(RequestError, match="request_id must be a non-empty str, got \\['a'\\]"):
                async for _ in aeng.generate([1, 2], GREEDY, request_id=["a"]):
                    pass

    asyncio.run(unhashable_id())
    got = engine.generate(torch.tensor([PROMPTS[0], PROMPTS[4] + [1, 2]]), GREEDY)  # 2-D: one prompt per row
    assert [o.prompt_token_ids for o in got] == [PROMPTS[0], PROMPTS[4] + [1, 2]]
    drained(engine)


def test_an_edited_output_prompt_changes_nothing(engine, reference):
    """Outputs carry a copy of the request's prompt (one per request, shared by its outputs): a caller
    appending to it leaves the request computing what it did."""
    rid = engine.add_request(PROMPTS[0], GREEDY)
    firsts = []
    while not firsts:  # async steps: the first token comes with the second call
        firsts = engine.step()
    first = firsts[0]
    first.prompt_token_ids.append(10**6)
    outs = [first]
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].request_id == rid and outs[-1].token_ids == reference[0][: len(outs[-1].token_ids)]
    assert len(outs[-1].token_ids) == GREEDY.max_tokens
    drained(engine)


def test_a_numpy_prompt_is_one_prompt(engine, reference):
    import numpy as np

    outs = engine.generate(np.array(PROMPTS[0]), GREEDY)
    assert len(outs) == 1 and outs[0].token_ids == reference[0]
    drained(engine)


def test_async_engine_survives_a_prompt_its_engine_refuses_with_any_error(engine, monkeypatch):
    """A request that add_request refuses with another error than RequestError (a tokenizer's own TypeError,
    say) fails alone: the step loop goes on serving the next request."""
    real = engine.add_request

    def refuse_once(prompt, *a, **kw):
        if prompt == [7, 7, 7]:
            raise TypeError("TextEncodeInput must be Union[...]")
        return real(prompt, *a, **kw)

    monkeypatch.setattr(engine, "add_request", refuse_once)

    async def main(aeng):
        async def one(p):
            return [o async for o in aeng.generate(p, GREEDY)]
        bad = await asyncio.gather(one([7, 7, 7]), return_exceptions=True)
        return bad[0], await one(PROMPTS[0])

    with AsyncEngine(engine) as aeng:
        bad, good = asyncio.run(main(aeng))
        with pytest.raises(RequestError, match="abort takes one request id"):
            asyncio.run(aeng.abort(["x"]))
    assert isinstance(bad, TypeError) and good[-1].finished
    drained(engine)


def test_second_thread_is_refused_never_wrong(engine, monkeypatch, reference):
    ex = engine.executor
    real = ex.model.compute_logits
    inside, release = threading.Event(), threading.Event()

    def slow(hidden):
        inside.set()
        release.wait(30)
        return real(hidden)

    monkeypatch.setattr(ex.model, "compute_logits", slow)
    result = {}
    worker = threading.Thread(target=lambda: result.update(outs=engine.generate(PROMPTS[:2], GREEDY)))
    worker.start()
    assert inside.wait(30)
    for call in (lambda: engine.step(), lambda: engine.add_request([1], GREEDY), lambda: ex.new_sequence(),
                 lambda: ex.forward(ForwardBatch([], []))):
        with pytest.raises(RuntimeError, match="another thread"):
            call()
    release.set()
    worker.join(60)
    monkeypatch.setattr(ex.model, "compute_logits", real)
    assert [o.token_ids for o in result["outs"]] == reference[:2]
    drained(engine)


def test_threads_racing_on_forward_get_refusals_or_right_logits(engine):
    ex = engine.executor
    toks = [PROMPTS[3], PROMPTS[1]]
    want = []
    for t in toks:
        s = ex.new_sequence()
        want.append(ex.forward(ForwardBatch([s], [t])))
        ex.free(s)
    counts = {"ok": 0, "refused": 0}
    errors = []

    def refused(exc: BaseException) -> bool:
        return isinstance(exc, RuntimeError) and "another thread" in str(exc)

    def hammer(t, w):
        # every outcome but a right result or the thread guard's refusal lands in `errors` (an exception
        # escaping a thread would only be a warning)
        for _ in range(15):
            s = None
            try:
                s = ex.new_sequence()
                got = ex.forward(ForwardBatch([s], [t]))
                torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
                counts["ok"] += 1
            except BaseException as exc:
                if not refused(exc):
                    errors.append(exc)
                counts["refused"] += 1
            finally:
                while s is not None:
                    try:
                        ex.free(s)
                        s = None
                    except BaseException as exc:
                        if not refused(exc):
                            errors.append(exc)
                            break
    threads = [threading.Thread(target=hammer, args=(t, w)) for t, w in zip(toks, want)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads) and not errors and counts["ok"] > 0, errors
    drained(engine)


async def until_idle(aeng: AsyncEngine) -> None:
    """Wait (up to 2 s) until the loop thread has no request left, aborts included."""
    for _ in range(200):
        if not aeng.engine.has_unfinished():
            return
        await asyncio.sleep(0.01)


def run_with_step(engine: Engine, monkeypatch, step, main) -> AsyncEngine:
    """`main(aeng)` under an AsyncEngine whose engine steps through `step`; the engine is drained afterwards."""
    monkeypatch.setattr(engine, "step", step)
    with AsyncEngine(engine) as aeng:
        asyncio.run(main(aeng))
    monkeypatch.undo()
    drained(engine)
    return aeng


def test_async_engine_32_coroutines_and_cancellation(engine):
    prompts = [prompt(3 + i % 11, 100 + i) for i in range(32)]
    want = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))]

    async def one(aeng, p):
        outs = [o async for o in aeng.generate(p, SamplingParams(temperature=0, max_tokens=6))]
        assert len(outs) == 6 and outs[-1].finished
        return outs[-1].token_ids

    async def cancelled(aeng):
        got = []

        async def consume():
            async for o in aeng.generate(prompts[0], SamplingParams(temperature=0, max_tokens=400), "long"):
                got.append(o)
                if len(got) == 2:
                    started.set()
        started = asyncio.Event()
        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    async def main(aeng):
        results = await asyncio.gather(*(one(aeng, p) for p in prompts))
        got = await cancelled(aeng)
        await until_idle(aeng)  # the loop thread processes the abort between steps
        return results, got

    with AsyncEngine(engine) as aeng:
        results, got = asyncio.run(main(aeng))
        assert results == want
        assert 2 <= len(got) < 400
        s = aeng.stats()
        assert (s["running"], s["waiting"], s["kv_pages_used"]) == (0, 0, 0)
    drained(engine)


def test_async_engine_reuses_the_id_of_a_cancelled_stream_at_once(engine, monkeypatch):
    """A stream cancelled, then a new one under its id before the loop thread has stepped past the abort: the new
    request runs (not refused as "just aborted") and never reads the old request's abort output, even when the
    step that returns that output runs after the new stream registered."""
    real_step, new_registered, holding = engine.step, threading.Event(), []

    def step():  # the step that carries the abort of "x" waits until the new stream of "x" is registered
        if any(o.request_id == "x" for o in engine._ready) and not holding:
            holding.append(True)
            new_registered.wait(10)
        return real_step()

    async def main(aeng):
        want = [o async for o in aeng.generate(PROMPTS[0], GREEDY, "y")][-1].token_ids
        for hold in (False, True):
            holding[:] = [True] if not hold else []
            old = aeng.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=400), "x")
            await anext(old)
            await old.aclose()  # posts the abort of "x"
            if hold:
                for _ in range(500):  # the loop thread takes the abort and waits inside its step
                    if holding:
                        break
                    await asyncio.sleep(0.01)
                assert holding
            new = aeng.generate(PROMPTS[0], GREEDY, "x")
            first = asyncio.ensure_future(anext(new))
            await asyncio.sleep(0.05)  # the new stream is registered (its add is a command)
            new_registered.set()
            outs = [await first] + [o async for o in new]
            assert [o.finish_reason for o in outs] == [None] * 7 + ["length"], (hold, outs[-1])
            assert outs[-1].token_ids == want
            new_registered.clear()
        await until_idle(aeng)

    run_with_step(engine, monkeypatch, step, main)


def test_async_engine_forgets_a_stream_cancelled_before_its_add(engine, monkeypatch):
    """A stream cancelled while its add still waits for the loop thread (held in a step): its request is added and
    aborted, and the engine's bookkeeping keeps no entry of it."""
    real_step, release = engine.step, threading.Event()

    def step():
        release.wait(10)
        return real_step()

    async def main(aeng):
        busy_stream = aeng.generate(PROMPTS[1], GREEDY, "busy")
        busy = asyncio.ensure_future(anext(busy_stream))
        await asyncio.sleep(0.1)  # the loop thread waits inside the busy request's step
        late = asyncio.ensure_future(anext(aeng.generate(PROMPTS[0], GREEDY, "late")))
        await asyncio.sleep(0.05)
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        release.set()
        await busy
        await busy_stream.aclose()
        await until_idle(aeng)

    aeng = run_with_step(engine, monkeypatch, step, main)
    assert aeng._added == {} and aeng._streams == {}


def test_async_engine_errors_reach_every_waiter(engine, monkeypatch):
    ex = engine.executor

    def broken(hidden):
        raise RuntimeError("kernel exploded")

    async def main(aeng):
        async def one(p):
            return [o async for o in aeng.generate(p, GREEDY)]
        return await asyncio.gather(*(one(p) for p in PROMPTS[:4]), return_exceptions=True)

    monkeypatch.setattr(ex.model, "compute_logits", broken)
    aeng = AsyncEngine(engine)
    results = asyncio.run(main(aeng))
    monkeypatch.undo()
    assert all(isinstance(r, RuntimeError) and "kernel exploded" in str(r) for r in results)
    async def again():
        return [o async for o in aeng.generate(PROMPTS[0], GREEDY)]

    with pytest.raises(RuntimeError, match="step loop failed"):
        asyncio.run(again())
    aeng.shutdown()
    drained(engine)


def test_from_config_leaves_the_global_rng_alone_and_weights_follow_the_seed():
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    a = make()
    assert torch.equal(torch.rand(4), want)  # building did not reseed the process-wide RNG
    b, c = make(), make(runtime={"device": "cpu", "dtype": "float32", "seed": 1})
    pa, pb, pc = (dict(e.executor.model.named_parameters()) for e in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)  # same seed, same weights
    assert not torch.equal(pa["embed_tokens.weight"], pc["embed_tokens.weight"])


def test_free_never_leaves_a_handle_live(engine, monkeypatch):
    ex = engine.executor
    seq = ex.new_sequence()
    ex.forward(ForwardBatch([seq], [PROMPTS[0]]))
    pages = list(seq.pages)

    def broken(pages):
        raise ValueError("allocator failed")

    monkeypatch.setattr(ex.kv.allocator, "free", broken)
    with pytest.raises(ValueError, match="allocator failed"):
        ex.free(seq)
    monkeypatch.undo()
    assert seq.freed and seq.pages == [] and seq.id not in ex._live
    with pytest.raises(Exception, match="already freed"):
        ex.free(seq)
    ex.kv.allocator.free(pages)  # what the failed call could not give back
    drained(engine)


def test_max_num_seqs_and_batched_tokens_bound_every_step(reference):
    eng = make(scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 8})
    seen = []
    real = eng.executor.forward

    def spy(batch, **kw):
        seen.append((len(batch.seqs), sum(map(len, batch.tokens))))
        return real(batch, **kw)

    eng.executor.forward = spy
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert max(n for n, _ in seen) == 2 and max(t for _, t in seen) == 8
    drained(eng)


def test_prompts_as_tensors_and_numpy_ints(engine, reference):
    import numpy as np

    assert engine.generate(torch.tensor(PROMPTS[0]), GREEDY)[0].token_ids == reference[0]
    assert engine.generate([np.array(PROMPTS[1])], GREEDY)[0].token_ids == reference[1]
    with pytest.raises(RequestError, match="1-D integer"):
        engine.add_request(torch.tensor([1.0, 2.0]), GREEDY)
    drained(engine)


def test_prompt_ids_checked_on_every_path(engine, reference):
    """Plain int lists take a min / max check, other lists and tensors the per-id one: the same refusals
    (bools, ids outside the vocabulary, complex tensors) and the same accepted prompts either way."""
    import numpy as np

    vocab = engine.executor.vocab_size
    for bad, needle in (([1, True, 2], r"\[True\]"), ([3, vocab, -1], rf"\[{vocab}, -1\]"),
                        ([np.int64(3), vocab], rf"\[{vocab}\]"), (torch.tensor([1, vocab]), rf"\[{vocab}\]")):
        with pytest.raises(RequestError, match=needle):
            engine.add_request(bad, GREEDY)
    with pytest.raises(RequestError, match="1-D integer"):
        engine.add_request(torch.tensor([1 + 0j]), GREEDY)
    assert not engine.has_unfinished()
    mixed = [np.int64(t) if i % 2 else t for i, t in enumerate(PROMPTS[2])]
    assert engine.generate([mixed], GREEDY)[0].token_ids == reference[2]
    drained(engine)


def test_pages_held_outside_the_engine_raise_out_of_pages():
    from pieceworks.errors import OutOfPages

    eng = make(num_tokens=32)
    outside = eng.executor.new_sequence()
    eng.executor.forward(ForwardBatch([outside], [prompt(29, 1)]))  # 8 of 8 pages
    eng.add_request(prompt(5, 2), GREEDY)
    with pytest.raises(OutOfPages, match="outside this engine"):
        eng.step()
    eng.executor.free(outside)
    finals = []
    while eng.has_unfinished():
        finals += [o for o in eng.step() if o.finished]
    assert [len(o.token_ids) for o in finals] == [8]  # the refused step's request runs once the pages are back
    assert len(eng.generate([prompt(5, 3)], GREEDY)[0].token_ids) == 8
    drained(eng)


def test_close_drops_requests_releases_the_executor_and_refuses_later_calls():
    """Engine.close (and leaving a `with` block) drops unfinished requests, closes the executor (its
    weights are freed) and refuses add_request and step with a message that says so."""
    import weakref

    with make() as eng:
        eng.add_request(PROMPTS[0], GREEDY)
        eng.step()
        weight = weakref.ref(eng.executor.model.embed_tokens.weight)
    assert weight() is None and eng.executor.closed and not eng.has_unfinished()
    with pytest.raises(RuntimeError, match="this Engine is closed"):
        eng.add_request(PROMPTS[1], GREEDY)
    with pytest.raises(RuntimeError, match="this Engine is closed"):
        eng.step()
    eng.close()  # idempotent


def test_step_token_budget(engine, monkeypatch):
    """A configured max_num_batched_tokens is kept; unset, 2048 on a CPU and a GPU under 70 GiB, 8192 from 70."""
    from pieceworks.engine import scheduler

    assert engine.scheduler.cfg.max_num_batched_tokens == 16
    assert make().scheduler.cfg.max_num_batched_tokens == 2048
    for gib, want in ((24, 2048), (69.9, 2048), (70, 8192), (141, 8192)):
        props = type("Props", (), {"total_memory": int(gib * 2**30)})
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, p=props: p)
        assert scheduler.default_step_tokens(torch.device("cuda", 0)) == want
