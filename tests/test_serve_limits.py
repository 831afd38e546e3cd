"""What one client's request may cost the server: a body past the size limit is a 413 before it is read whole; more
prompts x n than the queue holds are refused before any prompt is read; a request's sampling fields are checked once
for all its prompts; stop strings past the limit and JSON nested past Python's stack are 400s (not a 500); and a
request is read (JSON, tokens, parameters) off the event loop, so /health answers meanwhile. The tiny random Llama
in this process, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")

import httpx  # noqa: E402

from pieceworks.engine import AsyncEngine, Engine  # noqa: E402
from pieceworks.serve import app as app_module  # noqa: E402
from pieceworks.serve import mapping, prompts  # noqa: E402
from pieceworks.serve.app import build_app  # noqa: E402

TINY = ["model.arch=llama", "model.preset=tiny", "model.max_context=256", "cuda_graph.piecewise.enabled=off"]


@pytest.fixture(scope="module")
def tiny_engine():
    engine = Engine.from_config(None, TINY, progress=False)
    yield engine
    engine.close()


def ask(engine, calls, **app_kw):
    """`calls(client)` (an async function of an httpx client) against the app over `engine`; its result."""
    async def main():
        with AsyncEngine(engine) as ae:
            transport = httpx.ASGITransport(app=build_app(ae, "tiny", **app_kw), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client:
                return await calls(client)

    return asyncio.run(main())


def body(**kw) -> dict:
    return {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, **kw}


def test_a_body_past_the_limit_is_413(tiny_engine, monkeypatch):
    """Refused by its Content-Length, or once the bytes of a chunked upload pass the limit; a body under it runs."""
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 4096)
    big = body(user="x" * 5000)

    async def chunked():  # no Content-Length: the bytes are counted as they arrive
        raw = httpx.Request("POST", "http://app", json=big).content
        for i in range(0, len(raw), 1000):
            yield raw[i : i + 1000]

    async def calls(c):
        return (await c.post("/v1/completions", json=big), await c.post("/v1/completions", content=chunked()),
                await c.post("/v1/completions", json=body()))

    sized, streamed, fine = ask(tiny_engine, calls)
    for r in (sized, streamed):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and "the server's limit of 0.003906 MiB" in r.text
    assert "chunked" in streamed.request.headers.get("transfer-encoding", "")
    assert fine.status_code == 200, fine.text


def test_prompts_past_the_queue_are_refused_before_any_is_read(tiny_engine, monkeypatch):
    """2,000 prompts with a logit_bias over the whole vocabulary: a 400 naming the queue, and no prompt's parameters
    built (they took a minute on the event loop); 3 prompts: their parameters are built and checked once."""
    built = []
    real = mapping.sampling_params
    monkeypatch.setattr(mapping, "sampling_params", lambda *a, **k: built.append(1) or real(*a, **k))
    bias = {str(t): -1 for t in range(tiny_engine.executor.vocab_size)}

    async def calls(c):
        return (await c.post("/v1/completions", json=body(prompt=[[1]] * 2000, logit_bias=bias)),
                await c.post("/v1/completions", json=body(prompt=[[1]] * 200, n=2)))

    many, doubled = ask(tiny_engine, calls)
    assert many.status_code == 400 and "2000 prompts in one request exceed the server's queue of 256" in many.text
    assert doubled.status_code == 400 and doubled.json()["error"]["param"] == "n"
    assert not built
    three = ask(tiny_engine, lambda c: c.post("/v1/completions", json=body(prompt=[[1], [1, 2], [1, 2, 3]],
                                                                          max_tokens=None, logit_bias=bias)))
    assert three.status_code == 200 and len(three.json()["choices"]) == 3
    assert len(built) == 1


def test_stop_strings_past_the_limit(tiny_engine):
    many = [f"s{i}" for i in range(mapping.MAX_STOP_STRINGS + 1)]

    async def calls(c):
        return [await c.post("/v1/completions", json=body(stop=stop)) for stop in (
            many, many[:-1], ["x" * (mapping.MAX_STOP_CHARS + 1)])]

    over, fits, long = ask(tiny_engine, calls)
    for r in (over, long):
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert f"at most {mapping.MAX_STOP_STRINGS} of at most {mapping.MAX_STOP_CHARS} characters" in r.text
    assert fits.status_code == 400 and "needs a tokenizer" in fits.text  # past the server's check: the engine's


def test_json_nested_past_pythons_stack_is_400(tiny_engine):
    deep = b'{"model": "tiny", "prompt": [1], "logit_bias": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    schema = body(structured_outputs={"json": "[" * 5000 + "]" * 5000})

    async def calls(c):
        return (await c.post("/v1/completions", content=deep, headers={"content-type": "application/json"}),
                await c.post("/v1/completions", json=schema))

    for r in ask(tiny_engine, calls):
        assert r.status_code == 400 and "maximum recursion depth exceeded" in r.text, r.text


def test_requests_are_read_off_the_event_loop(tiny_engine, monkeypatch):
    """A request whose reading blocks (a long prompt's tokenization) holds its worker thread, not the event loop:
    /health answers while it waits, and only then is it let go."""
    gate, entered = threading.Event(), threading.Event()
    waited = []
    real = prompts.completion_prompts

    def slow(*args, **kw):
        entered.set()
        waited.append(gate.wait(30))  # on the event loop, /health could not answer: False after 30 s
        return real(*args, **kw)

    monkeypatch.setattr(prompts, "completion_prompts", slow)

    async def calls(c):
        request = asyncio.create_task(c.post("/v1/completions", json=body()))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        health = await c.get("/health")
        gate.set()
        return health, await request

    health, done = ask(tiny_engine, calls)
    assert health.status_code == 200 and done.status_code == 200, done.text
    assert waited == [True]
