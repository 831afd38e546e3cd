"""The Engine on the GPU, under piecewise and full decode graphs: greedy tokens equal Executor.generate's,
with and without prefix caching (shared pages read by extend steps with a cached prefix and by decode
graph replays), and under preemption. float32 weights, so that a different batch composition (another
GEMM tiling) can't flip a near-tie argmax of the random model: the test is about the engine's pages,
not about bf16 batch invariance. With `scheduler.async_steps` the same tokens stream as without, and with
speculative drafts (steps that feed several tokens per row and cut the rejected ones back) the same tokens come.

Run on the H200: `python -m pytest tests/gpu/test_engine_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def make(prefix_caching: bool, num_tokens: int = 8192, async_steps: bool = False, **sections) -> Engine:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = {"model": {"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4},
                     "max_context": 1024},
           "quantization": {"format": "none"}, "runtime": {"device": "cuda", "dtype": "float32"},
           "kv_cache": {"num_tokens": num_tokens, "page_size": 16, "prefix_caching": prefix_caching},
           "scheduler": {"async_steps": async_steps}, **sections}
    return Engine.from_config(cfg, progress=False)


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128000, (100,), generator=g).tolist()
    return [system + torch.randint(0, 128000, (n,), generator=g).tolist() for n in (7, 40, 129, 3, 60, 18)]


def test_engine_greedy_with_and_without_prefix_cache():
    ps = prompts(0)
    params = SamplingParams(temperature=0, max_tokens=24)
    off = make(False)
    want = off.executor.generate(ps, 24)
    assert [o.token_ids for o in off.generate(ps, params)] == want
    del off
    on = make(True)
    on.generate(ps[:1], params)  # caches the shared 100-token prefix
    outs = on.generate(ps, params)
    assert on.stats()["prefix_cache_hit_tokens"] > 0 and all(o.num_cached_tokens >= 96 for o in outs)
    assert [o.token_ids for o in outs] == want


def test_engine_preemption_on_gpu():
    ps = [p[:40] for p in prompts(1)] * 4
    params = SamplingParams(temperature=0, max_tokens=48)
    want = [o.token_ids for o in make(True).generate(ps, params)]
    small = make(True, num_tokens=24 * 16)  # 24 pages for 24 sequences of up to 6 pages
    assert [o.token_ids for o in small.generate(ps, params)] == want
    assert small.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("real_drafts", [False, True], ids=["scripted", "ngram"])
def test_speculative_drafts_give_the_plain_greedy_tokens(monkeypatch, real_drafts):
    """Steps with drafts run under piecewise graphs (every fed row's logits) and cut the KV of rejected drafts
    on the device: the plain greedy tokens come out. Scripted drafts are right but for their last token (each
    step keeps k of k + 1 fed positions and cuts one); n-gram drafts are whatever prompts and outputs repeat."""
    from pieceworks.engine.speculative import NgramIndex

    ps = [p + p[100:] for p in prompts(2)]  # each prompt's own part twice: n-grams to look up
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = make(True)
    want = [o.token_ids for o in plain.generate(ps, params)]
    del plain
    ref = {tuple(p): w for p, w in zip(ps, want)}

    def scripted(self, req, k):
        pos = len(req.output)
        draft = list(ref[tuple(req.prompt)][pos:pos + k])
        if len(draft) == k:
            draft[-1] = (draft[-1] + 1) % 128000
        return draft

    if not real_drafts:
        monkeypatch.setattr(NgramIndex, "propose", scripted)
    spec = make(True, speculative={"method": "ngram", "num_speculative_tokens": 3, "max_batch": None})
    assert spec.executor.piecewise is not None
    assert [o.token_ids for o in spec.generate(ps, params)] == want
    s = spec.stats()
    if not real_drafts:  # whether the random model's output repeats enough to draft is its own affair
        assert s["num_draft_tokens"] > s["num_accepted_tokens"] > 0


def test_prompt_logprobs_under_piecewise_graphs():
    """Prompt logprobs on the GPU (prompt chunks under piecewise graphs, next to async-decoding requests)
    equal the log_softmax of one all-logits forward of the prompt."""
    from pieceworks.core.batch import ForwardBatch

    eng = make(True, async_steps=True)
    ps = prompts(2)
    for p in ps[:3]:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=16))
    eng.step()
    eng.step()
    rid = eng.add_request(ps[4], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))
    got = None
    while eng.has_unfinished():
        got = next((o for o in eng.step() if o.request_id == rid and o.finished), got)
    seq = eng.executor.new_sequence()
    ref = eng.executor.forward(ForwardBatch([seq], [ps[4]], True)).log_softmax(-1).cpu()
    eng.executor.free(seq)
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(ps[4])
    for j in range(1, len(ps[4])):
        assert got.prompt_logprobs[j][ps[4][j]] == pytest.approx(float(ref[j - 1, ps[4][j]]), abs=1e-3)


def _stream(eng: Engine, first, later, stop_id: int | None = None) -> dict[str, tuple[list[int], str, list | None]]:
    """Step `eng` to the end: `first` at once, `later` after 40 streamed tokens, and the first request
    aborted after 10 of its tokens; at most one token per request per step."""
    for rid, p, sp in first:
        eng.add_request(p, sp, rid)
    seen: dict[str, list[int]] = {}
    final = {}
    added = aborted = False
    while eng.has_unfinished():
        outs = eng.step()
        assert len({o.request_id for o in outs}) == len(outs)
        for o in outs:
            assert len(o.new_token_ids) <= 1
            seen.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert seen[o.request_id] == o.token_ids
            if o.finished:
                final[o.request_id] = (o.token_ids, o.finish_reason, o.logprobs)
        if not added and sum(map(len, seen.values())) >= 40:
            for rid, p, sp in later:
                eng.add_request(p, sp, rid)
            added = True
        if not aborted and len(seen.get("a0", [])) >= 10:
            eng.abort("a0")
            aborted = True
    s = eng.stats()
    assert (s["running"], s["waiting"], s["kv_pages_used"]) == (0, 0, 0)
    return final


@pytest.mark.parametrize("num_tokens", [8192, 12 * 16])
def test_engine_async_steps_stream_the_same_tokens(num_tokens):
    """Async steps (one step in flight, input ids resolved on the device) against synchronous
    steps: different max_tokens, a stop id that occurs, requests added mid-run, an abort mid-flight, and
    (with 12 pages) preemption."""
    ps = [p[:40] for p in prompts(2)]
    first = [(f"a{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
             for i, (p, m) in enumerate(zip(ps[:4], (30, 12, 41, 25)))]
    later = [(f"b{i}", p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for i, p in enumerate(ps[4:])]
    sync = _stream(make(True, num_tokens), first, later)
    stop = sync["a2"][0][15]  # a token that occurs: as a stop id it ends a2 (and maybe others) early
    first = [(rid, p, SamplingParams(temperature=0, max_tokens=sp.max_tokens, ignore_eos=True, stop_token_ids=[stop]))
             for rid, p, sp in first]
    sync = _stream(make(True, num_tokens), first, later)
    eng = make(True, num_tokens, async_steps=True)
    got = _stream(eng, first, later)
    tokens, reason, _ = got.pop("a0")
    want, _, _ = sync.pop("a0")
    assert reason == "abort" and tokens == want[: len(tokens)]
    assert got == sync and got["a2"][1] == "stop"
    assert eng.stats()["num_async_steps"] > 10
    if num_tokens < 1024:
        assert eng.stats()["num_preemptions"] > 0


def test_engine_async_steps_with_seeded_sampling():
    """Sampled rows in async steps: the ids the sampler draws on the device feed the next replay (and the
    penalty counts), and seeded requests (greedy ones beside them) stream the tokens and logprobs of
    synchronous steps."""
    ps = [p[:40] for p in prompts(3)]
    first = [(f"a{i}", p, SamplingParams(temperature=0.8, top_p=0.95, top_k=200 if i % 2 else 0, seed=i,
                                         max_tokens=m, ignore_eos=True, logprobs=3 if i == 3 else None))
             for i, (p, m) in enumerate(zip(ps[:4], (30, 12, 41, 25)))]
    later = [("b0", ps[4], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
             ("b1", ps[5], SamplingParams(temperature=1.0, min_p=0.05, seed=9, max_tokens=20, ignore_eos=True,
                                          repetition_penalty=1.2, frequency_penalty=0.4, min_tokens=5))]
    sync = _stream(make(True), first, later)
    eng = make(True, async_steps=True)
    got = _stream(eng, first, later)
    tokens, reason, _ = got.pop("a0")
    want, _, _ = sync.pop("a0")
    assert reason == "abort" and tokens == want[: len(tokens)]
    lp_got, lp_want = got["a3"][2], sync["a3"][2]
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in sync.items()}
    # logprobs: the same tokens; values to float32 rounding (a finished request's row may still be in an
    # async step's batch, so a step's batch size, and its GEMM tiling, can differ from the synchronous one)
    assert len(lp_got) == 25 and [d.keys() for d in lp_got] == [d.keys() for d in lp_want]
    assert all(abs(d[t] - e[t]) <= 1e-4 for d, e in zip(lp_got, lp_want) for t in d)
    assert eng.stats()["num_async_steps"] > 10


def test_close_returns_the_device_memory():
    """Engine.close (Executor.close) gives back the weights, the KV pool and the graphs' pools: allocated
    memory falls back to what it was before the build, and reserved memory too once the cache is
    emptied (torch.compile keeps the piecewise backend for the process; close() empties it)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    eng = make(True, num_tokens=65536)
    eng.generate([[1, 2, 3], list(range(10, 60))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    pool = eng.executor.kv.buffer.numel() * eng.executor.kv.buffer.element_size()
    assert torch.cuda.memory_allocated() - allocated > pool
    eng.close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - allocated < 0.05 * pool
    assert torch.cuda.memory_reserved() - reserved < 0.05 * pool
