"""Structured outputs (engine/structured.py): the SmolLM2 demo model held to JSON schemas, choices, regexes
and grammars by llguidance's token masks; the sampler's mask; the refusals."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading

import pytest
import torch

from pieceworks import AsyncEngine, Engine, SamplingParams, StructuredOutputsParams
from pieceworks.engine.sampler import Sampler, SamplingState
from pieceworks.engine.structured import Grammars, TokenMask, end_progress, grammar_stop, grammar_text
from pieceworks.errors import RequestError

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def engine(smollm2_cpu_engine):
    pytest.importorskip("llguidance")
    return smollm2_cpu_engine


def chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=False)


def run(engine: Engine, prompts, **params) -> list:
    return engine.generate(prompts, SamplingParams(**params))


def test_the_params_take_exactly_one_constraint():
    for kw in ({}, {"json": PERSON, "regex": "a"}, {"choice": ["a"], "json_object": True}):
        with pytest.raises(RequestError, match="exactly one"):
            StructuredOutputsParams(**kw)
    for kw, what in (({"json": "{not json"}, "not valid JSON"), ({"json": "[1]"}, "JSON schema"),
                     ({"json": 3}, "JSON schema"), ({"regex": ""}, "non-empty str"),
                     ({"choice": []}, "non-empty list"), ({"choice": ["a", 1]}, "non-empty list"),
                     ({"grammar": "g", "disable_any_whitespace": 1}, "bool")):
        with pytest.raises(RequestError, match=what):
            StructuredOutputsParams(**kw)
    with pytest.raises(RequestError, match="StructuredOutputsParams or None"):
        SamplingParams(structured_outputs={"json": PERSON})
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_sampler_masks_tokens_by_the_bitmask():
    V = 70  # three int32 words; bits past V are ignored
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    words = torch.full((2, 3), -1, dtype=torch.int32)
    words[0] = 0
    words[0, 1] = 1 << 5  # row 2 of the step allows token 37 alone
    words[1, 0] = 0  # row 0 bans 0..31; row 1 has no grammar
    mask = TokenMask([2, 0], words)
    states = [SamplingState.create(SamplingParams(temperature=0), [1], [], "cpu") for _ in range(3)]
    got = Sampler(V, "cpu").sample(logits, states, token_mask=mask).token_ids
    assert got == [32 + int(logits[0, 32:].argmax()), int(logits[1].argmax()), 37]
    states[2] = SamplingState.create(SamplingParams(temperature=1.0, seed=3), [1], [], "cpu")
    assert Sampler(V, "cpu").sample(logits, states, token_mask=mask).token_ids[2] == 37
    every = TokenMask([0, 1, 2], torch.cat([words[1:], torch.full((1, 3), -1, dtype=torch.int32), words[:1]]))
    assert Sampler(V, "cpu").sample(logits, states, token_mask=every).token_ids == got
    shuffled = TokenMask([2, 0, 1], torch.cat([words, torch.full((1, 3), -1, dtype=torch.int32)]))  # rows in any order
    assert Sampler(V, "cpu").sample(logits, states, token_mask=shuffled).token_ids == got
    states[2] = SamplingState.create(SamplingParams(temperature=0), [1], [], "cpu")  # all greedy: the mask alone
    assert Sampler(V, "cpu").sample(logits, states, token_mask=shuffled).token_ids == got
    with pytest.raises(ValueError, match="token_mask.words as int32"):
        Sampler(V, "cpu").sample(logits, states, token_mask=TokenMask([2, 0], words[:, :2]))
    with pytest.raises(ValueError, match="distinct row indices"):
        Sampler(V, "cpu").sample(logits, states, token_mask=TokenMask([2, 2], words))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sampler_masks_as_on_the_cpu():
    """The bitmask on the device (python -m pytest tests/test_structured.py -m gpu): greedy and sampled rows
    pick allowed tokens only, the greedy ones the CPU's."""
    V, B = 128256, 6
    torch.manual_seed(0)
    logits = torch.randn(B, V)
    words = torch.randint(-2**31, 2**31 - 1, (B - 1, (V + 31) // 32), dtype=torch.int32)
    words[:, 7:] &= 0x0F0F0F0F  # sparser past the first words
    rows = [0, 1, 3, 4, 5]  # row 2 has no grammar
    allowed = torch.ones(B, V, dtype=torch.bool)
    allowed[rows] = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(B - 1, -1)[:, :V].bool()
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1.0, top_p=0.9)] * 3
    want = Sampler(V, "cpu").sample(logits, [SamplingState.create(p, [1], [], "cpu") for p in params],
                                    token_mask=TokenMask(rows, words)).token_ids
    got = Sampler(V, "cuda").sample(logits.cuda(), [SamplingState.create(p, [1], [], "cuda") for p in params],
                                    token_mask=TokenMask(rows, words.pin_memory())).token_ids
    assert got[:3] == want[:3] == [int(logits[i].masked_fill(~allowed[i], -float("inf")).argmax()) for i in range(3)]
    assert all(allowed[i, t] for i, t in enumerate(got))


def test_json_schema_output_parses_and_matches(engine):
    prompts = [chat(engine, "Describe a person named Ann who is 31 as JSON."), "The weather today"]
    for compact in (False, True):
        spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=compact)
        for out in run(engine, prompts, temperature=0, max_tokens=40, structured_outputs=spec):
            assert out.finish_reason == "stop", out.text
            value = json.loads(out.text)
            assert set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int
            assert out.token_ids[-1] not in engine.eos_token_ids  # ended by the grammar, no EOS sampled
            if compact:  # no whitespace outside the strings
                assert not re.search(r"\s", out.text.replace(value["name"], "")), out.text


def test_sampled_completions_stay_in_the_language(engine):
    prompt = chat(engine, "Pick a color.")
    outs = run(engine, [prompt], temperature=1.0, seed=5, n=4, max_tokens=8,
               structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    assert all(o.text in ("red", "green", "blue") and o.finish_reason == "stop" for o in outs)
    outs = run(engine, [prompt, "Call me at"], temperature=1.0, seed=2, max_tokens=16,
               structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"))
    assert all(re.fullmatch(r"[0-9]{3}-[0-9]{4}", o.text) and o.finish_reason == "stop" for o in outs), outs
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    out, = run(engine, [prompt], temperature=1.0, seed=9, max_tokens=16,
               structured_outputs=StructuredOutputsParams(grammar=lark))
    assert out.text in ("The answer is yes.", "The answer is no."), out.text
    out, = run(engine, [prompt], temperature=0, max_tokens=30,
               structured_outputs=StructuredOutputsParams(json_object=True))
    assert out.text.startswith("{") and (out.finish_reason == "length" or isinstance(json.loads(out.text), dict))


def drive(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list[list[int]]:
    """Add the requests together and step to the end; every completion's tokens, in order."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    while engine.has_unfinished():
        final |= {(o.request_id, o.index): o for o in engine.step() if o.finished}
    return [final[(rid, i)].token_ids for rid, (_, p) in zip(ids, requests) for i in range(p.n)]


def test_async_steps_give_the_synchronous_tokens(engine):
    """Structured requests batched with a plain one: async steps (the mask computed once the previous step's
    ids are accepted, while the GPU runs the forward) give the tokens of synchronous steps, the plain
    request's tokens are those it gets alone, and the outputs hold to their grammars."""
    sync = Engine.from_config(engine.executor.cfg, ["scheduler.async_steps=false"], progress=False)
    try:
        plain = ("The three primary colors are", SamplingParams(temperature=0, max_tokens=12))
        requests = [plain,
                    (chat(engine, "Ann, 31, as JSON"), SamplingParams(
                        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PERSON))),
                    (chat(engine, "Pick a color."), SamplingParams(
                        temperature=1.0, seed=4, n=2, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))),
                    ("Call me at", SamplingParams(temperature=0.8, seed=11, max_tokens=16, structured_outputs=
                                                  StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")))]
        before = engine.num_async_steps
        got = drive(engine, requests)
        assert engine.num_async_steps > before + 10  # the pipeline ran while the grammars did
        assert got == drive(sync, requests) and sync.num_async_steps == 0
        assert got[0] == drive(sync, [plain])[0]
        text = [engine.tokenizer.decode(t, skip_special_tokens=True) for t in got]
        assert json.loads(text[1])["age"] == 31 and {text[2], text[3]} <= {"red", "green", "blue"}
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text[4]), text
    finally:
        sync.close()


def test_structured_rows_beside_drafting_rows(engine):
    """With n-gram speculation on, structured requests do not draft and keep their synchronous tokens (their masks
    index the plain rows of a step whose drafting rows come after them); a greedy request that copies its prompt
    drafts beside them and gets its plain tokens."""
    spec = Engine.from_config(engine.executor.cfg, ["speculative.method=ngram", "scheduler.async_steps=false"],
                              progress=False)
    sync = Engine.from_config(engine.executor.cfg, ["scheduler.async_steps=false"], progress=False)
    try:
        text = "one two three four five six seven eight nine ten"
        requests = [(chat(engine, f"Repeat exactly: {text}"), SamplingParams(temperature=0, max_tokens=24)),
                    (chat(engine, "Ann, 31, as JSON"), SamplingParams(
                        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PERSON))),
                    ("Call me at", SamplingParams(temperature=0.8, seed=11, max_tokens=16, structured_outputs=
                                                  StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")))]
        got = drive(spec, requests)
        assert got == drive(sync, requests)
        assert spec.stats()["num_accepted_tokens"] > 0
        out = [engine.tokenizer.decode(t, skip_special_tokens=True) for t in got]
        assert json.loads(out[1])["age"] == 31 and re.fullmatch(r"[0-9]{3}-[0-9]{4}", out[2]), out
    finally:
        spec.close()
        sync.close()


def test_async_grammar_masks_are_computed_while_the_previous_ids_are_accepted(engine, monkeypatch):
    """Under async steps the matchers take step k - 1's ids first; step k's mask is then computed on the
    grammar worker while the step thread accepts those ids (detokenizes, checks stops, makes outputs), and
    rows whose grammar has just ended are left out of it. The tokens stay those of synchronous steps (above)."""
    g, log, threads = engine.grammars, [], set()
    fill, later, accept = g._fill, g.mask_later, engine._accept

    def spy_fill(reqs, rows):
        threads.add(threading.current_thread().name)
        assert not any(reqs[i].matcher.is_stopped() for i in rows)
        return fill(reqs, rows)

    monkeypatch.setattr(g, "_fill", spy_fill)
    monkeypatch.setattr(g, "mask_later", lambda *a: log.append("mask") or later(*a))
    monkeypatch.setattr(engine, "_accept", lambda *a: log.append("accept") or accept(*a))
    choice = StructuredOutputsParams(choice=["red", "green", "blue", "a light shade of purple"])
    got = drive(engine, [(chat(engine, "Pick a color."), SamplingParams(temperature=1.0, seed=s, max_tokens=12,
                                                                         structured_outputs=choice))
                         for s in range(6)] + [("The sea is", SamplingParams(temperature=0, max_tokens=16))])
    assert {engine.tokenizer.decode(t, skip_special_tokens=True) for t in got[:6]} <= set(choice.choice)
    assert threads == {"pieceworks-grammar-mask_0"}
    overlapped = sum(a == "mask" and b == "accept" for a, b in zip(log, log[1:]))
    assert overlapped >= 3, log


def test_preemption_keeps_the_grammar_state(engine):
    """A KV pool too small for three structured requests at once: they are preempted and recomputed, and each
    ends with the tokens it gets in a roomy pool (its matcher stays at its output across the recompute)."""
    small = Engine.from_config(engine.executor.cfg, ["kv_cache.num_tokens=160"], progress=False)
    try:
        spec = StructuredOutputsParams(regex=r"[a-z ]{20,80}\.")
        requests = [(chat(engine, f"Describe {thing} in one long sentence."),
                     SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec))
                    for thing in ("the sea", "a forest", "the moon")]
        got = drive(small, requests)
        assert small.stats()["num_preemptions"] > 0
        assert got == drive(engine, requests)
        assert all(re.fullmatch(r"[a-z ]{20,80}\.?", small.tokenizer.decode(t)) for t in got), got
    finally:
        small.close()


def test_a_grammar_that_does_not_compile_is_refused_with_nothing_queued(engine):
    used = engine.executor.kv.allocator.num_used
    for kw, what in (({"regex": "[a-"}, "(?s)regex does not compile.*unclosed character class"),
                     ({"json": {"type": "nonsense"}}, "json does not compile"),
                     ({"grammar": "start: foo"}, "(?s)grammar does not compile.*unknown name")):
        with pytest.raises(RequestError, match=what):
            engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(**kw)))
    assert not engine.has_unfinished() and engine.executor.kv.allocator.num_used == used
    assert run(engine, ["Hi"], temperature=0, max_tokens=2)[0].finish_reason == "length"


def test_async_engine_compiles_grammars_off_its_step_thread(engine, monkeypatch):
    """A request's grammar compiles while the requests already running keep stepping: the compile below
    waits until a plain request has finished, which it can only do when the compile does not hold the step
    thread. A grammar that does not compile is the caller's RequestError; the engine goes on."""
    release, threads = threading.Event(), []
    compile_ = engine.grammars.matchers

    def slow(spec, n):
        threads.append(threading.current_thread().name)
        assert release.wait(10), "the running request made no progress while a grammar compiled"
        return compile_(spec, n)

    monkeypatch.setattr(engine.grammars, "matchers", slow)
    held = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=PERSON))

    async def main(aeng):
        async def plain():
            outs = [o async for o in aeng.generate("The weather today", SamplingParams(temperature=0, max_tokens=24,
                                                                                       min_tokens=24))]
            release.set()
            return outs[-1]

        async def structured():
            return [o async for o in aeng.generate(chat(engine, "Ann, 31, as JSON"), held)][-1]

        async def refused():
            with pytest.raises(RequestError, match="regex does not compile"):
                async for _ in aeng.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
                        regex="[a-"))):
                    pass

        return await asyncio.gather(plain(), structured(), refused())

    with AsyncEngine(engine) as aeng:
        first, second, _ = asyncio.run(main(aeng))
    assert len(first.token_ids) == 24 and first.finish_reason == "length"
    assert second.finish_reason == "stop" and json.loads(second.text) == {"name": "Ann", "age": 31}, second.text
    assert len(threads) == 2 and "pieceworks-engine-loop" not in threads
    with pytest.raises(RequestError, match="2 matchers given for n=1"):
        engine.add_request("x", held, matchers=[None, None])


def test_a_grammar_met_again_is_copied_not_compiled(engine, monkeypatch):
    """The last CACHE_SIZE grammars stay compiled; requests get copies of a matcher that never advances, so
    a spec met again gives the same output as the first time, and the least recently used grammar goes."""
    g = engine.grammars
    llg, built = g._load()[0], []

    class Counting:  # llguidance.LLMatcher, counting compiles
        def __call__(self, tok, text, **kw):
            built.append(text)
            return llg.LLMatcher(tok, text, **kw)

        def __getattr__(self, name):
            return getattr(llg.LLMatcher, name)

    monkeypatch.setattr(g, "_llg", type("LLG", (), {"LLMatcher": Counting(), "grammar_from": llg.grammar_from})())
    monkeypatch.setattr(g, "CACHE_SIZE", 2)
    monkeypatch.setattr(g, "_compiled", type(g._compiled)())
    specs = {k: StructuredOutputsParams(regex=r) for k, r in (("a", r"[0-9]{3}-[0-9]{4}"), ("b", r"[a-z]{4}"),
                                                              ("c", r"(yes|no)"))}
    texts = {}
    for k in "abacab":
        outs = run(engine, ["Call me at", "My word is"], temperature=0, max_tokens=12, n=2,
                   structured_outputs=specs[k])
        assert texts.setdefault(k, [o.text for o in outs]) == [o.text for o in outs]
        assert all(re.fullmatch(specs[k].regex, o.text) for o in outs), outs
    name = {grammar_text(llg, sp): k for k, sp in specs.items()}
    compiled = [name[t] for t in built]
    assert compiled == list("abcb"), compiled  # a and a again hit; c evicted b, which compiles again


def test_structured_outputs_start_after_the_reasoning(engine, monkeypatch):
    """With `set_reasoning(start, end)` a completion's grammar starts after the output's first `end`, unless
    the prompt closed a reasoning block already. SmolLM2 "reasons" up to a full stop here: its answer is a
    free sentence, then one of the choices; with the block closed in the prompt, the choice alone."""
    monkeypatch.setattr(engine.grammars, "reasoning", None)
    engine.grammars.set_reasoning("Thoughts:", ".")
    prompt = chat(engine, "Is the sky blue? Think in one sentence, then answer yes or no.")
    spec = StructuredOutputsParams(choice=["yes", "no"])
    free, closed = run(engine, [prompt + "Thoughts:", prompt + "Thoughts: it is day."], temperature=0,
                       max_tokens=40, structured_outputs=spec)
    thought, answer = free.text.split(".", 1)
    assert len(thought) > 5 and answer in spec.choice and free.finish_reason == "stop", free.text
    assert closed.text in spec.choice and closed.finish_reason == "stop", closed.text
    g = engine.grammars
    g.reasoning = ((7,), (8, 9))
    assert g.thinking([1, 7, 2]) == ((8, 9), 0) and g.thinking([]) == ((8, 9), 0)
    assert g.thinking([8, 9, 7, 3]) == ((8, 9), 0) and g.thinking([7, 8, 9, 1]) is None
    req = type("R", (), {"thinking": ((8, 9), 0), "matcher": None})()
    for tok, after in ((8, ((8, 9), 1)), (8, ((8, 9), 1)), (3, ((8, 9), 0)), (8, ((8, 9), 1)), (9, None)):
        assert grammar_stop(req, tok) is None and req.thinking == after


def test_a_token_the_grammar_refuses_ends_the_completion_with_an_error(engine):
    tok = engine.tokenizer
    spec = StructuredOutputsParams(choice=["red", "blue"])
    other = tok.encode(" hello", add_special_tokens=False)[:1]  # no prefix of either choice
    out, = run(engine, ["Pick:"], temperature=0, max_tokens=4, structured_outputs=spec, allowed_token_ids=other)
    assert out.finish_reason == "error" and "does not continue the request's choice" in out.error
    assert out.error_param == "structured_outputs"  # the request's own options conflict: a 400 over HTTP
    assert run(engine, ["Hi"], temperature=0, max_tokens=2)[0].finish_reason == "length"


def test_a_grammar_that_matches_no_text_ends_with_an_error_not_a_stop(engine):
    """llguidance compiles these, then its matcher falls into its error state and lets only EOS through: the
    completion ends with "error" (not "stop" with text the grammar does not match), with or without ignore_eos,
    in synchronous and async steps."""
    sync = Engine.from_config(engine.executor.cfg, ["scheduler.async_steps=false"], progress=False)
    try:
        for spec in (StructuredOutputsParams(regex=r"ab[^\s\S]"),
                     StructuredOutputsParams(grammar='start: "ab" X\nX: /[^\s\S]/')):
            for eng in (engine, sync):
                for ignore_eos in (False, True):
                    out, = run(eng, ["Say something."], temperature=0, max_tokens=10, structured_outputs=spec,
                               ignore_eos=ignore_eos)
                    assert out.finish_reason == "error" and "matches no text" in out.error, (spec, out.error)
                    assert out.error_param == "structured_outputs"
                    assert "<grammar>" not in out.error and len(out.error) < 400, out.error  # not llguidance's dump
        assert sync.stats()["kv_pages_used"] == 0 and run(engine, ["Hi"], temperature=0, max_tokens=2)[0].token_ids
    finally:
        sync.close()


def test_a_reasoning_end_whose_tokens_repeat_is_found():
    assert [end_progress((4, 4, 5), k, t) for k, t in ((0, 4), (1, 4), (2, 4), (2, 5))] == [1, 2, 2, 3]
    assert end_progress((4, 5, 4, 6), 3, 5) == 2 and end_progress((4, 5), 1, 7) == 0 and end_progress((4,), 0, 4) == 1
    req = type("R", (), {"thinking": ((4, 4, 5), 0), "matcher": None})()
    for tok in (4, 4, 4):
        grammar_stop(req, tok)
    assert req.thinking == ((4, 4, 5), 2)
    grammar_stop(req, 5)
    assert req.thinking is None


def test_json_schema_true_is_any_value_and_false_is_refused(engine):
    with pytest.raises(RequestError, match="the schema false, which no JSON value matches"):
        StructuredOutputsParams(json="false")
    for text in ('{"a": [1, true, null]}', '"x"', "[]", "2.5"):  # any value, and then the end
        m, = engine.grammars.matchers(StructuredOutputsParams(json="true"), 1)
        assert all(m.consume_token(t) for t in engine.tokenizer.encode(text, add_special_tokens=False)), text
        assert m.is_accepting() and not m.is_error(), text
    out, = run(engine, [chat(engine, "Is the sky blue? Answer true or false.")], temperature=0, max_tokens=12,
               structured_outputs=StructuredOutputsParams(json="true"))
    assert out.finish_reason in ("stop", "length") and out.text, out


def test_a_completed_grammar_ends_before_min_tokens(engine):
    """docs/sampling.md: min_tokens holds back EOS and stop ids; a grammar that is complete admits no token."""
    out, = run(engine, [chat(engine, "Yes or no?")], temperature=0, max_tokens=10, min_tokens=6,
               structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert out.finish_reason == "stop" and out.text in ("yes", "no") and len(out.token_ids) < 6


def test_refusals_without_a_tokenizer_or_llguidance(monkeypatch):
    pytest.importorskip("llguidance")
    spec = StructuredOutputsParams(regex="a")
    with pytest.raises(RequestError, match="need the model's tokenizer"):
        Grammars(None, 100, {0}).matchers(spec, 1)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(RequestError, match="pip install llguidance"):
        Grammars(None, 100, {0}).matchers(spec, 1)
