"""Speculative decoding with n-gram drafts (engine/speculative.py) on the tiny Llama preset (CPU, float32):
the n-gram lookup against a brute-force search, greedy tokens equal to plain decoding with the real
drafts and with scripted ones (all right, wrong at a given place, cut by max_tokens, the context limit, a stop
id or min_tokens), sampled rows against the model's exact distribution, streamed outputs of several tokens, the
rows that do not draft, the step's tokens and pages, preemption, the prefix cache after rejected drafts, a failed
step, Executor.truncate, the config's checks and `pieceworks run`'s note."""

from __future__ import annotations

import random

import pytest
import torch

from pieceworks import Engine, SamplingParams
from pieceworks.core.batch import ForwardBatch
from pieceworks.engine.speculative import NgramIndex
from pieceworks.errors import BatchError, ConfigError

K = 3


def make(spec: bool = True, num_tokens: int = 1024, budget: int = 64, **sections) -> Engine:
    cfg = {"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": num_tokens, "page_size": 4},
           "scheduler": {"max_num_batched_tokens": budget}, **sections}
    if spec:  # drafts at every batch size (max_batch's default of 4 would leave the larger batches without)
        cfg.setdefault("speculative", {"method": "ngram", "num_speculative_tokens": K, "max_batch": None})
    return Engine.from_config(cfg, progress=False)


def repetitive(n: int, seed: int) -> list[int]:
    base = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return base + base[: n // 2]  # the second half repeats: n-grams of the prompt occur twice


PROMPTS = [repetitive(n, i) for i, n in enumerate((5, 17, 9, 30, 3, 12))]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def plain():
    return make(spec=False)


@pytest.fixture(scope="module")
def reference(plain):
    """Each prompt's plain greedy continuation, longer than any test asks for."""
    outs = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, outs)}


def drained(engine: Engine) -> None:
    s = engine.stats()
    assert not engine.has_unfinished() and (s["running"], s["kv_pages_used"]) == (0, 0)
    assert not engine.executor._live


def scripted(monkeypatch, reference, wrong_at: int | None = None, calls: list | None = None) -> None:
    """Drafts from the reference continuation (what greedy decoding gives next), the one at index `wrong_at`
    of each draft replaced by another token."""
    def propose(self, req, k):
        pos = len(req.output)
        draft = list(reference[tuple(req.prompt)][pos:pos + k])
        if wrong_at is not None and wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % 512
        if calls is not None:
            calls.append((pos, k, len(draft)))
        return draft

    monkeypatch.setattr(NgramIndex, "propose", propose)


# ----------------------------------------------------------------------------- the n-gram lookup
class Tokens:
    def __init__(self, toks: list[int]) -> None:
        self.toks = toks

    def tokens(self, start: int) -> list[int]:
        return self.toks[start:]


def brute_force(toks: list[int], k: int, lo: int, hi: int) -> list[int]:
    L = len(toks)
    for n in range(min(hi, L), lo - 1, -1):
        for end in range(L - 1, n - 1, -1):  # latest occurrence first, never the trailing n-gram itself
            if toks[end - n:end] == toks[L - n:]:
                return toks[end:end + k]
    return []


@pytest.mark.parametrize("lo,hi,vocab", [(1, 1, 3), (2, 4, 4), (1, 3, 8), (3, 5, 2)])
def test_ngram_index_equals_a_brute_force_search_as_tokens_arrive(lo, hi, vocab):
    rng = random.Random(lo * 100 + hi * 10 + vocab)
    for _ in range(20):
        toks: list[int] = []
        idx, req = NgramIndex(lo, hi), Tokens(toks)
        hits = 0
        for _ in range(60):
            toks.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))  # 1-3 tokens per step, as drafts give
            k = rng.randint(1, 5)
            got = idx.propose(req, k)
            assert got == brute_force(toks, k, lo, hi), (toks, k)
            hits += bool(got)
        assert hits > 0


def test_ngram_index_takes_the_longest_then_the_latest_match():
    idx = NgramIndex(1, 3)
    # "7 8" occurred before "9" and, later, before "5"; "6 7 8" only before "4": the 3-gram wins
    assert idx.propose(Tokens([6, 7, 8, 4, 4, 7, 8, 5, 1, 6, 7, 8]), 2) == [4, 4]
    idx = NgramIndex(1, 2)
    assert idx.propose(Tokens([7, 8, 9, 0, 7, 8, 5, 3, 7, 8]), 3) == [5, 3, 7]  # the latest "7 8"
    assert NgramIndex(2, 2).propose(Tokens([1, 2, 3, 4]), 3) == []


# ----------------------------------------------------------------------------- the engine
def test_ngram_drafts_give_the_plain_greedy_tokens(plain):
    eng = make()
    outs = eng.generate(PROMPTS, GREEDY)
    want = plain.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    s = eng.stats()
    assert s["num_draft_tokens"] > s["num_accepted_tokens"] > 0  # drafts were accepted and rejected
    assert s["num_generated_tokens"] == len(PROMPTS) * GREEDY.max_tokens
    drained(eng)


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2])
def test_scripted_drafts_give_the_plain_tokens_and_save_the_steps_they_should(monkeypatch, reference, wrong_at):
    scripted(monkeypatch, reference, wrong_at)
    eng = make()
    p = PROMPTS[3]
    steps = []
    rid = eng.add_request(p, GREEDY)
    while eng.has_unfinished():
        steps.append([t for o in eng.step() if o.request_id == rid for t in o.new_token_ids])
    got = [t for s in steps for t in s]
    assert got == reference[tuple(p)][:GREEDY.max_tokens]
    per_step = K + 1 if wrong_at is None else wrong_at + 1  # accepted drafts + the model's own token
    assert len(steps[0]) == 1  # the 45-token prompt in one step, then decode steps with drafts
    decode = [len(s) for s in steps[1:]]
    assert all(n == per_step for n in decode[:-1]) and 1 <= decode[-1] <= per_step
    assert eng.stats()["num_accepted_tokens"] == sum(n - 1 for n in decode)
    drained(eng)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_drafts_never_run_past_max_tokens(monkeypatch, reference, max_tokens):
    calls: list = []
    scripted(monkeypatch, reference, calls=calls)
    eng = make()
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens))
    assert [o.token_ids for o in outs] == [reference[tuple(p)][:max_tokens] for p in PROMPTS]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(pos + k < max_tokens for pos, k, _ in calls)  # a draft leaves room for the model's own token
    drained(eng)


def test_drafts_stop_at_the_context_limit(monkeypatch, reference):
    scripted(monkeypatch, reference)
    p = PROMPTS[3]
    limit = len(p) + 6
    eng = make(model={"arch": "llama", "preset": "tiny", "max_context": limit})
    out = eng.generate([p], SamplingParams(temperature=0, max_tokens=None))[0]
    assert out.token_ids == reference[tuple(p)][:6] and out.finish_reason == "length"
    drained(eng)


def test_a_stop_id_inside_accepted_drafts_ends_the_completion_there(monkeypatch, reference):
    scripted(monkeypatch, reference)
    p = PROMPTS[1]
    ref = reference[tuple(p)]
    stop = next(t for t in ref[3:] if t not in ref[:3])  # a token first generated at index >= 3
    at = ref.index(stop)
    eng = make()
    out = eng.generate([p], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[:at + 1] and out.finish_reason == "stop"
    drained(eng)


def test_rows_draft_only_once_min_tokens_are_out(monkeypatch, reference):
    """Until min_tokens are generated the stop ids are masked at every fed position (the sampler's rule reads the
    output's length), so a row drafts only after: a stop id due right after min_tokens ends the completion there."""
    calls: list = []
    scripted(monkeypatch, reference, calls=calls)
    p = PROMPTS[1]
    ref = reference[tuple(p)]
    stop = next(t for t in ref[3:] if t not in ref[:3])
    at = ref.index(stop)
    eng = make()
    out = eng.generate([p], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=at))[0]
    assert out.token_ids == ref[:at + 1] and out.finish_reason == "stop"
    assert calls and min(pos for pos, _, _ in calls) >= at  # the first draft once min_tokens were out
    drained(eng)


def test_rows_that_do_not_draft_sample_as_without_speculation():
    """Rows with penalties get no drafts and the tokens of a plain synchronous engine; greedy rows with logprobs
    draft and report the logprobs plain decoding reports."""
    sync = make(spec=False, scheduler={"max_num_batched_tokens": 64, "async_steps": False})
    eng = make()
    params = [SamplingParams(temperature=0.8, seed=7, presence_penalty=0.5, max_tokens=12),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12),
              SamplingParams(temperature=0, logprobs=2, max_tokens=12)]
    got, want = {}, {}
    for e, into in ((eng, got), (sync, want)):
        rids = [e.add_request(p, sp) for p in PROMPTS[:3] for sp in params]
        if e is eng:
            assert [r.ngram is not None for rid in rids for r in e._requests[rid]] == [False, False, True] * 3
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    into[rids.index(o.request_id)] = o
    for i in range(len(want)):
        assert got[i].token_ids == want[i].token_ids, i
        if want[i].logprobs is not None:
            for g, w in zip(got[i].logprobs, want[i].logprobs):
                assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in w)
    assert eng.stats()["num_accepted_tokens"] > 0
    drained(eng)


def test_rows_without_penalties_grammars_or_prompt_logprobs_get_an_index():
    spec = make().speculator
    for sp in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9, seed=3),
               SamplingParams(temperature=0, logit_bias={3: 1.0}, logprobs=1, min_tokens=2)):
        assert spec.index_for(sp, None) is not None
    for sp in (SamplingParams(temperature=0.5, frequency_penalty=0.1), SamplingParams(repetition_penalty=1.2),
               SamplingParams(temperature=0, prompt_logprobs=1)):
        assert spec.index_for(sp, None) is None
    assert spec.index_for(SamplingParams(temperature=0), object()) is None  # a grammar's matcher


def test_sampled_rows_keep_the_distribution_of_plain_sampling(monkeypatch):
    """Speculative sampling with fixed-token drafts: 3,000 completions of one prompt (temperature 1, top_k 3,
    3 tokens: the second step feeds one draft, the likeliest second token after the first) against the model's
    exact joint distribution of the 27 three-token outputs (chi-square, 26 degrees of freedom, p = 0.001: 54.05).
    Keeping a draft the sampler did not draw fails it."""
    eng = make(num_tokens=8192, scheduler={"max_num_batched_tokens": 4096, "max_num_seqs": 1024})
    p = PROMPTS[2]
    score = eng.executor.score

    def top3(seq):
        logits = score([seq])[0][-1]
        v, i = logits.topk(3)
        return dict(zip(i.tolist(), v.softmax(-1).tolist()))

    first = top3(p)
    second = {a: top3(p + [a]) for a in first}
    exact = {(a, b, c): pa * pb * pc for a, pa in first.items() for b, pb in second[a].items()
             for c, pc in top3(p + [a, b]).items()}
    likeliest = {a: max(d, key=d.get) for a, d in second.items()}
    monkeypatch.setattr(NgramIndex, "propose", lambda self, req, k: [likeliest[req.output[0]]][:k])
    N = 3000
    outs = eng.generate([p] * N, SamplingParams(temperature=1.0, top_k=3, max_tokens=3))
    seen: dict[tuple, int] = {}
    for o in outs:
        seen[tuple(o.token_ids)] = seen.get(tuple(o.token_ids), 0) + 1
    assert set(seen) <= set(exact)
    chi2 = sum((seen.get(x, 0) - N * q) ** 2 / (N * q) for x, q in exact.items())
    assert chi2 < 54.05, (chi2, seen)
    s = eng.stats()
    assert s["num_draft_tokens"] == N and 0.2 * N < s["num_accepted_tokens"] < 0.9 * N
    drained(eng)


def test_steps_with_drafts_keep_to_the_token_budget(monkeypatch, reference):
    scripted(monkeypatch, reference)
    eng = make(budget=6)  # below two rows of K + 1
    sizes = []
    forward = eng.executor.forward
    monkeypatch.setattr(eng.executor, "forward", lambda b, **kw: (sizes.append(sum(map(len, b.tokens))),
                                                                  forward(b, **kw))[1])
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[tuple(p)][:GREEDY.max_tokens] for p in PROMPTS]
    assert max(sizes) == 6 and eng.stats()["num_accepted_tokens"] > 0
    drained(eng)


def test_drafts_take_only_the_pages_the_rows_own_tokens_left(monkeypatch):
    """Drafts are added after every running row has its own token, from the pages left: with room for exactly
    the rows' own pages, a row whose drafts need another page runs without them, one whose drafts fit in its
    pages gets them, and nothing is preempted."""
    from pieceworks.executor.kv_cache import PageAllocator

    eng = make()
    a = eng.add_request(list(range(10, 15)), GREEDY)  # 5 tokens: 2 pages; its next token fits, 3 drafts do not
    b = eng.add_request(list(range(20, 24)), GREEDY)  # 4 tokens: 1 full page; its next token takes a 2nd page
    eng.step()
    monkeypatch.setattr(NgramIndex, "propose", lambda self, req, k: [1, 2, 3][:k])
    monkeypatch.setattr(PageAllocator, "num_free", property(lambda self: 1))  # b's own page, no more
    out = {r.request_id: toks for r, toks in eng.scheduler.schedule()}
    monkeypatch.undo()
    assert (len(out[a]), out[b][1:]) == (1, [1, 2, 3]) and eng.stats()["num_preemptions"] == 0
    for rid in (a, b):
        for r in eng._requests[rid]:
            r.draft = []
        eng.abort(rid)
    eng.step()
    drained(eng)


def test_preemption_with_drafts_gives_the_plain_tokens(reference, monkeypatch):
    scripted(monkeypatch, reference, wrong_at=2)
    small = make(num_tokens=96)  # 24 pages of 4; the six sequences reach 64 pages together
    outs = small.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[tuple(p)][:GREEDY.max_tokens] for p in PROMPTS]
    assert small.stats()["num_preemptions"] > 0
    drained(small)


def test_the_prefix_cache_stays_true_after_rejected_drafts(monkeypatch, reference, plain):
    """Drafts that fill a page and are then rejected leave no page registered under their tokens: later
    prompts that hold those very drafts (and prompts that extend the first ones by their outputs) get the
    plain tokens, where a stale key would hand them a page since overwritten by the accepted tokens."""
    monkeypatch.setattr(NgramIndex, "propose", lambda self, req, k: [7] * k)  # rejected unless 7 comes next
    eng = make()
    first = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == [reference[tuple(p)][:GREEDY.max_tokens] for p in PROMPTS]
    later = [p + reference[tuple(p)][:pos] + [7] * K + [1, 2] for p in PROMPTS for pos in range(1, 9)]
    later += [p + o.token_ids for p, o in zip(PROMPTS, first)]
    got = eng.generate(later, SamplingParams(temperature=0, max_tokens=8))
    want = plain.generate(later, SamplingParams(temperature=0, max_tokens=8))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert eng.stats()["prefix_cache_hit_tokens"] > 0
    drained(eng)


def test_async_engine_streams_several_tokens_per_output(monkeypatch, reference):
    import asyncio

    from pieceworks import AsyncEngine

    scripted(monkeypatch, reference)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1)

    async def main(aeng):
        return await asyncio.gather(*[collect(aeng, p) for p in PROMPTS[:3]])

    async def collect(aeng, p):
        return [o async for o in aeng.generate(p, params)]

    with AsyncEngine(make()) as aeng:
        streams = asyncio.run(main(aeng))
        params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, output_kind="delta")
        deltas = asyncio.run(main(aeng))
    for p, outs, parts in zip(PROMPTS, streams, deltas):
        assert [t for o in outs for t in o.new_token_ids] == reference[tuple(p)][:16] == outs[-1].token_ids
        assert max(len(o.new_token_ids) for o in outs) == K + 1 and len(outs[-1].logprobs) == 16
        # "delta": each output's token_ids and logprobs are its step's, several tokens at once
        assert [o.token_ids for o in parts] == [o.new_token_ids for o in parts]
        assert [t for o in parts for t in o.token_ids] == outs[-1].token_ids
        joined = [lp for o in parts for lp in o.logprobs]  # another run: equal up to the batch's float order
        assert [list(d) for d in joined] == [list(d) for d in outs[-1].logprobs]
        assert [v for d in joined for v in d.values()] == pytest.approx(
            [v for d in outs[-1].logprobs for v in d.values()], abs=1e-4)


def test_a_failed_step_with_drafts_leaves_the_engine_serving(monkeypatch, reference):
    """A forward that raises in a step with drafts changes nothing: the next step (no drafts found) and the
    ones after it (drafts again) give the completion its plain tokens."""
    scripted(monkeypatch, reference)
    eng = make()
    p = PROMPTS[3]
    rid = eng.add_request(p, GREEDY)
    eng.step()  # the prompt
    forward = eng.executor.forward
    monkeypatch.setattr(eng.executor, "forward", lambda b, **kw: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    monkeypatch.setattr(eng.executor, "forward", forward)
    propose = NgramIndex.propose
    monkeypatch.setattr(NgramIndex, "propose", lambda self, req, k: [])
    done = {o.request_id: o for o in eng.step() if o.finished}
    monkeypatch.setattr(NgramIndex, "propose", propose)
    while eng.has_unfinished():
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert done[rid].token_ids == reference[tuple(p)][:GREEDY.max_tokens]
    drained(eng)


def test_speculation_runs_steps_synchronously():
    eng = make(scheduler={"max_num_batched_tokens": 64, "async_steps": True})
    eng.generate(PROMPTS[:2], GREEDY)
    assert eng.stats()["num_async_steps"] == 0 and eng.speculator is not None


def test_above_max_batch_steps_run_without_drafts_and_asynchronously(plain):
    """speculative.max_batch = 2 with four requests of different lengths: while more than two run, steps feed no
    drafts and run asynchronously; once two are left they draft (after the step in flight is accepted); the
    tokens stay plain greedy decoding's and every page comes back."""
    eng = make(scheduler={"max_num_batched_tokens": 64, "async_steps": True},
               speculative={"method": "ngram", "num_speculative_tokens": K, "max_batch": 2})
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (4, 6, 24, 24)]
    drafted_at = []  # the number of running requests at each step that fed drafts
    real_step = eng.speculator.step

    def step(engine, scheduled, outputs, stream):
        drafted_at.append(len(engine.scheduler.running))
        return real_step(engine, scheduled, outputs, stream)

    eng.speculator.step = step
    got, want = {}, {}
    for e, into in ((eng, got), (plain, want)):
        rids = [e.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    into[rids.index(o.request_id)] = o.token_ids
    assert got == want and [len(want[i]) for i in range(4)] == [4, 6, 24, 24]
    s = eng.stats()
    assert s["num_async_steps"] > 0 and s["num_accepted_tokens"] > 0
    assert drafted_at and max(drafted_at) <= 2
    drained(eng)


# ----------------------------------------------------------------------------- Executor.truncate
def test_truncate_gives_back_pages_and_unregisters_the_page_cut_into():
    ex = make(spec=False).executor
    alloc = ex.kv.allocator
    seq = ex.new_sequence()
    ex.forward(ForwardBatch([seq], [list(range(10))]))  # pages of 4: two full (registered), one of 2
    assert len(seq.pages) == 3 and len(seq.block_keys) == 2 and alloc.num_cached == 2
    used = alloc.num_used
    ex.truncate(seq, 6)
    assert seq.tokens == list(range(6)) and len(seq.pages) == 2 and len(seq.block_keys) == 1
    assert alloc.num_used == used - 1 and alloc.num_cached == 1  # page 2 overwritten next: out of the cache
    probe = ex.new_sequence(list(range(10)))
    assert probe.num_cached_tokens == 4  # only the first page still hits
    ex.free(probe)
    ex.forward(ForwardBatch([seq], [[60, 61, 62]]))  # the sequence goes on from token 6
    fresh = ex.new_sequence()
    a = ex.forward(ForwardBatch([seq], [[63]]))
    b = ex.forward(ForwardBatch([fresh], [list(range(6)) + [60, 61, 62, 63]]))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for bad in (-1, 11, 2.0):
        with pytest.raises(BatchError, match="num_tokens must be an int"):
            ex.truncate(seq, bad)
    ex.free(seq)
    with pytest.raises(BatchError, match="live Sequence"):
        ex.truncate(seq, 0)
    ex.free(fresh)


def test_truncate_refuses_to_cut_inside_a_shared_page():
    ex = make(spec=False).executor
    a = ex.new_sequence()
    ex.forward(ForwardBatch([a], [list(range(9))]))
    b = ex.new_sequence(list(range(9)))  # shares a's two full pages
    assert b.num_cached_tokens == 8
    with pytest.raises(BatchError, match="shared with another sequence"):
        ex.truncate(b, 6)
    assert b.kv_len == 8 and len(b.pages) == 2
    ex.truncate(b, 4)  # at a page boundary: the shared page is let go, not written
    assert len(b.pages) == 1 and ex.kv.allocator.refcount(a.pages[1]) == 1
    ex.free(a)
    ex.free(b)


@pytest.mark.parametrize("overrides,match", [
    (["speculative.method=eagle"], "speculative.method: 'eagle' is not allowed; use one of ngram"),
    (["speculative.num_speculative_tokens=0"], "speculative.num_speculative_tokens: 0 must be >= 1"),
    (["speculative.prompt_lookup_min=5"], "prompt_lookup_min .5. exceeds prompt_lookup_max .4."),
    (["speculative.prompt_lookup_max=1000"], "speculative.prompt_lookup_max: 1000 is more than 32"),
    (["speculative.num_speculative_tokens=65"], "speculative.num_speculative_tokens: 65 is more than 64"),
    (["speculative.max_batch=0"], "speculative.max_batch: 0 must be >= 1"),
])
def test_bad_speculative_config_is_a_config_error(overrides, match):
    from pieceworks.config import load_config

    with pytest.raises(ConfigError, match=match):
        load_config({"model": {"arch": "llama"}}, overrides)



def test_pieceworks_run_says_it_generates_without_speculation(capsys):
    """`pieceworks run` generates through Executor.generate: a speculative config is named as not applied there."""
    from pieceworks import cli

    assert cli.main(["run", "model.arch=llama", "model.preset=tiny", "speculative.method=ngram",
                     "generation.max_new_tokens=2", "cuda_graph.piecewise.enabled=off"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "speculative.method=ngram applies to the Engine" in out and "without it" in out


@pytest.mark.parametrize("trial", range(6))
def test_random_workloads_give_the_plain_greedy_tokens(trial):
    """Random mixes (repetitive prompts, some repeated whole so that pages are shared, stop ids, min_tokens, n = 2,
    logprobs, pools small enough to preempt, k of 1, 3 or 5): the greedy tokens of plain synchronous steps, and every
    page back at the end."""
    rng, gen = random.Random(trial), torch.Generator().manual_seed(trial)
    prompts: list[list[int]] = []
    for _ in range(rng.randint(3, 10)):
        base = torch.randint(0, 40, (rng.randint(2, 12),), generator=gen).tolist()  # 40 ids: n-grams repeat
        prompts.append(base * rng.randint(1, 3))
        if rng.random() < 0.4:
            prompts.append(list(rng.choice(prompts)) + base[:rng.randint(0, 3)])
    params = []
    for _ in prompts:
        kw = dict(temperature=0, max_tokens=rng.randint(1, 30))
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(40)]
        if rng.random() < 0.2:
            kw["min_tokens"] = min(kw["max_tokens"], rng.randint(0, 5))
        kw["n"] = 2 if rng.random() < 0.2 else 1
        kw["logprobs"] = 1 if rng.random() < 0.2 else None
        params.append(SamplingParams(**kw))
    num_tokens, budget = rng.choice([(160, 16), (256, 32), (1024, 64)])
    got = {}
    for spec in (False, True):
        sections = {"speculative": {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3, 5])}} if spec else {}
        eng = make(spec, num_tokens, budget, scheduler={"max_num_batched_tokens": budget, "async_steps": False},
                   **sections)
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        final = {}
        while eng.has_unfinished():
            final |= {(o.request_id, o.index): o.token_ids for o in eng.step() if o.finished}
        got[spec] = [final[(r, i)] for r, sp in zip(rids, params) for i in range(sp.n)]
        drafts = eng.stats()["num_draft_tokens"]
        drained(eng)
    assert got[True] == got[False] and drafts > 0
