"""The Engine's async steps (`scheduler.async_steps`) on CPU, through the decode runner's host path
(`EagerDecodeRunner`): greedy outputs equal the synchronous engine's for different max_tokens, EOS and
stop ids, requests added mid-run, aborts while a step is in flight, a pool 4x too small (preemption)
and prefix caching, and under AsyncEngine; every step streams at most one token per request; all pages
come back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pieceworks import AsyncEngine, Engine, Executor, SamplingParams
from pieceworks.executor.cuda_graph import EagerDecodeRunner


def make(async_steps: bool, num_tokens: int = 512, prefix_caching: bool = True, decode_runner: bool = True) -> Engine:
    cfg = {"model": {"arch": "llama", "preset": "tiny", "max_context": 128},
           "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": num_tokens, "page_size": 4, "prefix_caching": prefix_caching},
           "scheduler": {"async_steps": async_steps, "max_num_batched_tokens": 24}}
    ex = Executor.from_config(cfg, progress=False)
    if decode_runner:
        ex.decode_graphs = EagerDecodeRunner(ex.model, ex.table, ex.kv, ex.max_context, [1, 2, 4, 8])
    return Engine(ex, tokenizer=None)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(eng: Engine, first: list[tuple[str, list[int], SamplingParams]],
        later: list[tuple[str, list[int], SamplingParams]] = (), add_after: int = 0,
        abort: tuple[str, int] | None = None) -> dict[str, tuple[list[int], str]]:
    """Drive `eng` step by step: `first` added at once, `later` once `add_after` tokens have streamed,
    `abort` = (request id, after that many of its tokens). Checks the streaming contract on every step;
    returns each request's (token ids, finish reason)."""
    forward = eng.executor.forward

    def checked_forward(batch, **kw):  # no step feeds a token past max_tokens: the last one never runs
        reqs = {id(r.seq): r for r in eng.scheduler.running}
        for seq, toks in zip(batch.seqs, batch.tokens):
            r = reqs[id(seq)]
            assert seq.kv_len + len(toks) <= len(r.prompt) + r.params.max_tokens - 1
        return forward(batch, **kw)

    eng.executor.forward = checked_forward
    for rid, p, sp in first:
        eng.add_request(p, sp, rid)
    streamed: dict[str, list[int]] = {}
    final: dict[str, tuple[list[int], str]] = {}
    pending = list(later)
    steps = 0
    while eng.has_unfinished():
        outs = eng.step()
        steps += 1
        assert steps < 500
        assert len({o.request_id for o in outs}) == len(outs)  # one output per request per step
        for o in outs:
            assert len(o.new_token_ids) <= 1 and all(t >= 0 for t in o.token_ids)
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert streamed[o.request_id] == o.token_ids  # the deltas add up to the tokens
            if o.finished:
                final[o.request_id] = (o.token_ids, o.finish_reason)
        total = sum(map(len, streamed.values()))
        if pending and total >= add_after:
            for rid, p, sp in pending:
                eng.add_request(p, sp, rid)
            pending = []
        if abort is not None and len(streamed.get(abort[0], [])) >= abort[1]:
            eng.abort(abort[0])
            abort = None
    s = eng.stats()
    assert (s["running"], s["waiting"], s["kv_pages_used"]) == (0, 0, 0)
    assert not eng.executor._live
    if not eng.executor.cfg.scheduler.async_steps:
        assert s["num_async_steps"] == 0
    return final


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


BATCH = [(f"r{i}", prompt(n, i), greedy(m, ignore_eos=True))
         for i, (n, m) in enumerate([(3, 9), (11, 4), (6, 17), (17, 7), (2, 12), (9, 1)])]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_different_max_tokens_and_mid_run_adds_match_sync(prefix_caching):
    shared = prompt(13, 50)  # later requests share a prefix with each other (prefix cache hits)
    later = [(f"l{i}", shared + prompt(3 + i, 60 + i), greedy(6 + 2 * i, ignore_eos=True)) for i in range(3)]
    sync = run(make(False, prefix_caching=prefix_caching), BATCH, later, add_after=12)
    eng = make(True, prefix_caching=prefix_caching)
    got = run(eng, BATCH, later, add_after=12)
    assert got == sync
    assert [len(got[rid][0]) for rid, _, _ in BATCH] == [9, 4, 17, 7, 12, 1]
    stats = eng.stats()  # every step async, those with prompt chunks (24-token budget) too: no preemption here
    assert stats["num_async_steps"] == stats["num_steps"] >= 10
    assert eng.executor.decode_graphs.staging._rows  # decode steps went through the runner
    if prefix_caching:
        assert eng.stats()["prefix_cache_hit_tokens"] > 0


def test_eos_and_stop_ids_match_sync():
    ref = run(make(False), BATCH)
    # a token generated mid-way by two requests becomes the EOS id, another one a stop id
    eos, stop = ref["r2"][0][5], ref["r4"][0][3]
    batch = [(rid, p, greedy(sp.max_tokens, stop_token_ids=[stop])) for rid, p, sp in BATCH]
    results = []
    for async_steps in (False, True):
        eng = make(async_steps)
        eng.eos_token_ids = frozenset({eos})  # read by add_request and the stop check
        results.append(run(eng, batch))
    sync, got = results
    assert eng.stats()["num_async_steps"] >= 5
    assert got == sync
    assert sum(reason == "stop" for _, reason in got.values()) >= 2


def test_abort_while_a_step_is_in_flight_returns_all_pages():
    ref = run(make(False), BATCH)
    eng = make(True)
    got = run(eng, BATCH, abort=("r2", 5))
    tokens, reason = got["r2"]
    assert reason == "abort" and 5 <= len(tokens) < 17 and tokens == ref["r2"][0][: len(tokens)]
    assert {k: v for k, v in got.items() if k != "r2"} == {k: v for k, v in ref.items() if k != "r2"}
    assert eng.executor.kv.allocator.num_free == eng.executor.kv.allocator.capacity
    assert eng.stats()["num_async_steps"] >= 10


def test_preemption_in_a_small_pool_matches_sync():
    batch = [(f"p{i}", prompt(7, 20 + i), greedy(9, ignore_eos=True)) for i in range(8)]
    big = run(make(False, num_tokens=256), batch)
    small = make(True, num_tokens=32)  # 8 pages; the batch needs 8 x 4 = 32 at once: 4x too small
    assert run(small, batch) == big
    assert small.stats()["num_preemptions"] > 0 and small.stats()["num_async_steps"] > 0


def test_schedule_without_preemption_changes_nothing():
    """`schedule(preempt=False)` (what async steps ask) is None where a running request would have to be
    preempted, with the queues, sequences and pages as they were; `schedule()` then preempts."""
    eng = make(False, num_tokens=32)  # 8 pages of 4 tokens
    for i in range(4):
        eng.add_request(prompt(7, 40 + i), greedy(9, ignore_eos=True), f"q{i}")
    while eng.scheduler.waiting or eng.executor.kv.allocator.num_free:  # 4 requests x 2 pages: the pool is full
        eng.step()
    s = eng.scheduler
    before = ([r.request_id for r in s.running], len(s.waiting), s.alloc.num_free,
              [(r.seq.kv_len, list(r.seq.pages)) for r in s.running], s.num_preemptions)
    assert s.schedule(preempt=False) is None
    assert ([r.request_id for r in s.running], len(s.waiting), s.alloc.num_free,
            [(r.seq.kv_len, list(r.seq.pages)) for r in s.running], s.num_preemptions) == before
    assert s.schedule() and s.num_preemptions > before[-1]


def sampled(n: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": seed, "max_tokens": n,
                             "ignore_eos": True, **kw})


def test_seeded_sampled_rows_run_async_and_match_sync():
    """Sampled rows run async: the ids drawn on the device feed the next step, and seeded requests get
    the tokens of synchronous steps, alone and batched with greedy rows, with a mid-run add."""
    batch = [("s0", prompt(5, 7), sampled(9, 3)), ("s1", prompt(8, 9), sampled(14, 4, min_p=0.05)),
             ("g", prompt(4, 8), greedy(11, ignore_eos=True))]
    later = [("s2", prompt(6, 12), sampled(7, 5))]
    eng = make(True)
    got = run(eng, batch, later, add_after=6)
    assert got == run(make(False), batch, later, add_after=6)
    assert [len(got[r][0]) for r in ("s0", "s1", "g", "s2")] == [9, 14, 11, 7]
    assert eng.stats()["num_async_steps"] >= 10


def test_penalties_and_min_tokens_in_async_steps_match_sync():
    """Rows with penalties count their in-flight token on the device, min_tokens counts it on the host:
    seeded sampled and greedy rows with repetition / presence / frequency penalties and min_tokens (EOS
    masked until then) get the tokens of synchronous steps."""
    ref = run(make(False), BATCH)
    eos = ref["r2"][0][2]  # a token that occurs early: min_tokens must hold it back
    batch = [("p0", prompt(5, 7), sampled(12, 3, repetition_penalty=1.3)),
             ("p1", prompt(8, 9), sampled(15, 4, presence_penalty=0.8, frequency_penalty=0.5)),
             ("p2", prompt(6, 21), greedy(14, repetition_penalty=1.2, frequency_penalty=0.3, ignore_eos=True)),
             ("m0", BATCH[2][1], greedy(17, min_tokens=6)),
             ("g", prompt(4, 8), greedy(11, ignore_eos=True))]
    results = []
    for async_steps in (False, True):
        eng = make(async_steps)
        eng.eos_token_ids = frozenset({eos})
        results.append(run(eng, batch))
    sync, got = results
    assert got == sync
    assert eng.stats()["num_async_steps"] >= 10
    assert len(got["m0"][0]) >= 6 and got["m0"][0][2] != eos  # min_tokens masked the EOS r2 takes there


def test_logprobs_in_async_steps_match_sync():
    """Rows asking for logprobs run async: their logprob table comes to the host with the ids, and every
    request gets the tokens and logprobs of synchronous steps."""
    batch = [("x", prompt(5, 7), SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True)),
             ("y", prompt(6, 9), sampled(11, 4, logprobs=0)),
             ("g", prompt(4, 8), greedy(12, ignore_eos=True))]

    def logprobs(eng):
        for rid, p, sp in batch:
            eng.add_request(p, sp, rid)
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = (o.token_ids, o.logprobs)
        return final

    sync, eng = logprobs(make(False)), make(True)
    got = logprobs(eng)
    assert got == sync and eng.stats()["num_async_steps"] >= 8
    assert len(got["x"][1]) == 9 and all(len(d) in (2, 3) for d in got["x"][1])
    assert all(len(d) == 1 for d in got["y"][1]) and got["g"][1] is None


@pytest.mark.parametrize("decode_runner", [True, False])
def test_steps_with_prompt_chunks_run_async_and_match_sync(decode_runner):
    """A step with prompt chunks (long prompts in 24-token chunks beside running decodes) runs async: the rows
    that finish their prompt sample on the device and their ids feed the next step's placeholders, through a
    decode graph's runner or the eager path (no runner): greedy, seeded sampled and logprob rows get the tokens
    of synchronous steps, and every step ran async."""
    batch = [("long0", prompt(40, 31), greedy(8, ignore_eos=True)), ("d", prompt(3, 32), sampled(12, 6)),
             ("long1", prompt(57, 33), sampled(6, 7, logprobs=1))]
    later = [("long2", prompt(45, 34), greedy(5, ignore_eos=True)), ("x", prompt(2, 35), sampled(9, 8))]

    def final(eng):
        got = run(eng, batch, later, add_after=4)
        return got, eng.stats()

    sync, _ = final(make(False, decode_runner=decode_runner))
    got, stats = final(make(True, decode_runner=decode_runner))
    assert got == sync
    assert stats["num_async_steps"] == stats["num_steps"] >= 15


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_sync(seed):
    """Random prompt lengths (1-60 tokens, so prompts of one and of several 24-token chunks), max_tokens, greedy
    and seeded sampled rows, requests added mid-run and pools from roomy to small enough to preempt: async steps
    give every request the tokens and finish reason of synchronous steps."""
    rng = torch.Generator().manual_seed(seed)

    def ri(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=rng))

    reqs = []
    for i in range(ri(5, 10)):
        n, m = ri(1, 60), ri(1, 12)
        sp = greedy(m, ignore_eos=True) if ri(0, 1) else sampled(m, 100 * seed + i)
        reqs.append((f"w{i}", prompt(n, 1000 * seed + i), sp))
    split = ri(1, len(reqs) - 1)
    num_tokens = (64, 128, 512)[seed % 3]
    args = (reqs[:split], reqs[split:], ri(0, 10))
    want = run(make(False, num_tokens=num_tokens), *args)
    eng = make(True, num_tokens=num_tokens, decode_runner=bool(seed % 2))
    assert run(eng, *args) == want
    assert eng.stats()["num_async_steps"] > 0


def test_generate_matches_sync():
    prompts = [p for _, p, _ in BATCH]
    params = greedy(10, ignore_eos=True)
    want = [o.token_ids for o in make(False).generate(prompts, params)]
    eng = make(True)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert not eng.has_unfinished() and eng.stats()["num_async_steps"] >= 8


def test_pages_filled_by_async_steps_enter_the_prefix_cache():
    """Pages whose last token was in flight are registered once its id arrives, under the keys of the
    real tokens: the whole prompt + output is then a prefix-cache hit, as after synchronous steps."""
    p = prompt(5, 11)
    hits = []
    for async_steps in (False, True):
        eng = make(async_steps)
        out = eng.generate([p], greedy(20, ignore_eos=True))[0].token_ids
        seq = eng.executor.new_sequence(p + out + [1])
        hits.append(seq.num_cached_tokens)
        eng.executor.free(seq)
    assert hits[0] == hits[1] == 24  # 25 tokens of KV: 6 full pages of 4


def test_async_engine_coroutines_over_async_steps():
    """AsyncEngine's loop over an engine with async steps: every coroutine streams one token per output
    and ends with the synchronous engine's tokens; all pages come back."""
    prompts = [prompt(3 + i % 7, 200 + i) for i in range(12)]
    params = greedy(7, ignore_eos=True)
    want = [o.token_ids for o in make(False).generate(prompts, params)]

    async def one(aeng, p):
        outs = [o async for o in aeng.generate(p, params)]
        assert [len(o.new_token_ids) for o in outs] == [1] * 7 and outs[-1].finished
        return outs[-1].token_ids

    async def main(aeng):
        return await asyncio.gather(*(one(aeng, p) for p in prompts))

    eng = make(True)
    with AsyncEngine(eng) as aeng:
        got = asyncio.run(main(aeng))
    assert got == want
    assert eng.stats()["num_async_steps"] > 0
    assert eng.stats()["kv_pages_used"] == 0 and not eng.executor._live
