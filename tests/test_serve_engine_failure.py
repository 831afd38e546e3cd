"""The server once the engine's step loop fails: requests are a 500 `engine_dead`, a running stream ends with
an error event and `[DONE]`, /health answers 503, and `pieceworks serve` stops with exit code 1 (a supervisor
restarts it). A step that raises stands in for a device fault."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")

import httpx  # noqa: E402

from pieceworks.engine import AsyncEngine, Engine  # noqa: E402
from pieceworks.serve.app import build_app  # noqa: E402

try:
    from tests.helpers.server_process import wait_healthy
except ImportError:  # tests/ on sys.path
    from helpers.server_process import wait_healthy

TINY = ["model.arch=llama", "model.preset=tiny", "model.max_context=256", "cuda_graph.piecewise.enabled=off"]
BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 24, "ignore_eos": True}


def fail_from(engine: Engine, call: int) -> None:
    """Make the engine's `call`-th step from now (1-based) and every later one raise."""
    real, calls = engine.step, [0]

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= call:
            raise RuntimeError("simulated device fault in a step")
        return real(*args, **kwargs)

    engine.step = step


def events(text: str) -> list:
    return [json.loads(p) if p != "[DONE]" else p for line in text.splitlines()
            if line.startswith("data: ") and (p := line[len("data: "):])]


def test_requests_streams_and_health_after_the_loop_fails():
    async def main():
        engine = Engine.from_config(None, TINY, progress=False)
        with AsyncEngine(engine) as ae:
            app = build_app(ae, "tiny")
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=60) as c:
                ok = await c.post("/v1/completions", json=BODY)
                assert ok.status_code == 200 and (await c.get("/health")).status_code == 200
                fail_from(engine, 4)  # a stream that has started: its 4th step fails
                r = await c.post("/v1/completions", json={**BODY, "stream": True})
                assert r.status_code == 200
                ev = events(r.text)
                assert ev[-1] == "[DONE]", ev
                assert ev[-2]["error"]["code"] == "engine_dead", ev[-2]
                assert "simulated device fault" in ev[-2]["error"]["message"]
                assert any("choices" in e for e in ev[:-2]), ev  # the tokens before the fault came through
                assert not ae.alive and isinstance(ae.wait_failed(0), RuntimeError)
                r = await c.post("/v1/completions", json=BODY)  # refused at once: nothing can run
                assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
                h = await c.get("/health")
                assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead", h.text

    asyncio.run(main())


def test_health_after_shutdown_and_no_failure_reported():
    engine = Engine.from_config(None, TINY, progress=False)
    ae = AsyncEngine(engine)
    assert ae.alive and ae.wait_failed(0) is None
    ae.shutdown()
    assert not ae.alive and ae.wait_failed(0) is None  # a shutdown is not a failure

    async def main():
        app = build_app(ae, "tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            assert (await c.get("/health")).status_code == 503

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_stops_with_exit_code_1_when_the_loop_fails(monkeypatch):
    from pieceworks.serve.cli import run_serve

    engine = Engine.from_config(None, TINY, progress=False)
    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(lambda cls, *a, **k: cls(engine)))
    port = free_port()
    args = argparse.Namespace(host="127.0.0.1", port=port, served_model_name="tiny", max_queue=8, shutdown_timeout=5.0,
                              tool_call_parser=None, reasoning_parser=None, api_key=None)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(run_serve(args, None)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, thread, time.monotonic() + 60)
    assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).status_code == 200
    fail_from(engine, 1)
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
    thread.join(30)
    assert not thread.is_alive(), "pieceworks serve kept running after its engine failed"
    assert result == [1]
