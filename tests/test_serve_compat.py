"""The server against OpenAI's API as its clients use it: an assistant message sent back as the SDK returns it,
OpenAI's own request fields (accepted, or refused by name), messages without content, the developer role, 404 for
an unknown model and `GET /v1/models/{model}`, `usage: null` on a stream's chunks, the request field an engine
refusal names, and the port `pieceworks serve --port 0` listens on. The apps run in this process (httpx's ASGI
transport): the tiny random Llama (token ids) and the SmolLM2 demo model (chat template, structured outputs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")
pytest.importorskip("openai", reason="needs the openai client: pip install 'pieceworks[test]'")

import httpx  # noqa: E402
import openai  # noqa: E402

from pieceworks.engine import AsyncEngine, Engine  # noqa: E402
from pieceworks.serve import mapping, prompts  # noqa: E402
from pieceworks.serve.app import build_app  # noqa: E402
from pieceworks.serve.protocol import BadRequest, ChatCompletionRequest, CompletionRequest, parse_body  # noqa: E402

try:
    from tests.helpers.built_tokenizers import byte_fallback_tokenizer
    from tests.helpers.server_process import wait_healthy
except ImportError:  # tests/ on sys.path
    from helpers.built_tokenizers import byte_fallback_tokenizer
    from helpers.server_process import wait_healthy

TINY = ["model.arch=llama", "model.preset=tiny", "model.max_context=256", "cuda_graph.piecewise.enabled=off"]
USER = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def tiny_engine():
    engine = Engine.from_config(None, TINY, progress=False)
    yield engine
    engine.close()


def ask(engine, name: str, calls, **app_kw):
    """`calls(client)` (an async function of an httpx client) against `build_app(engine, name)`; its result."""
    async def main():
        with AsyncEngine(engine) as ae:
            transport = httpx.ASGITransport(app=build_app(ae, name, **app_kw), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
                return await calls(client)

    return asyncio.run(main())


def events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


class _Template:
    """A tokenizer stand-in: renders its chat template with Jinja (with the variables apply_chat_template passes
    on) and encodes the text as bytes."""

    name_or_path = "/srv/models/m"

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt=True, continue_final_message=False, tokenize=True,
                            return_dict=False, **variables):
        import jinja2

        text = jinja2.Environment().from_string(self.chat_template).render(messages=messages, **variables)
        return list(text.encode())


ROLES = _Template("{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}{{ reasoning_effort }}")


def rendered(body: dict, tok=ROLES) -> str:
    req = parse_body(json.dumps({"model": "m", **body}).encode(), ChatCompletionRequest)
    mapping.refuse_unsupported(req)
    return bytes(prompts.chat_prompt(req, tok)).decode()


def refused(body: dict, param: str, match: str = "") -> BadRequest:
    with pytest.raises(BadRequest) as exc:
        rendered(body)
    assert exc.value.param == param and match in str(exc.value), (str(exc.value), exc.value.param)
    return exc.value


# ---- messages and OpenAI's request fields --------------------------------------------------------------


def test_assistant_messages_as_the_sdk_returns_them():
    """`messages.append(resp.choices[0].message.model_dump())`: OpenAI's fields on the message, null or ignored;
    a refusal with no content is that turn's text."""
    dumped = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}
    assert rendered({"messages": [USER, dumped]}) == f"user:{USER['content']}|assistant:Paris.|"
    refusal = {**dumped, "content": None, "refusal": "I can't help with that."}
    assert rendered({"messages": [USER, refusal]}).endswith("|assistant:I can't help with that.|")
    refused({"messages": [USER, {**dumped, "audio": {"id": "audio_1"}}]}, "messages.1.audio", "audio is not supported")
    refused({"messages": [USER, {**dumped, "function_call": {"name": "f", "arguments": "{}"}}]},
            "messages.1.function_call", "tool_calls")
    refused({"messages": [{**USER, "refusal": "no"}]}, "messages.0.refusal", "only assistant messages")
    # an answer of a server with --reasoning-parser, as returned: its reasoning reaches templates that show it
    thinking = _Template("{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}/{{ m.content }}|{% endfor %}")
    assert bytes(prompts.chat_prompt(parse_body(json.dumps({"model": "m", "messages": [
        USER, {**dumped, "reasoning_content": "Capital of France."}]}).encode(), ChatCompletionRequest), thinking)
                 ).decode().endswith("|assistant:Capital of France./Paris.|")
    refused({"messages": [{**USER, "reasoning_content": "x"}]}, "messages.0.reasoning_content", "only assistant")
    with pytest.raises(BadRequest, match="messages.0.cache_control: Extra inputs"):  # not OpenAI's: refused
        rendered({"messages": [{**USER, "cache_control": {"type": "ephemeral"}}]})


def test_openai_request_fields_accepted_or_refused_by_name():
    msgs = [USER]
    assert rendered({"messages": msgs, "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                     "modalities": ["text"], "prediction": None, "audio": None, "prompt_cache_key": "k",
                     "safety_identifier": "u1"})
    refused({"messages": msgs, "store": True}, "store", "stores nothing")
    refused({"messages": msgs, "modalities": ["text", "audio"]}, "modalities", "text only")
    for name, value, why in (("functions", [{"name": "f"}], "use tools"), ("function_call", "auto", "use tool_choice"),
                             ("prediction", {"type": "content", "content": "x"}, "predicted outputs"),
                             ("web_search_options", {}, "search"), ("audio", {"voice": "alloy"}, "text only"),
                             ("verbosity", "low", "no verbosity control")):
        refused({"messages": msgs, name: value}, name, why)
    with pytest.raises(BadRequest, match="temprature"):  # a field OpenAI lacks is refused as before
        rendered({"messages": msgs, "temprature": 1})


def test_reasoning_effort_is_a_template_variable():
    assert rendered({"messages": [USER], "reasoning_effort": "low"}).endswith("|low")
    assert rendered({"messages": [USER], "chat_template_kwargs": {"reasoning_effort": "high"}}).endswith("|high")
    refused({"messages": [USER], "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
            "reasoning_effort", "disagree")


def test_messages_without_content():
    """OpenAI refuses a user, system, developer or tool message without content; an assistant message may leave
    it out when it carries tool_calls or a refusal."""
    for role in ("user", "system", "developer", "tool"):
        for message in ({"role": role}, {"role": role, "content": None}, {"role": role, "content": []}):
            refused({"messages": [message]}, "messages.0.content", f"a {role!r} message needs content")
    assert rendered({"messages": [{"role": "user", "content": ""}]}) == "user:|"  # empty text is content
    refused({"messages": [USER, {"role": "assistant", "content": None}]}, "messages.1.content",
            "content, tool_calls or a refusal")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert rendered({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]})


def test_the_developer_role_reaches_the_template_as_system():
    assert rendered({"messages": [{"role": "developer", "content": "Be brief."}, USER]}).startswith(
        "system:Be brief.|user:")


# ---- over HTTP -------------------------------------------------------------------------------------------


def test_unknown_model_is_404_and_a_model_retrieves(tiny_engine):
    async def calls(c):
        r = await c.post("/v1/completions", json={"model": "gpt-4", "prompt": [1, 2]})
        assert r.status_code == 404, r.text
        assert r.json()["error"] == {"message": "the model 'gpt-4' does not exist; this server serves 'org/tiny'",
                                     "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        listed = (await c.get("/v1/models")).json()["data"][0]
        assert (await c.get("/v1/models/org/tiny")).json() == listed
        r = await c.get("/v1/models/gpt-4")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        sdk = openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused", http_client=c, max_retries=0)
        card = await sdk.models.retrieve("org/tiny")  # the SDK sends the "/" as %2F
        assert card.id == "org/tiny" and card.model_extra["max_model_len"] == 256
        with pytest.raises(openai.NotFoundError):
            await sdk.models.retrieve("gpt-4")
        with pytest.raises(openai.NotFoundError):
            await sdk.chat.completions.create(model="gpt-4", messages=[USER])

    ask(tiny_engine, "org/tiny", calls)


def test_stream_chunks_carry_usage_null_before_the_usage_chunk(tiny_engine):
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True, "stream": True}

    async def calls(c):
        with_usage = events((await c.post("/v1/completions", json={
            **body, "stream_options": {"include_usage": True}})).text)
        without = events((await c.post("/v1/completions", json=body)).text)
        return with_usage, without

    with_usage, without = ask(tiny_engine, "tiny", calls)
    assert len(with_usage) == 4 and all("usage" in e and e["usage"] is None for e in with_usage[:-1]), with_usage
    assert with_usage[-1]["usage"]["completion_tokens"] == 3 and with_usage[-1]["choices"] == []
    assert len(without) == 3 and not any("usage" in e for e in without), without


def test_engine_refusals_name_the_request_field(tiny_engine):
    """A refusal the engine makes (stop strings without a tokenizer) names the field the client sent, in its
    terms, streamed or not."""
    async def calls(c):
        out = []
        for stream in (False, True):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "stop": ["x"],
                                                      "stream": stream})
            assert r.status_code == 400, r.text
            out.append(r.json()["error"])
        return out

    for err in ask(tiny_engine, "tiny", calls):
        assert err["param"] == "stop" and err["message"].startswith("stop=['x'] needs a tokenizer"), err
        assert "SamplingParams" not in err["message"], err
    # a grammar that conflicts with the request's other options names the field the grammar came from
    req = parse_body(json.dumps({"model": "m", "messages": [USER], "response_format": {"type": "json_object"}})
                     .encode(), ChatCompletionRequest)
    err = mapping.client_error(BadRequest("structured_outputs: the sampled token 'x' does not continue",
                                          param="structured_outputs", code="unsatisfiable"), req)
    assert (str(err), err.param, err.code) == ("response_format: the sampled token 'x' does not continue",
                                               "response_format", "unsatisfiable")


def test_sdk_round_trip_and_schema_refusals_on_a_chat_model(smollm2_cpu_engine):
    """The SmolLM2 demo model: an answer sent back as the SDK returns it, a streamed chat's usage nulls, and a
    schema that does not compile named by the field that carried it (response_format, structured_outputs, or
    tools under a named tool_choice)."""
    pytest.importorskip("llguidance")
    bogus = {"type": "bogus"}
    tool = {"type": "function", "function": {"name": "f", "parameters": bogus}}
    bad = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bogus}},
           "structured_outputs": {"json": bogus},
           "tools": {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}}

    async def calls(c):
        sdk = openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused", http_client=c, max_retries=0)
        kw = dict(model="smol", max_tokens=4, temperature=0)
        messages = [USER]
        r = await sdk.chat.completions.create(messages=messages, **kw)
        messages.append(r.choices[0].message.model_dump())
        assert "refusal" in messages[-1] and "annotations" in messages[-1]
        messages.append({"role": "user", "content": "And of Italy?"})
        r = await sdk.chat.completions.create(messages=messages, **kw)
        assert r.choices[0].message.content
        chunks = [ch async for ch in await sdk.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kw)]
        assert all(ch.usage is None and "usage" in ch.model_fields_set for ch in chunks[:-1])
        assert chunks[-1].usage.completion_tokens == 4
        errors = {}
        for field, extra in bad.items():
            for stream in (False, True):
                body = {"model": "smol", "messages": [USER], "max_tokens": 4, "stream": stream}
                r = await c.post("/v1/chat/completions", json={**body, **(extra if field == "tools" else
                                                                           {field: extra})})
                assert r.status_code == 400, r.text
                errors[field, stream] = r.json()["error"]
        return errors

    for (field, _), err in ask(smollm2_cpu_engine, "smol", calls).items():
        assert err["param"] == field and "does not compile" in err["message"], err
        assert "StructuredOutputsParams" not in err["message"], err


# ---- pieceworks serve --port 0 ---------------------------------------------------------------------------


def test_serve_on_port_0_logs_the_port_it_listens_on(monkeypatch, caplog):
    import uvicorn

    from pieceworks.serve.cli import run_serve

    engine = Engine.from_config(None, TINY, progress=False)  # its own: serving shuts the engine down
    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(lambda cls, *a, **k: cls(engine)))
    servers = []
    real_init = uvicorn.Server.__init__

    def init(self, *args, **kwargs):
        servers.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(uvicorn.Server, "__init__", init)
    caplog.set_level(logging.INFO, logger="pieceworks.serve")
    args = argparse.Namespace(host="127.0.0.1", port=0, served_model_name="tiny", max_queue=8, shutdown_timeout=5.0,
                              tool_call_parser=None, reasoning_parser=None, api_key=None)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run_serve(args, None)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not any("serving tiny at" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not come up"
            time.sleep(0.05)
        line = next(r.getMessage() for r in caplog.records if "serving tiny at" in r.getMessage())
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        assert port != 0, line
        wait_healthy(f"http://127.0.0.1:{port}", thread, deadline, f"nothing answers on port {port}")
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(30)
    assert result == [0]


def test_bodies_that_are_no_json_are_named_so_with_their_code():
    """A lone surrogate escape parses as Python's JSON but not as pydantic's: the same error as any bad JSON."""
    lone = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'
    for body in (b'{"model": "m", "messages": [', lone):
        with pytest.raises(BadRequest, match="the body is not valid JSON") as exc:
            parse_body(body, ChatCompletionRequest)
        assert exc.value.code == "invalid_json", body


def test_logprob_token_strings_keep_sentencepiece_spaces():
    """A SentencePiece tokenizer drops a piece's leading space at a sequence's start, so `decode([id])` read "▁ok" as
    "ok": the token strings (completions' tokens, chat's token and bytes) lost every space and did not join to the
    text; they keep it, but for an echoed prompt's first token, which starts the text."""
    tok = byte_fallback_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    engine = Engine.from_config(None, TINY, progress=False)
    engine = Engine(engine.executor, tokenizer=tok)
    ok = tok.convert_tokens_to_ids("\u2581ok")

    async def calls(c):
        body = {"model": "sp", "prompt": "I love ok", "max_tokens": 3, "temperature": 0, "logprobs": 1,
                "echo": True, "allowed_token_ids": [ok]}
        done = (await c.post("/v1/completions", json=body)).json()["choices"][0]
        chat = {"model": "sp", "messages": [USER], "max_tokens": 2, "logprobs": True, "allowed_token_ids": [ok]}
        answer = (await c.post("/v1/chat/completions", json=chat)).json()["choices"][0]
        return done, answer

    try:
        done, answer = ask(engine, "sp", calls)
    finally:
        engine.close()
    tokens = done["logprobs"]["tokens"]
    assert done["text"] == "I love ok ok ok ok" and "".join(tokens) == done["text"], tokens
    assert [done["text"][o:] for o in done["logprobs"]["text_offset"]][-1] == " ok"
    content = answer["logprobs"]["content"]
    assert answer["message"]["content"] == " ok ok" and [e["token"] for e in content] == [" ok", " ok"]
    assert b"".join(bytes(e["bytes"]) for e in content) == b" ok ok"


def test_spaces_between_special_tokens_is_accepted():
    """vLLM's field, sent by some clients: accepted with either value (a fast tokenizer's text is the same)."""
    for value in (True, False):
        body = {"model": "m", "prompt": [1], "spaces_between_special_tokens": value}
        assert parse_body(json.dumps(body).encode(), CompletionRequest).spaces_between_special_tokens is value


def test_an_api_key_guards_the_v1_routes(tiny_engine):
    """`--api-key`: the /v1 routes answer 401 (OpenAI's invalid_api_key) without the key or with another; the others
    (a probe and a scrape carry none) and CORS preflights stay open, as in vLLM; with `Authorization: Bearer KEY`
    the SDK's requests run."""
    async def calls(c):
        bare = {p: (await c.get(p)).status_code for p in ("/health", "/metrics", "/v1/models", "/v1/models/tiny")}
        posts = {p: (await c.post(p, json={"model": "tiny", "prompt": [1, 2]})).status_code
                 for p in ("/v1/completions", "/tokenize")}
        posts["OPTIONS /v1/completions"] = (await c.options("/v1/completions")).status_code
        wrong = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        none = await c.get("/v1/models")
        sdk = openai.AsyncOpenAI(base_url="http://app/v1", api_key="s3cret", http_client=c, max_retries=0)
        done = await sdk.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0)
        refused = openai.AsyncOpenAI(base_url="http://app/v1", api_key="other", http_client=c, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await refused.models.list()
        return bare, posts, wrong, none, done

    bare, posts, wrong, none, done = ask(tiny_engine, "tiny", calls, api_key="s3cret")
    assert bare == {"/health": 200, "/metrics": 200, "/v1/models": 401, "/v1/models/tiny": 401}
    # /tokenize answers as without a key (400: the tiny model has no tokenizer); OPTIONS: 405, as without a key
    assert posts == {"/v1/completions": 401, "/tokenize": 400, "OPTIONS /v1/completions": 405}
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert wrong.json()["error"]["message"].startswith("a wrong API key: send `Authorization: Bearer <key>`")
    assert none.json()["error"]["message"].startswith("no Authorization header")
    assert done.usage.completion_tokens == 3
