"""`pieceworks serve` under SIGTERM: no new requests, the streams in flight get --shutdown-timeout seconds, then
end with a finish_reason "abort" chunk and [DONE] (not cut mid-stream), and the log says so."""

from __future__ import annotations

import json
import signal
import time

import pytest

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers.server_process import ServerProcess
except ImportError:
    from helpers.server_process import ServerProcess

# a tiny model with room for a stream far longer than the test (thousands of tokens on a CPU take seconds)
LONG = ["model.arch=llama", "model.preset=tiny", "runtime.device=cpu", "model.sizes.max_position_embeddings=16384",
        "kv_cache.num_tokens=16384", "--shutdown-timeout", "1"]


def stream_signalled(httpx, server: ServerProcess, signals: dict[int, int]) -> tuple[list[str], float]:
    """A long completion streamed from `server`, which gets `signals[n]` once n events are in; the events (the
    `data: ` payloads) and when the first signal went."""
    url = server.wait()
    body = {"model": "llama-tiny", "prompt": [1, 2, 3], "max_tokens": 16000, "stream": True, "ignore_eos": True}
    events, first = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                events.append(line.removeprefix("data: "))
            if line and len(events) in signals:
                server.proc.send_signal(signals[len(events)])
                first = first or time.monotonic()
    return events, first


def test_sigterm_ends_streams_in_flight_with_abort_after_the_timeout():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    server = ServerProcess(LONG)
    try:
        events, signalled = stream_signalled(httpx, server, {3: signal.SIGTERM})
        took = time.monotonic() - signalled
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort", last
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
        assert 0.8 < took < 10, took  # the timeout's second, not a cut at once nor a wait for 16000 tokens
        assert server.proc.wait(30) == 128 + signal.SIGTERM  # the engine closed on the way out
        log = server.log_tail()
        assert "shutting down: no new requests; 1 in flight get 1 s to finish, then end" in " ".join(log.split())
        assert "Cancel" not in log, log  # uvicorn had nothing left to cancel at its own deadline
    finally:
        server.stop()


def test_a_second_ctrl_c_aborts_the_streams_at_once():
    """The first SIGINT gives the stream 30 s; the second ends it now with its abort chunk and [DONE] (uvicorn's own
    second-signal exit cut it mid-stream with a traceback per connection), and the server exits 130."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    server = ServerProcess(LONG[:-1] + ["30"])
    try:
        events, first = stream_signalled(httpx, server, {3: signal.SIGINT, 6: signal.SIGINT})
        assert time.monotonic() - first < 10  # not the 30 s of --shutdown-timeout
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort", events[-3:]
        assert server.proc.wait(30) == 130
        log = " ".join(server.log_tail().split())
        assert "second signal: 1 in flight end now with finish_reason abort" in log, log
        assert "Traceback" not in log and log.endswith("interrupted"), log
    finally:
        server.stop()


def test_a_third_sigterm_stops_without_waiting():
    """uvicorn forces its exit on a repeated SIGINT only: a third SIGTERM does too, with a connection still open (a
    request whose body never ends holds the graceful shutdown for --shutdown-timeout + 1 s)."""
    import socket

    pytest.importorskip("uvicorn")
    server = ServerProcess(LONG[:-1] + ["60"])
    try:
        url = server.wait()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as held:
            held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            time.sleep(0.5)
            for _ in range(3):
                server.proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
            assert server.proc.wait(20) == 128 + signal.SIGTERM
    finally:
        server.stop()
