"""The Engine with a tokenizer (the SmolLM2 demo model, see test_smollm2.py): text prompts, incremental
detokenization, stop strings, and EOS ids read from the checkpoint."""

from __future__ import annotations

import json

import pytest

from pieceworks import Engine, SamplingParams
from pieceworks.engine.detokenize import Detokenizer
from pieceworks.engine.engine import eos_token_ids
from pieceworks.errors import RequestError

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers.built_tokenizers import byte_fallback_tokenizer
except ImportError:
    from helpers.built_tokenizers import byte_fallback_tokenizer

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def engine(smollm2_cpu_engine):
    return smollm2_cpu_engine


def test_eos_ids_from_the_checkpoint(engine, tmp_path):
    assert engine.eos_token_ids == {2}  # generation_config.json
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert eos_token_ids(tmp_path) == {5, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert eos_token_ids(tmp_path) == {9}
    assert eos_token_ids(None) == frozenset()


def stream(engine: Engine, prompt, params: SamplingParams):
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.fixture(scope="module")
def greedy(engine):
    return stream(engine, PROMPT, SamplingParams(temperature=0, max_tokens=N))


N = 12


def test_text_streams_and_matches_decode(engine, greedy):
    tok = engine.tokenizer
    outs = greedy
    final = outs[-1]
    assert len(outs) == N and final.finish_reason == "length"
    assert final.text == tok.decode(final.token_ids, skip_special_tokens=True) and final.text.strip()
    assert "".join(o.text_delta for o in outs) == final.text
    assert all(outs[i].text == "".join(o.text_delta for o in outs[: i + 1]) for i in range(len(outs)))
    ids = tok(PROMPT)["input_ids"]
    assert final.prompt_token_ids == ids
    assert engine.executor.generate([ids], N)[0] == final.token_ids  # same greedy tokens


def test_delta_outputs_add_up_to_the_cumulative_ones(engine):
    """output_kind "delta": each streamed output carries this step's token_ids, logprobs and text, which add up to
    the cumulative stream's (a stop string held back included); `generate`'s one output stays whole."""
    kw = dict(temperature=0, max_tokens=N, logprobs=2, stop=[" and"])
    whole = stream(engine, PROMPT, SamplingParams(**kw))
    parts = stream(engine, PROMPT, SamplingParams(**kw, output_kind="delta"))
    final = whole[-1]
    assert [o.token_ids for o in parts] == [o.new_token_ids for o in parts] == [o.new_token_ids for o in whole]
    assert [t for o in parts for t in o.token_ids] == final.token_ids
    assert [lp for o in parts for lp in o.logprobs] == final.logprobs and len(final.logprobs) == len(final.token_ids)
    assert [o.text for o in parts] == [o.text_delta for o in whole] and "".join(o.text for o in parts) == final.text
    got, = engine.generate(PROMPT, SamplingParams(**kw, output_kind="delta"))
    assert (got.token_ids, got.text, got.logprobs) == (final.token_ids, final.text, final.logprobs)
    with pytest.raises(RequestError, match="output_kind must be one of cumulative, delta"):
        SamplingParams(output_kind="final")


def test_stop_string_ends_the_text_before_it(engine, greedy):
    full = greedy[-1]
    words = full.text.split()
    stop = next(w for w in words[1:] if len(w) >= 3 and full.text.find(w) > 4)
    outs = stream(engine, PROMPT, SamplingParams(temperature=0, max_tokens=N, stop=[stop, "zzzz-never"]))
    final = outs[-1]
    assert final.finish_reason == "stop"
    assert final.text == full.text[: full.text.find(stop)]
    assert "".join(o.text_delta for o in outs) == final.text
    assert final.token_ids == full.token_ids[: len(final.token_ids)] and len(final.token_ids) < N


def test_stop_strings_in_async_steps_match_synchronous_steps(engine, greedy):
    """Requests with stop strings run async steps (the stop is found when a token arrives, as EOS; the
    row of the step in flight is dropped): the same text, tokens and finish reasons as synchronous steps."""
    from pieceworks.executor.cuda_graph import EagerDecodeRunner

    ex = engine.executor
    words = greedy[-1].text.split()
    stops = [w for w in words[1:] if len(w) >= 3][:3] + ["zzzz-never"]
    prompts = [PROMPT, "Once upon a time", "The capital of France is"]
    params = [SamplingParams(temperature=0, max_tokens=N, stop=[s]) for s in stops]
    reqs = [(p, sp) for p in prompts for sp in params]

    def run() -> list[tuple[str, list[int], str]]:
        ids = [engine.add_request(p, sp) for p, sp in reqs]
        final = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = (o.text, o.token_ids, o.finish_reason)
        return [final[i] for i in ids]

    before = engine.stats()["num_async_steps"]
    engine._async = False  # synchronous steps (scheduler.async_steps=false) for the reference
    try:
        sync = run()
    finally:
        engine._async = True
    assert engine.stats()["num_async_steps"] == before
    ex.decode_graphs = EagerDecodeRunner(ex.model, ex.table, ex.kv, ex.max_context, [1, 2, 4, 8, 16])
    try:
        got = run()
        assert engine.stats()["num_async_steps"] > before
    finally:
        ex.decode_graphs = None
    assert got == sync
    assert sum(reason == "stop" for _, _, reason in got) >= 3


def test_stop_string_kept_and_special_tokens_shown_when_asked(engine, greedy):
    full = greedy[-1]
    words = full.text.split()
    stop = next(w for w in words[1:] if len(w) >= 3 and full.text.find(w) > 4)
    outs = stream(engine, PROMPT, SamplingParams(temperature=0, max_tokens=N, stop=[stop],
                                                 include_stop_str_in_output=True))
    final = outs[-1]
    assert final.finish_reason == "stop" and final.text == full.text[: full.text.find(stop) + len(stop)]
    assert "".join(o.text_delta for o in outs) == final.text
    tok = engine.tokenizer
    eos = tok.convert_ids_to_tokens(2)  # SmolLM2's EOS, a special token
    d = Detokenizer(tok, [1], skip_special=False)
    shown = Detokenizer(tok, [1])
    for t in tok(" alpha", add_special_tokens=False)["input_ids"] + [2]:
        d.add(t)
        shown.add(t)
    assert d.text == " alpha" + eos and shown.text == " alpha"


def feed(d: Detokenizer, ids: list[int]) -> list[str]:
    """`d`'s deltas as `ids` arrive one by one (until a stop string ends the text), then its final delta."""
    deltas = []
    for t in ids:
        d.add(t)
        deltas.append(d.delta(final=False))
        if d.stopped:
            break
    deltas.append(d.delta(final=True))
    return deltas


def test_detokenizer_holds_back_a_possible_stop_string(engine):
    tok = engine.tokenizer
    ids = tok(" alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok, [1], stop=["gamma"])
    deltas = feed(d, ids)
    assert d.stopped and d.text == " alpha beta "
    assert "".join(deltas) == d.text


def test_with_include_stop_nothing_is_held_back(engine):
    """include_stop_str_in_output: the text ends with the stop string, so none of it is held back from the deltas
    (without it, the last len(stop) - 1 characters wait for the next token)."""
    tok = engine.tokenizer
    ids = tok(" alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    for include, final in ((True, " alpha beta gamma"), (False, " alpha beta ")):
        d = Detokenizer(tok, [1], stop=["gamma", "a much longer stop string"], include_stop=include)
        deltas = feed(d, ids)
        assert "".join(deltas) == d.text == final, (include, deltas)
        assert (deltas[0] == " alpha") == include, deltas  # held back without include_stop


def test_stop_strings_wait_for_min_tokens(engine, greedy):
    """As vLLM's: stop strings are looked for once more than min_tokens tokens are out; one that ends within the
    first min_tokens tokens' text does not stop the completion, one after does."""
    tok = engine.tokenizer
    ids = tok(" alpha beta gamma beta delta", add_special_tokens=False)["input_ids"]
    ends = [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]  # text length after each token
    first = next(i for i in range(len(ids)) if ends[i] >= len(" alpha beta"))  # the token that completes the stop
    for min_tokens, want in ((0, " alpha"), (first, " alpha"), (first + 1, " alpha beta gamma")):
        d = Detokenizer(tok, [1], stop=[" beta"], min_tokens=min_tokens)
        for t in ids:
            d.add(t)
        assert d.stopped and d.text == want, (min_tokens, d.text)
    # a longer second stop (that never appears) widens nothing: " beta" inside the first min_tokens still doesn't stop
    d = Detokenizer(tok, [1], stop=[" beta", " never appears here"], min_tokens=first + 1)
    for t in ids:
        d.add(t)
    assert d.stopped and d.text == " alpha beta gamma", d.text
    # through the engine: the greedy text's first word as a stop string, min_tokens past the token that ends it
    full = greedy[-1]
    word = full.text.split()[0]
    k = next(i for i in range(N) if word in tok.decode(full.token_ids[: i + 1]))
    early = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, stop=[word]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == k + 1
    late = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, stop=[word], min_tokens=k + 1))[0]
    assert late.token_ids[: k + 2] == full.token_ids[: k + 2] and len(late.token_ids) > k + 1


def test_text_the_tokenizer_refuses_is_a_request_error(engine):
    """A lone surrogate makes the tokenizer raise its own TypeError: the request is refused by name, and the
    engine takes the next one."""
    with pytest.raises(RequestError, match="tokenizer can't encode this prompt"):
        engine.add_request("\ud800", SamplingParams(max_tokens=2))
    outs = engine.generate("Hello", SamplingParams(temperature=0, max_tokens=2))
    assert len(outs) == 1 and len(outs[0].token_ids) == 2


def test_the_stop_token_text_stays_out_of_the_text(engine, greedy):
    """As vLLM's: a completion ended by EOS or a stop token keeps its id in token_ids, not its text (with
    skip_special_tokens off too, where EOS would otherwise show)."""
    ids = greedy[-1].token_ids
    k = next(i for i in range(2, N) if ids[i] not in ids[:i])
    tok = engine.tokenizer
    for skip in (True, False):
        outs = stream(engine, PROMPT, SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[ids[k]],
                                                     skip_special_tokens=skip))
        final = outs[-1]
        assert final.finish_reason == "stop" and final.token_ids == ids[: k + 1]
        assert final.text == tok.decode(ids[:k], skip_special_tokens=skip) == "".join(o.text_delta for o in outs)


def test_token_bytes_rebuild_characters_that_tokens_share(engine):
    """Chat logprobs' `bytes`: a token holding part of a UTF-8 character decodes to U+FFFD on its own; its bytes are
    the part's (byte-level BPE here, SentencePiece byte-fallback pieces in the stand-in), so that joined over the
    tokens they rebuild the text."""
    from pieceworks.models.tokenizer import token_bytes

    tok = engine.tokenizer
    for text in ("😀 fine", "日本語のテキスト", " café"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        shown = [tok.decode([t]) for t in ids]
        assert any("\ufffd" in s for s in shown[:2]) or text == " café"
        assert b"".join(token_bytes(tok, t, s) for t, s in zip(ids, shown)).decode() == text

    class Fallback:  # SentencePiece with byte fallback: "€" as three byte pieces
        pieces = {5: "<0xE2>", 6: "<0x82>", 7: "<0xAC>", 8: "\u2581euro"}

        def convert_ids_to_tokens(self, i):
            return self.pieces[i]

    got = b"".join(token_bytes(Fallback(), t, "\ufffd" if t < 8 else " euro") for t in (5, 6, 7, 8))
    assert got.decode() == "€ euro"


def test_a_prompt_ending_in_byte_tokens_cut_mid_character_leaves_the_output_readable():
    """The last PROMPT_CONTEXT (5) prompt tokens start inside the first emoji's bytes: decoded with them, the
    output's byte tokens joined an invalid run and came out as U+FFFD ('\ufffd\ufffd\ufffd ok'); the context is
    the shortest longer suffix that decodes cleanly (vLLM's rule)."""
    tok = byte_fallback_tokenizer()
    prompt = tok.encode("I love \U0001F600\U0001F600", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(prompt[-5:]) == ["<0x80>", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    out = [tok.convert_tokens_to_ids(p) for p in [f"<0x{b:02X}>" for b in "\u65e5".encode()] + ["\u2581ok"]]
    d = Detokenizer(tok, prompt)
    deltas = feed(d, out)
    assert d.text == "\u65e5 ok" and "".join(deltas) == d.text, deltas


def test_the_text_of_a_stop_token_id_only_with_include_stop_str_in_output(engine, greedy):
    """As vLLM's: the token id that ends a request (stop_token_ids, EOS) is in the ids; its text is in the text only
    with include_stop_str_in_output (and for a special token, such as EOS, only where specials are not skipped)."""
    tok, ids = engine.tokenizer, greedy[-1].token_ids
    k = next(i for i in range(2, N) if ids[i] not in ids[:i])
    texts = {}
    for include in (False, True):
        outs = stream(engine, PROMPT, SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[ids[k]],
                                                     include_stop_str_in_output=include))
        final = outs[-1]
        assert final.finish_reason == "stop" and final.token_ids == ids[: k + 1]
        assert "".join(o.text_delta for o in outs) == final.text
        texts[include] = final.text
    assert texts == {False: tok.decode(ids[:k]), True: tok.decode(ids[: k + 1])}, texts
    eos = tok.convert_ids_to_tokens(2)
    for skip, include, tail in ((True, True, ""), (False, False, ""), (False, True, eos)):
        # EOS held back for one token (min_tokens), then taken (its bias)
        final = engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N, allowed_token_ids=[ids[0], 2],
                                                       logit_bias={2: 100.0}, min_tokens=1, skip_special_tokens=skip,
                                                       include_stop_str_in_output=include))[0]
        assert final.token_ids == [ids[0], 2] and final.finish_reason == "stop", final
        assert final.text == tok.decode(ids[:1]) + tail, (skip, include, final.text)
