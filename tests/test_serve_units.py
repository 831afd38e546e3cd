"""The server's pure parts without a model: protocol parsing, SSE framing, the Prometheus text, the
benchmark's statistics, workloads and arrival process."""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")

from pieceworks.serve import bench, prompts, stats  # noqa: E402
from pieceworks.serve.metrics import ServerMetrics  # noqa: E402
from pieceworks.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from pieceworks.serve.responses import CompletionChoice, CompletionChunk, sse  # noqa: E402


def test_request_models_are_strict():
    ok = CompletionRequest.model_validate_json('{"model": "m", "prompt": [1, 2], "temperature": 0}')
    assert ok.prompt == [1, 2] and ok.temperature == 0.0
    for body in ('{"model": "m", "prompt": "x", "temperature": "hot"}',
                 '{"model": "m", "prompt": "x", "max_tokens": "10"}',
                 '{"model": "m", "prompt": "x", "max_tokens": 1.5}',
                 '{"model": "m", "prompt": "x", "nonsense": 1}',
                 '{"model": "m"}',
                 '{"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}'):
        with pytest.raises(Exception) as exc:
            model = ChatCompletionRequest if "messages" in body else CompletionRequest
            model.model_validate_json(body)
        assert type(exc.value).__name__ == "ValidationError", body
    chat = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
        '{"type": "text", "text": "b"}]}], "stop": "x"}')
    assert chat.messages[0].text() == "a\nb" and chat.stop == "x"


def test_sse_framing_and_optional_token_ids():
    chunk = CompletionChunk(id="c", created=1, model="m", choices=[CompletionChoice(index=0, text="hi")])
    assert sse(chunk) == ('data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":'
                          '[{"index":0,"text":"hi","logprobs":null,"finish_reason":null}]}\n\n')
    with_ids = CompletionChoice(index=0, text="", token_ids=[5]).model_dump()
    assert with_ids["token_ids"] == [5]
    assert sse("[DONE]") == "data: [DONE]\n\n"


def test_metrics_text_parses_and_counts():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServerMetrics()
    for x in (0.003, 0.05, 0.05, 3.0):
        m.ttft.observe(x)
    m.tpot.observe(0.02)
    m.finished["stop"] += 2
    m.finished["length"] += 1
    text = m.render({"running": 3, "waiting": 2, "kv_pages_used": 10, "kv_pages_total": 40,
                     "prefix_cache_hit_tokens": 30, "prefix_cache_queried_tokens": 120,
                     "num_draft_tokens": 12, "num_accepted_tokens": 5})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert value[("pieceworks_num_requests_running", ())] == 3
    assert value[("pieceworks_num_requests_waiting", ())] == 2
    assert value[("pieceworks_kv_pages_used", ())] == 10
    assert value[("pieceworks_kv_cache_usage_ratio", ())] == 0.25
    assert value[("pieceworks_prefix_cache_hit_rate", ())] == 0.25
    assert value[("pieceworks_spec_decode_num_draft_tokens_total", ())] == 12
    assert value[("pieceworks_spec_decode_num_accepted_tokens_total", ())] == 5
    assert value[("pieceworks_request_success_total", (("finished_reason", "length"),))] == 1
    assert value[("pieceworks_request_success_total", (("finished_reason", "abort"),))] == 0  # a series from the start
    empty = {s.labels["finished_reason"]: s.value for f in text_string_to_metric_families(ServerMetrics().render({}))
             for s in f.samples if s.name == "pieceworks_request_success_total"}
    assert empty == {"stop": 0, "length": 0, "abort": 0, "error": 0}
    assert fams["pieceworks_time_to_first_token_seconds"].type == "histogram"
    assert fams["pieceworks_request_success"].type == "counter"
    assert fams["pieceworks_prefix_cache_hit_tokens"].type == "counter"
    assert not [f.name for f in fams.values() if f.type == "unknown"]  # every sample under its HELP/TYPE
    ttft = lambda le: value[("pieceworks_time_to_first_token_seconds_bucket", (("le", le),))]  # noqa: E731
    assert (ttft("0.001"), ttft("0.005"), ttft("0.06"), ttft("2.5"), ttft("5.0"), ttft("+Inf")) == (0, 1, 3, 3, 4, 4)
    assert value[("pieceworks_time_to_first_token_seconds_count", ())] == 4
    assert value[("pieceworks_time_to_first_token_seconds_sum", ())] == pytest.approx(3.103)


def test_request_statistics():
    r = stats.RequestRecord(prompt_tokens=10, start=1.0)
    for t, k in ((1.5, 1), (1.6, 1), (1.8, 2), (2.1, 1)):
        r.add_chunk(t, k)
    r.end = 2.1
    assert r.ttft == pytest.approx(0.5) and r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.6 / 4)  # (last - first) / (5 tokens - 1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    failed = stats.RequestRecord(prompt_tokens=4, start=0.0, error="HTTP 503")
    s = stats.summarize([r, failed], duration_s=2.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (1, 1, 5)
    assert s["output_throughput"] == 2.5 and s["total_token_throughput"] == 7.5
    assert s["itl_ms"]["p50"] == pytest.approx(200.0) and s["itl_ms"]["p90"] == pytest.approx(280.0)
    table = stats.format_table(s)
    assert "TTFT" in table and "500.00" in table and "error: HTTP 503" in table
    assert math.isnan(stats.distribution([])["p99"])


def test_workloads_and_arrivals(tmp_path):
    items = bench.random_workload(200, 100, 20, 0.5, vocab_size=50, seed=1)
    assert all(50 <= len(i.prompt) <= 150 and 10 <= i.output_len <= 30 for i in items)
    assert all(0 <= t < 50 for i in items for t in i.prompt)
    assert items == bench.random_workload(200, 100, 20, 0.5, vocab_size=50, seed=1)
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n  second prompt \n")
    assert {i.prompt for i in bench.text_workload(f, 30, 8, 0.0)} == {"first prompt", "second prompt"}
    gaps = bench.arrival_gaps(4000, rate=20.0, seed=3)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert bench.arrival_gaps(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="range-ratio"):
        bench.random_workload(1, 10, 10, 1.0, 50)
    for bad in (1.0, math.nan):
        with pytest.raises(ValueError, match="range-ratio"):
            bench.text_workload(f, 1, 8, bad)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="--request-rate"):
            bench.arrival_gaps(3, bad)


def test_run_workload_bounds_concurrency():
    in_flight, peak = 0, 0

    async def driver(item, rec):  # a stand-in that only sleeps: this tests the scheduling of sends
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        rec.add_chunk(rec.start + 0.01, item.output_len)
        rec.end = rec.start + 0.01
        in_flight -= 1

    items = bench.random_workload(12, 4, 3, 0.0, 10)
    records, _ = asyncio.run(bench.run_workload(items, driver, math.inf, 3, progress=False))
    assert peak == 3 and len(records) == 12 and all(r.ok and r.output_tokens == 3 for r in records)


def test_bench_dataset_checks(tmp_path):
    """A dataset and a result path that can't serve are refused by name, before a run."""
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "blank.txt").write_text("\n  \n")
    for name, exc, needle in [("latin1.txt", ValueError, "latin1.txt: not UTF-8 text (byte 3: invalid continuation"),
                              ("blank.txt", ValueError, "blank.txt: no non-empty line"),
                              ("none.txt", FileNotFoundError, "none.txt: no such file"),
                              (".", FileNotFoundError, ": is a directory")]:
        with pytest.raises(exc, match=f"^--dataset .*{re.escape(needle)}"):
            bench.dataset_lines(tmp_path / name)
    bench.check_result_path(tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()  # the check leaves no file behind
    bench.check_result_path(tmp_path / "blank.txt")
    assert (tmp_path / "blank.txt").read_text() == "\n  \n"  # nor changes one that exists
    for path, needle in [(tmp_path, "is a directory"), (tmp_path / "no" / "out.json", "does not exist"),
                         (tmp_path / "blank.txt" / "out.json", "is not a directory"),
                         (Path("/proc/out.json"), r"can't be written \(")]:
        with pytest.raises(ValueError, match=f"^--result-json .*{needle}"):
            bench.check_result_path(path)


def test_bench_asks_the_server_to_tokenize_a_dataset(tmp_path):
    """--dataset over HTTP: a server that refuses to tokenize (no tokenizer) is an error before the run; one
    without /tokenize (404) is left to the requests."""
    import httpx

    f = tmp_path / "p.txt"
    f.write_text("first prompt\n")
    sent = []

    async def check(answer):
        def handler(req):
            sent.append(json.loads(req.content))
            return answer
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await bench._check_server_tokenizes(client, "http://host", "m", f)

    asyncio.run(check(httpx.Response(200, json={"tokens": [1, 2], "count": 2})))
    asyncio.run(check(httpx.Response(404, text="not found")))
    assert sent[0] == {"model": "m", "prompt": "first prompt"}
    refusal = {"error": {"message": "this model has no tokenizer", "type": "invalid_request_error"}}
    with pytest.raises(ValueError, match=r"can't tokenize its text prompts \(this model has no tokenizer\)"):
        asyncio.run(check(httpx.Response(400, json=refusal)))


def test_bench_refuses_a_server_without_a_model_list():
    import httpx

    async def models(answer):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await bench._served_models(client, "http://host")

    card = {"id": "m", "vocab_size": 10, "max_model_len": 64}
    assert asyncio.run(models(lambda req: httpx.Response(200, json={"data": [card]}))) == [card]
    for answer in (httpx.Response(404, text="not found"), httpx.Response(200, text="<html>"),
                   httpx.Response(200, json={"data": []})):
        with pytest.raises(ValueError, match=r"http://host/v1/models answered HTTP \d+ without a list of models"):
            asyncio.run(models(lambda req, answer=answer: answer))


def _sse(*events) -> bytes:
    return "".join(map(sse, events)).encode()


def test_bench_counts_aborted_cut_and_slow_requests_as_failed():
    """A stream the server aborts (finish_reason abort: a restart, a shutdown's drain), one that ends without a
    finish_reason, and one past --timeout are failures, with what they got; a finished one is not."""
    import httpx

    def chunk(ids, finish=None):
        return {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}]}

    async def drive(body: bytes, timeout=None, delay=0.0):
        async def handler(req):
            await asyncio.sleep(delay)
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            rec = bench.RequestRecord(prompt_tokens=3, start=0.0)
            await bench.http_driver(client, "http://host", "m", timeout)(bench.WorkItem([1, 2, 3], 3, 4), rec)
            return rec

    done = asyncio.run(drive(_sse(chunk([5, 6]), chunk([7, 8], "length"), "[DONE]")))
    assert done.ok and done.output_tokens == 4
    aborted = asyncio.run(drive(_sse(chunk([5]), chunk([], "abort"), "[DONE]")))
    assert not aborted.ok
    assert aborted.error == "the server aborted the request after 1 of 4 tokens (finish_reason abort)"
    cut = asyncio.run(drive(_sse(chunk([5, 6]))))
    assert not cut.ok and "ended after 2 of 4 tokens without a finish_reason" in cut.error
    slow = asyncio.run(drive(_sse(chunk([5, 6, 7, 8], "length"), "[DONE]"), timeout=0.05, delay=0.5))
    assert not slow.ok and slow.error == "not done within --timeout 0.05 s (0 of 4 tokens)"


def test_bench_result_json_is_strict_and_a_model_card_without_a_vocabulary_is_named(monkeypatch):
    import httpx

    result = {"request_rate": math.inf, "ttft_ms": {"p50": math.nan, "mean": 2.5}, "runs": [math.inf, 1]}
    assert bench.finite(result) == {"request_rate": None, "ttft_ms": {"p50": None, "mean": 2.5}, "runs": [None, 1]}
    json.dumps(bench.finite(result), allow_nan=False)

    def server(req):  # another OpenAI-compatible server: its model cards have no vocab_size
        return httpx.Response(200, json={"data": [{"id": "m", "object": "model"}]})

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(server), **kw))
    with pytest.raises(ValueError, match="lists 'm' without its vocab_size .* give text prompts with --dataset"):
        asyncio.run(bench._bench_http(bench_args(["--url", "http://host"])))


def bench_args(argv: list[str]):
    import argparse

    from pieceworks.serve.cli import add_bench_arguments

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return p.parse_args(argv)


# ---- request -> SamplingParams ---------------------------------------------------------------------


class _Templated:
    """A tokenizer stand-in that renders its chat template with Jinja (as transformers does, `raise_exception`
    included) and encodes the text as bytes; `broken`: it fails in its own code instead."""

    name_or_path = "/srv/models/m"

    def __init__(self, template: str, broken: bool = False):
        self.chat_template, self.broken = template, broken

    def apply_chat_template(self, messages, **kw):
        import jinja2

        if self.broken:
            raise RuntimeError("not the template's")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.Environment()
        env.globals["raise_exception"] = raise_exception
        variables = {k: v for k, v in kw.items() if k not in ("tokenize", "return_dict", "continue_final_message")}
        return list(env.from_string(self.chat_template).render(messages=messages, **variables).encode())


def _bad(fn, *args, param=None, match=None):
    from pieceworks.serve.protocol import BadRequest

    with pytest.raises(BadRequest, match=match) as exc:
        fn(*args)
    assert exc.value.param == param
    return exc.value


def test_sampling_params_from_requests():
    from pieceworks.serve import mapping

    req = CompletionRequest.model_validate_json(
        '{"model": "m", "prompt": [1], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "seed": 3, '
        '"stop": "END", "stop_token_ids": [7], "n": 2, "logprobs": 4, "presence_penalty": 0.5, '
        '"frequency_penalty": -0.5, "repetition_penalty": 1.1, "ignore_eos": true, "min_tokens": 2, '
        '"include_stop_str_in_output": true, "skip_special_tokens": false}')
    p = mapping.sampling_params(req, 9, 100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (9, 0.5, 0.9, 40, 0.1, 3)
    assert (p.stop, p.stop_token_ids, p.n, p.logprobs, p.ignore_eos, p.min_tokens) == (["END"], [7], 2, 4, True, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    d = mapping.sampling_params(CompletionRequest(model="m", prompt=[1]), 16, 100)
    assert (d.temperature, d.top_p, d.n, d.logprobs, d.stop) == (1.0, 1.0, 1, None, None)  # OpenAI's defaults
    chat = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 5}')
    assert mapping.sampling_params(chat, 4, 100).logprobs == 5
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert mapping.sampling_params(plain, 4, 100).logprobs == 0
    _bad(mapping.sampling_params, CompletionRequest(model="m", prompt=[1], top_p=2.0), 4, 100, param="top_p")
    _bad(mapping.sampling_params, CompletionRequest(model="m", prompt=[1], n=0), 4, 100, param="n")
    _bad(mapping.sampling_params, CompletionRequest(model="m", prompt=[1], logprobs=21), 4, 100, param="logprobs")
    _bad(mapping.sampling_params, ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                                        top_logprobs=2), 4, 100, param="top_logprobs")
    biased = CompletionRequest(model="m", prompt=[1], logit_bias={"7": -100, "0": 2.5, "99": 100})
    assert mapping.sampling_params(biased, 4, 100).logit_bias == {7: -100.0, 0: 2.5, 99: 100.0}
    for bias, match in (({"100": 1.0}, r"token ids in \[0, 100\)"), ({"-1": 1.0}, "decimal"), ({"a": 1.0}, "decimal"),
                        ({"1.0": 1.0}, "decimal"), ({"\u0663": 1.0}, "decimal"), ({"5": 100.5}, r"\[-100, 100\]"),
                        ({"5": -101}, r"\[-100, 100\]")):
        _bad(mapping.sampling_params, biased.model_copy(update={"logit_bias": bias}), 4, 100, param="logit_bias",
             match=match)
    only = CompletionRequest(model="m", prompt=[1], allowed_token_ids=[3, 99])
    assert mapping.sampling_params(only, 4, 100).allowed_token_ids == [3, 99]
    _bad(mapping.sampling_params, only.model_copy(update={"allowed_token_ids": [100]}), 4, 100,
         param="allowed_token_ids", match="outside the vocabulary")
    _bad(mapping.sampling_params, only.model_copy(update={"allowed_token_ids": []}), 4, 100,
         param="allowed_token_ids", match="non-empty")


def test_chat_template_options():
    tok = _Templated("{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}>{% endif %}")
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                 chat_template_kwargs={"greeting": "G:"})
    assert bytes(prompts.chat_prompt(chat, tok)) == b"G:x>"
    assert bytes(prompts.chat_prompt(chat.model_copy(update={"add_generation_prompt": False}), tok)) == b"G:x"
    named = _Templated("{% for m in messages %}{{ m.name }}:{{ m.content }}{% endfor %}")  # OpenAI's `name`
    assert bytes(prompts.chat_prompt(ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x", "name": "ann"}]), named)) == b"ann:x"
    _bad(prompts.chat_prompt, chat.model_copy(update={"continue_final_message": True}), tok,
         param="continue_final_message", match="add_generation_prompt: false")
    _bad(prompts.chat_prompt, chat.model_copy(update={"continue_final_message": True, "add_generation_prompt": False}),
         tok, param="continue_final_message", match="must be the assistant's")
    _bad(prompts.chat_prompt, chat.model_copy(update={"chat_template_kwargs": {"tokenize": False}}), tok,
         param="chat_template_kwargs", match=r"\['tokenize'\]")
    # the tokenizer's options are not template variables: they would truncate or pad the prompt
    for key, value in (("truncation", True), ("max_length", 3), ("padding", "max_length"), ("tokenizer_kwargs", {})):
        _bad(prompts.chat_prompt, chat.model_copy(update={"chat_template_kwargs": {key: value}}), tok,
             param="chat_template_kwargs", match=rf"\['{key}'\]")

    class Named(_Templated):  # a parameter of the installed apply_chat_template counts as well
        def apply_chat_template(self, messages, *, new_option=None, **kw):
            return super().apply_chat_template(messages, **kw)

    _bad(prompts.chat_prompt, chat.model_copy(update={"chat_template_kwargs": {"new_option": 1}}),
         Named(tok.chat_template), param="chat_template_kwargs", match=r"\['new_option'\]")


def test_lengths_prompts_and_unsupported_fields():
    from pieceworks.serve import mapping

    req = CompletionRequest(model="m", prompt=[1, 2, 3])
    assert mapping.max_tokens_for(req, 3, 100) == 16  # OpenAI's completions default
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert mapping.max_tokens_for(chat, 30, 100) == 70  # chat: the rest of the context
    assert mapping.max_tokens_for(chat.model_copy(update={"max_completion_tokens": 5}), 30, 100) == 5
    e = _bad(mapping.max_tokens_for, req.model_copy(update={"max_tokens": 98}), 3, 100, param="max_tokens")
    assert e.code == "context_length_exceeded" and "at most 97" in str(e)
    _bad(mapping.max_tokens_for, req, 100, 100, param="prompt", match="shorten the prompt")
    # min_tokens without max_tokens: against the room left (chat) and the default of 16 (completions), by name
    e = _bad(mapping.max_tokens_for, chat.model_copy(update={"min_tokens": 71}), 30, 100, param="min_tokens")
    assert e.code == "context_length_exceeded" and "min_tokens = 71 with a 30-token prompt needs 101" in str(e)
    assert mapping.max_tokens_for(chat.model_copy(update={"min_tokens": 70}), 30, 100) == 70
    _bad(mapping.max_tokens_for, req.model_copy(update={"min_tokens": 17}), 3, 100, param="min_tokens",
         match="min_tokens = 17 exceeds max_tokens, which is 16 when not given")
    _bad(mapping.max_tokens_for, req.model_copy(update={"max_tokens": 0}), 3, 100, param="max_tokens")
    assert prompts.completion_prompts(CompletionRequest(model="m", prompt=[[1, 2], [3]]), None, 10) == [[1, 2], [3]]
    _bad(prompts.completion_prompts, CompletionRequest(model="m", prompt=[1, 10]), None, 10, param="prompt",
         match="outside the vocabulary")
    _bad(prompts.completion_prompts, CompletionRequest(model="m", prompt="hi"), None, 10, param="prompt",
         match="no tokenizer")
    _bad(prompts.completion_prompts, CompletionRequest(model="m", prompt=[]), None, 10, param="prompt")
    _bad(prompts.chat_prompt, ChatCompletionRequest(model="m", messages=[]), None, param="messages")
    chat_req = ChatCompletionRequest(model="m", messages=[{"role": "tool", "content": "hi"}])
    e = _bad(prompts.chat_prompt, chat_req, _Templated("{{ raise_exception('roles user and assistant only') }}"),
             param="messages", match="the chat template refused the messages: TemplateError: roles user and")
    assert "/" not in str(e)  # Jinja's message, not the server's paths
    with pytest.raises(RuntimeError, match="not the template's"):  # a 500, not the client's fault
        prompts.chat_prompt(chat_req, _Templated("{{ messages[0].content }}", broken=True))
    assert prompts.chat_prompt(chat_req, _Templated("{{ messages[0].content }}")) == [104, 105]
    _bad(mapping.check_model, req.model, "other", param="model")
    echo = req.model_copy(update={"echo": True, "logprobs": 2})
    assert mapping.max_tokens_for(echo.model_copy(update={"max_tokens": 0}), 3, 100) == 1  # scored, then dropped
    _bad(mapping.max_tokens_for, req.model_copy(update={"max_tokens": 0}), 3, 100, param="max_tokens")
    assert mapping.sampling_params(echo, 4, 100).prompt_logprobs == 2
    assert mapping.sampling_params(req.model_copy(update={"logprobs": 2}), 4, 100).prompt_logprobs is None
    assert prompts.echo_texts(echo, None, [[1, 2, 3]]) == [""]
    texts = CompletionRequest(model="m", prompt=["ab", "c"], echo=True)
    assert prompts.echo_texts(texts, None, [[1], [2]]) == ["ab", "c"]
    assert prompts.echo_texts(req, None, [[1, 2, 3]]) is None
    for field, value in (("suffix", "x"), ("best_of", 3)):
        _bad(mapping.refuse_unsupported, req.model_copy(update={field: value}), param=field)
    mapping.refuse_unsupported(chat.model_copy(update={"tools": [{"type": "function"}]}))  # tools.plan checks them
    mapping.refuse_unsupported(chat.model_copy(update={"response_format": {"type": "text"}}))


def test_chat_logprobs_list_the_top_tokens_best_first():
    from types import SimpleNamespace

    from pieceworks.serve.writers import ChatWriter

    srv = SimpleNamespace(token_str=lambda t: f"<{t}>", token_bytes=lambda t: [t])
    req = SimpleNamespace(logprobs=True, top_logprobs=2)
    lp = ChatWriter(srv, req)._logprobs([7, 3], [{7: -0.1, 3: -2.5, 9: -1.0}, {3: -0.2, 4: -0.3}])
    assert [c.token for c in lp.content] == ["<7>", "<3>"]
    assert lp.content[0].logprob == -0.1
    assert [(t.token, t.logprob) for t in lp.content[0].top_logprobs] == [("<7>", -0.1), ("<9>", -1.0)]
    assert [t.token for t in lp.content[1].top_logprobs] == ["<3>", "<4>"]
    assert [c.bytes for c in lp.content] == [[7], [3]] and lp.content[1].top_logprobs[1].bytes == [4]


def test_completion_top_logprobs_hold_the_chosen_token():
    """OpenAI's completions logprobs: the k most likely tokens and the chosen one (up to k + 1 entries)."""
    from types import SimpleNamespace

    from pieceworks.serve.writers import CompletionWriter

    srv = SimpleNamespace(token_str=lambda t, first=False: f"<{t}>", tokenizer=None)
    req = CompletionRequest(model="m", prompt=[1], logprobs=1)
    lp = CompletionWriter(srv, req)._logprobs(0, [3, 7], [{7: -0.1, 3: -2.5, 9: -1.0}, {7: -0.2, 4: -0.3}])
    assert lp.top_logprobs == [{"<7>": -0.1, "<3>": -2.5}, {"<7>": -0.2}]  # sampled 3 (not the best), then 7
    assert lp.token_logprobs == [-2.5, -0.2] and lp.text_offset == [0, 0]

