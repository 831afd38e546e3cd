"""`pieceworks serve` as a real process on 127.0.0.1, called with the official `openai` client (and
raw httpx where the client can't express the request): a tiny random Llama (token ids in and out)
and the SmolLM2 demo model (text, chat template). Greedy outputs are checked against
`Engine.generate` in this process; KV pages are checked through /metrics."""

from __future__ import annotations

import asyncio
import os
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra: pip install 'pieceworks[serve]'")
pytest.importorskip("openai", reason="needs the openai client: pip install 'pieceworks[test]'")

import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

try:
    from tests.helpers.server_process import REPO, serve
except ImportError:
    from helpers.server_process import REPO, serve

# Piecewise graphs off: on CPU they only cost compile time here (tests/test_piecewise.py covers them).
TINY = ["model.arch=llama", "model.preset=tiny", "model.max_context=256", "cuda_graph.piecewise.enabled=off"]
TINY_NAME = "llama-tiny"
MAX_QUEUE = 16


def metrics(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client (a malformed line raises); unlabelled samples by name."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.type != "unknown", fam.name  # every sample sits under its own HELP/TYPE
        for s in fam.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """The metrics once no request runs or waits and no KV page is held (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["pieceworks_num_requests_running"], m["pieceworks_num_requests_waiting"],
                m["pieceworks_kv_pages_used"]) == (0, 0, 0):
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.1)


# ---- the tiny model: token ids ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """(server URL, the same model's Engine in this process, the server process), loaded side by side."""
    from pieceworks.engine import Engine

    with serve([*TINY, "--served-model-name", TINY_NAME, "--max-queue", str(MAX_QUEUE)]) as server:
        engine = Engine.from_config(None, TINY, progress=False)
        yield server.wait(), engine, server


@pytest.fixture(scope="module")
def tiny_url(tiny):
    return tiny[0]


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    return tiny[1]


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pieceworks.engine import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs]


PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + i)] for i in range(16)]


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def test_startup_log_names_the_step_budget(tiny):
    """The server says how large its steps may be (on a CPU the defaults: 2048 tokens, 256 sequences) and how many
    tokens its KV cache holds, of which dtype."""
    log = Path(tiny[2].log.name).read_text()
    assert "steps of up to 2048 new tokens and 256 sequences" in log, log[-2000:]
    assert re.search(r"KV cache: \d+ tokens of float32 ", log), log[-2000:]


def test_models_health_and_metrics_text(tiny_url):
    assert httpx.get(f"{tiny_url}/health", timeout=5).status_code == 200
    models = client(tiny_url).models.list().data
    assert [m.id for m in models] == [TINY_NAME]
    assert models[0].model_extra["max_model_len"] == 256
    m = metrics(tiny_url)
    assert m["pieceworks_kv_pages_total"] > 0 and "pieceworks_time_to_first_token_seconds_count" in m


def test_completions_greedy_equals_engine(tiny_url, tiny_engine):
    want = greedy(tiny_engine, PROMPTS[:2], 12)
    c = client(tiny_url)
    extra = {"return_token_ids": True, "ignore_eos": True}
    r = c.completions.create(model=TINY_NAME, prompt=PROMPTS[:2], max_tokens=12, temperature=0, extra_body=extra)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert [ch.model_extra["token_ids"] for ch in r.choices] == want
    assert all(ch.finish_reason == "length" for ch in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPTS[0]) + len(PROMPTS[1]), 24)
    stream = c.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    ids = [t for ch in chunks for choice in ch.choices for t in choice.model_extra["token_ids"]]
    assert ids == want[0]
    assert sum(1 for ch in chunks if ch.choices) == 12  # one chunk per generated token
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    wait_idle(tiny_url)


def test_logit_bias_and_allowed_token_ids(tiny_url, tiny_engine):
    want = greedy(tiny_engine, PROMPTS[:1], 6)[0]
    c = client(tiny_url)
    extra = {"return_token_ids": True, "ignore_eos": True}
    forced = (want[0] + 1) % 100
    r = c.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body=extra,
                             logit_bias={str(forced): 100})
    assert r.choices[0].model_extra["token_ids"] == [forced] * 6
    r = c.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body=extra,
                             logit_bias={str(want[0]): -100})
    assert want[0] not in r.choices[0].model_extra["token_ids"]
    allowed = sorted(set(range(8)) - set(want))[:3]
    r = c.completions.create(model=TINY_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0.8,
                             extra_body=extra | {"allowed_token_ids": allowed})
    assert set(r.choices[0].model_extra["token_ids"]) <= set(allowed)
    wait_idle(tiny_url)


def test_echo_scores_the_prompt(tiny_url, tiny_engine):
    """echo + logprobs + max_tokens 0 (how evaluation harnesses score text): the prompt's tokens with their
    logprobs (the first None), as the engine's prompt_logprobs; nothing generated; streamed alike."""
    from pieceworks.engine import SamplingParams

    prompt = PROMPTS[6]
    ref = tiny_engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    c = client(tiny_url)
    r = c.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                             extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.text == "" and ch.model_extra["token_ids"] == [] and r.usage.completion_tokens == 0
    assert ch.logprobs.tokens == [f"token_id:{t}" for t in prompt]
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    assert ch.logprobs.text_offset == [0] * len(prompt)  # offsets into the text, which is empty here
    for j in range(1, len(prompt)):
        assert ch.logprobs.token_logprobs[j] == pytest.approx(ref[j][prompt[j]], abs=1e-4)
        assert 1 <= len(ch.logprobs.top_logprobs[j]) <= 2
    chunks = list(c.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                       stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}))
    lps = [x for ch in chunks for choice in ch.choices if choice.logprobs for x in choice.logprobs.token_logprobs]
    ids = [t for ch in chunks for choice in ch.choices for t in choice.model_extra["token_ids"]]
    assert len(lps) == len(prompt) + 2 and lps[0] is None and len(ids) == 2
    assert lps[1:len(prompt)] == pytest.approx([ref[j][prompt[j]] for j in range(1, len(prompt))], abs=1e-4)
    wait_idle(tiny_url)


def test_sixteen_concurrent_streams(tiny_url, tiny_engine):
    want = greedy(tiny_engine, PROMPTS, 10)
    c = openai.AsyncOpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt):
        stream = await c.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
        return [t async for ch in stream for choice in ch.choices for t in choice.model_extra["token_ids"]]

    async def all_():
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await c.close()

    assert asyncio.run(all_()) == want
    wait_idle(tiny_url)


def test_speculative_server_streams_chunks_of_several_tokens(tiny_engine):
    """A server with n-gram drafts: the streamed chunks of a greedy completion carry 1 to k + 1 tokens each, with
    one logprob per token, and add up to the plain engine's tokens; /metrics counts the drafts."""
    prompt = PROMPTS[9] * 3  # the prompt repeats itself: n-grams to look up
    want = greedy(tiny_engine, [prompt], 40)[0]
    spec = ["speculative.method=ngram", "speculative.num_speculative_tokens=3"]
    with serve([*TINY, *spec, "--served-model-name", TINY_NAME]) as server:
        url = server.wait()
        log = " ".join(Path(server.log.name).read_text().split())  # rich wraps the log's lines
        assert "speculative decoding: ngram, up to 3 drafts per row (n-grams of 2-4 tokens)" in log, log[-2000:]
        chunks = list(client(url).completions.create(
            model=TINY_NAME, prompt=prompt, max_tokens=40, temperature=0, logprobs=1, stream=True,
            extra_body={"return_token_ids": True, "ignore_eos": True}))
        per_chunk = [(c.choices[0].model_extra["token_ids"], c.choices[0].logprobs) for c in chunks if c.choices]
        assert [t for ids, _ in per_chunk for t in ids] == want
        assert max(len(ids) for ids, _ in per_chunk) > 1
        assert all(len(lp.token_logprobs) == len(ids) for ids, lp in per_chunk if ids)
        m = wait_idle(url)
        accepted = m["pieceworks_spec_decode_num_accepted_tokens_total"]
        assert m["pieceworks_spec_decode_num_draft_tokens_total"] >= accepted > 0


def test_disconnect_aborts_and_returns_pages(tiny_url):
    body = {"model": TINY_NAME, "prompt": PROMPTS[3], "max_tokens": 240, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    generated = lambda: wait_idle(tiny_url)["pieceworks_engine_generated_tokens_total"]  # noqa: E731
    before = generated()
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{tiny_url}/v1/completions", json=body) as resp:
            seen = 0
            for ln in resp.iter_lines():
                seen += ln.startswith("data:")
                if seen == 3:
                    break
    assert seen == 3
    # Closed after 3 tokens: the request is aborted long before its 240 (wait_idle: pages back, nothing runs).
    after = generated()
    assert 3 <= after - before < 240
    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):  # 240 tokens take longer than 50 ms even on a fast host
        httpx.post(f"{tiny_url}/v1/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(5.0, read=0.05))
    assert generated() - after < 240


BAD = {
    "bad type": {"model": TINY_NAME, "prompt": [1, 2], "temperature": "hot"},
    "string max_tokens": {"model": TINY_NAME, "prompt": [1, 2], "max_tokens": "5"},
    "max_tokens beyond context": {"model": TINY_NAME, "prompt": [1, 2], "max_tokens": 255},
    "prompt too long": {"model": TINY_NAME, "prompt": [1] * 256},
    "empty prompt": {"model": TINY_NAME, "prompt": []},
    "token outside vocabulary": {"model": TINY_NAME, "prompt": [1, 10**6]},
    "text without tokenizer": {"model": TINY_NAME, "prompt": "hello"},
    "top_p out of range": {"model": TINY_NAME, "prompt": [1, 2], "top_p": 2.0},
    "logprobs out of range": {"model": TINY_NAME, "prompt": [1, 2], "logprobs": 50},
    "unknown field": {"model": TINY_NAME, "prompt": [1, 2], "temprature": 0.5},
    "unsupported field": {"model": TINY_NAME, "prompt": [1, 2], "suffix": "x"},
    "max_tokens 0 without echo": {"model": TINY_NAME, "prompt": [1, 2], "max_tokens": 0},
    "n zero": {"model": TINY_NAME, "prompt": [1, 2], "n": 0},
    "n beyond the queue": {"model": TINY_NAME, "prompt": [1, 2], "n": 10**6},
    "logit_bias outside vocabulary": {"model": TINY_NAME, "prompt": [1, 2], "logit_bias": {"1000000": 1}},
    "logit_bias beyond 100": {"model": TINY_NAME, "prompt": [1, 2], "logit_bias": {"3": 101}},
    "priority under fcfs": {"model": TINY_NAME, "prompt": [1, 2], "priority": 1},
    "stream_options without stream": {"model": TINY_NAME, "prompt": [1, 2], "stream_options": {"include_usage": True}},
    "stop_token_ids outside vocabulary": {"model": TINY_NAME, "prompt": [1, 2], "stop_token_ids": [10**7]},
}
# the field the error names, where the test pins it
BAD_PARAM = {"priority under fcfs": "priority", "stream_options without stream": "stream_options",
             "stop_token_ids outside vocabulary": "stop_token_ids", "logit_bias outside vocabulary": "logit_bias",
             "n zero": "n"}


def test_bad_requests_get_400_and_the_server_keeps_serving(tiny_url):
    for name, body in BAD.items():
        r = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, (name, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", name
        assert err["message"], name
        assert err["param"] == BAD_PARAM.get(name, err["param"]), (name, err)
    assert httpx.post(f"{tiny_url}/v1/completions", content=b'{"model": ', timeout=30,
                      headers={"content-type": "application/json"}).status_code == 400
    r = httpx.post(f"{tiny_url}/v1/chat/completions", json={"model": TINY_NAME, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # fields of several shapes say what they take, not the first shape's complaint ("prompt.str: ...")
    r = httpx.post(f"{tiny_url}/v1/completions", json={"model": TINY_NAME, "prompt": [1.0]}, timeout=30)
    assert r.json()["error"] == {"message": "prompt must be a string, a list of token ids, or a list of either "
                                            "(got [1.0])", "type": "invalid_request_error", "param": "prompt",
                                 "code": None}
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    r = httpx.post(f"{tiny_url}/v1/chat/completions", timeout=30,
                   json={"model": TINY_NAME, "messages": [{"role": "user", "content": image}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert r.json()["error"]["message"].startswith('messages.0.content must be a string or a list of {"type": "text"')
    r = httpx.post(f"{tiny_url}/v1/completions", json={"model": "gpt-4", "prompt": [1, 2]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text  # OpenAI's answer
    with pytest.raises(openai.BadRequestError):  # the client sees OpenAI's error type too
        client(tiny_url).completions.create(model=TINY_NAME, prompt=[1] * 256)
    m = wait_idle(tiny_url)
    assert m["pieceworks_requests_bad_total"] >= len(BAD) + 4
    r = client(tiny_url).completions.create(model=TINY_NAME, prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_overload_answers_503_with_retry_after(tiny_url):
    body = {"model": TINY_NAME, "prompt": [5] * 60, "max_tokens": 2, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as h:
            return await asyncio.gather(*(h.post(f"{tiny_url}/v1/completions", json=body) for _ in range(48)))

    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= MAX_QUEUE, codes
    over = next(r for r in rs if r.status_code == 503)
    assert over.headers["retry-after"] == "1" and over.json()["error"]["code"] == "overloaded"
    m = wait_idle(tiny_url)
    assert m["pieceworks_requests_rejected_total"] == codes.count(503)


def test_bench_against_the_server(tiny_url, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pieceworks.cli", "bench", "--url", tiny_url, "--num-prompts", "12",
           "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5", "--request-rate", "40",
           "--max-concurrency", "4", "--result-json", str(out), "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    for row in ("TTFT", "TPOT", "ITL", "Request throughput", "Output token throughput"):
        assert row in p.stdout, p.stdout
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (12, 0)
    assert 12 * 4 <= res["total_output_tokens"] <= 12 * 12  # ignore_eos: the lengths asked for
    assert 0 < res["ttft_ms"]["p50"] <= res["ttft_ms"]["p99"] and res["itl_ms"]["p50"] > 0
    wait_idle(tiny_url)


def test_bench_sends_the_api_key_a_server_asks_for():
    """A server whose key comes from $PIECEWORKS_API_KEY (kept out of the process list; the log says where the key
    came from): bench --url without the key stops before the run with one line that says to pass it (exit 2);
    with it, from --api-key or the same variable, the run completes."""
    bench = [sys.executable, "-m", "pieceworks.cli", "bench", "--num-prompts", "2", "--input-len", "4",
             "--output-len", "2", "--no-progress"]

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*bench, *args], capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**os.environ, **(env or {})})

    with serve(TINY, env={"PIECEWORKS_API_KEY": "s3cret"}) as server:
        url = server.wait()
        logged = " ".join(server.log_tail().split())  # lines wrapped to the terminal's width
        assert "(OpenAI API under /v1, an API key required: $PIECEWORKS_API_KEY)" in logged, logged
        without = run("--url", url)
        with_key = run("--url", url, "--api-key", "s3cret")
        from_env = run("--url", url, env={"PIECEWORKS_API_KEY": "s3cret"})
        wrong = run("--url", url, "--api-key", "other", env={"PIECEWORKS_API_KEY": "s3cret"})  # the flag wins
    assert without.returncode == 2 and not without.stdout.strip(), without.stdout + without.stderr
    assert without.stderr.strip() == (f"pieceworks bench: error: {url}/v1/models answered HTTP 401 (unauthorized): "
                                      "the server wants an API key; give it with --api-key"), without.stderr
    for done in (with_key, from_env):
        assert done.returncode == 0 and "Output token throughput" in done.stdout, done.stdout + done.stderr
    assert wrong.returncode == 2 and wrong.stderr.strip().endswith("the server refused the --api-key given")


def test_bench_dataset_on_a_server_without_a_tokenizer(tiny_url, tmp_path):
    """Text prompts the server can't tokenize: one line with the server's reason, exit 2, before the run."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n")
    cmd = [sys.executable, "-m", "pieceworks.cli", "bench", "--url", tiny_url, "--num-prompts", "2", "--output-len",
           "2", "--dataset", str(prompts), "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2 and not p.stdout.strip(), p.stdout + p.stderr
    assert p.stderr.strip() == (f"pieceworks bench: error: --dataset {prompts}: the server at {tiny_url} can't "
                                "tokenize its text prompts (this model has no tokenizer (random weights): token ids "
                                "are all it takes); serve a model with a tokenizer, or leave out --dataset for "
                                "random token-id prompts (--input-len)"), p.stderr


def test_bench_in_process(tiny_engine):
    import argparse

    from pieceworks.engine import AsyncEngine
    from pieceworks.serve import bench

    args = argparse.Namespace(dataset=None, num_prompts=6, input_len=16, output_len=5, range_ratio=0.0,
                              request_rate=math.inf, max_concurrency=3, seed=0, no_progress=True)
    with AsyncEngine(tiny_engine) as engine:
        res = asyncio.run(bench._bench_engine(engine, args))
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (6, 0, 30)
    assert res["total_input_tokens"] == 6 * 16 and res["tpot_ms"]["p50"] > 0
    args.dataset = REPO / "pieceworks/data/english.txt"  # text, and the tiny model has no tokenizer
    with AsyncEngine(tiny_engine) as engine:
        with pytest.raises(ValueError, match="--dataset .*english.txt: text prompts need a tokenizer, and "
                                             "llama-tiny has none"):
            asyncio.run(bench._bench_engine(engine, args))


# ---- SmolLM2: text, chat template, stop strings, logprobs ----------------------------------------


def _demo_missing() -> str | None:
    import importlib.util

    from pieceworks.models.smollm2 import SmolLM2NotInstalled, find_gguf

    for mod in ("transformers", "gguf"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} missing: pip install 'pieceworks[demo]'"
    try:
        find_gguf()
    except SmolLM2NotInstalled as e:
        return str(e)
    return None


SMOL = ["model.path=smollm2-135m", "model.max_context=256", "cuda_graph.piecewise.enabled=off"]  # bf16
SMOL_NAME = "smollm2"


@pytest.fixture(scope="module")
def smol():
    reason = _demo_missing()
    if reason:
        pytest.skip(reason)
    from pieceworks.engine import Engine

    with serve([*SMOL, "--served-model-name", SMOL_NAME]) as server:
        engine = Engine.from_config(None, SMOL, progress=False)
        yield server.wait(), engine


@pytest.fixture(scope="module")
def smol_url(smol):
    return smol[0]


@pytest.fixture(scope="module")
def smol_engine(smol):
    return smol[1]


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_chat_greedy_equals_engine_streamed_and_not(smol_url, smol_engine):
    from pieceworks.engine import SamplingParams

    tok = smol_engine.tokenizer
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = smol_engine.generate([list(ids)], SamplingParams(max_tokens=8, temperature=0.0))[0]
    c = client(smol_url)
    r = c.chat.completions.create(model=SMOL_NAME, messages=QUESTION, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want.text and "Paris" in want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    chunks = list(c.chat.completions.create(model=SMOL_NAME, messages=QUESTION, max_tokens=8, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


@pytest.mark.slow
def test_tokenize_and_detokenize(smol_url, tiny_url):
    prompt = "The capital of France is"
    r = httpx.post(f"{smol_url}/tokenize", json={"prompt": prompt}, timeout=30).json()
    used = client(smol_url).completions.create(model=SMOL_NAME, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert r["count"] == len(r["tokens"]) == used and r["max_model_len"] > used
    back = httpx.post(f"{smol_url}/detokenize", json={"model": SMOL_NAME, "tokens": r["tokens"]}, timeout=30)
    assert back.json() == {"prompt": prompt}
    for url, route, body, param, status in ((smol_url, "detokenize", {"tokens": [10**7]}, "tokens", 400),
                                            (smol_url, "tokenize", {"model": "other", "prompt": "x"}, "model", 404),
                                            (smol_url, "tokenize", {"prompt": 3}, "prompt", 400),
                                            (tiny_url, "tokenize", {"prompt": "x"}, "model", 400)):
        r = httpx.post(f"{url}/{route}", json=body, timeout=30)
        assert r.status_code == status and r.json()["error"]["param"] == param, (route, body, r.text)


def test_chat_continues_the_final_message(smol_url, smol_engine):
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    r = client(smol_url).chat.completions.create(
        model=SMOL_NAME, messages=msgs, max_tokens=4, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    want = smol_engine.tokenizer.apply_chat_template(msgs, continue_final_message=True, tokenize=True,
                                                     return_dict=False)
    assert r.usage.prompt_tokens == len(want) and "Paris" in r.choices[0].message.content


def test_completion_text_stop_logprobs_and_n(smol_url):
    c = client(smol_url)
    prompt = "The capital of France is"
    r = c.completions.create(model=SMOL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    ch = r.choices[0]
    want = ch.text  # greedy; the chat test checks greedy text against Engine.generate
    assert "Paris" in want
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and sampled == pytest.approx(max(top.values()))  # greedy took the best
    assert "".join(lp.tokens) == ch.text
    # A stop string ends the text before it (and is not included).
    word = want.split()[1] if len(want.split()) > 1 else want.strip()
    r = c.completions.create(model=SMOL_NAME, prompt=prompt, max_tokens=8, temperature=0, stop=[word])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want[: want.index(word)]
    # n sampled completions with a seed: two choices, the same for the same seed.
    kw = dict(model=SMOL_NAME, prompt=prompt, max_tokens=4, temperature=1.0, n=2, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [x.index for x in a.choices] == [0, 1] and [x.text for x in a.choices] == [x.text for x in b.choices]
    # echo: the prompt's text first, its tokens' logprobs before the generated ones (the first None)
    r = c.completions.create(model=SMOL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=1, echo=True)
    ch = r.choices[0]
    assert ch.text == prompt + want
    assert ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.tokens) == r.usage.prompt_tokens + 8
    assert "".join(ch.logprobs.tokens) == ch.text
    m = wait_idle(smol_url)
    assert m["pieceworks_prefix_cache_queried_tokens_total"] > 0
    assert m["pieceworks_time_to_first_token_seconds_count"] >= 5


def test_structured_outputs_over_http(smol_url, tiny_url):
    pytest.importorskip("llguidance")
    c = client(smol_url)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = c.chat.completions.create(model=SMOL_NAME, messages=QUESTION, max_tokens=30, temperature=0,
                                  response_format=fmt)
    assert r.choices[0].finish_reason == "stop" and set(json.loads(r.choices[0].message.content)) == {"city"}
    chunks = c.chat.completions.create(model=SMOL_NAME, messages=QUESTION, max_tokens=30, temperature=0,
                                       response_format={"type": "json_object"}, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).startswith("{")
    r = c.completions.create(model=SMOL_NAME, prompt="The best color is", max_tokens=5, temperature=1.0, n=3,
                             seed=1, extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert {ch.text for ch in r.choices} <= {"red", "blue"}
    for url, body, param in (
            (smol_url, {"response_format": {"type": "xml"}}, "response_format"),
            (smol_url, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
            (smol_url, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
            (smol_url, {"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
            (smol_url, {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
             "structured_outputs"),
            (smol_url, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
            (tiny_url, {"structured_outputs": {"regex": "a"}}, "structured_outputs")):
        name = SMOL_NAME if url == smol_url else TINY_NAME
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/completions", timeout=30,
                           json={"model": name, "prompt": [1, 2] if url == tiny_url else "Hi", "max_tokens": 2,
                                 "stream": stream, **body})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, r.text)
    assert "does not compile" in httpx.post(f"{smol_url}/v1/completions", timeout=30, json={
        "model": SMOL_NAME, "prompt": "Hi", "structured_outputs": {"regex": "[a-"}}).json()["error"]["message"]
    # a grammar and allowed_token_ids that share no token: the request's own conflict, a 400 (not an engine error)
    other = httpx.post(f"{smol_url}/tokenize", timeout=30, json={"model": SMOL_NAME, "prompt": " hello",
                                                                  "add_special_tokens": False}).json()["tokens"][:1]
    for stream in (False, True):
        r = httpx.post(f"{smol_url}/v1/completions", timeout=30, json={
            "model": SMOL_NAME, "prompt": "Pick:", "max_tokens": 4, "temperature": 0, "stream": stream,
            "allowed_token_ids": other, "structured_outputs": {"choice": ["red", "blue"]}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
        assert err["param"] == "structured_outputs" and "does not continue" in err["message"], r.text
    # ... found at the second token of a stream already started: an error event of that type, then [DONE]
    two = httpx.post(f"{smol_url}/tokenize", timeout=30, json={"model": SMOL_NAME, "prompt": "hello world",
                                                                "add_special_tokens": False}).json()["tokens"]
    assert len(two) == 2
    r = httpx.post(f"{smol_url}/v1/completions", timeout=30, json={
        "model": SMOL_NAME, "prompt": "Say:", "max_tokens": 4, "temperature": 0, "stream": True,
        "allowed_token_ids": two[:1], "structured_outputs": {"choice": ["hello world"]}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and events[0]["choices"][0]["text"] == "hello", r.text
    assert events[-1]["error"]["type"] == "invalid_request_error", r.text
    assert events[-1]["error"]["param"] == "structured_outputs" and r.text.rstrip().endswith("[DONE]"), r.text
    assert httpx.get(f"{smol_url}/health", timeout=30).status_code == 200


def test_tool_calls_required_and_named(smol_url):
    pytest.importorskip("llguidance")
    c = client(smol_url)
    def function(name: str, arg: str) -> dict:  # strict schemas, as OpenAI's strict mode asks for them
        return {"type": "function", "function": {"name": name, "strict": True, "parameters": {
            "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg],
            "additionalProperties": False}}}

    weather, clock = function("get_weather", "city"), function("get_time", "timezone")
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=SMOL_NAME, messages=msgs, tools=[weather, clock], max_tokens=60, temperature=0)
    r = c.chat.completions.create(tool_choice="required", **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
    for call in ch.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.type == "function" and call.id.startswith("call_")
        assert set(args) == ({"city"} if call.function.name == "get_weather" else {"timezone"}), call
    one = c.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    assert len(one.message.tool_calls) == 1
    named = c.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    call, = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"timezone"}
    assert named.choices[0].finish_reason == "stop"  # a named function: OpenAI's "stop", where required says tool_calls
    # streamed: the same calls, each named in its first delta, its arguments in pieces as written; no content
    chunks = list(c.chat.completions.create(tool_choice="required", stream=True, **kw))
    deltas = [d for x in chunks if x.choices for d in x.choices[0].delta.tool_calls or []]
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id.startswith("call_") and d.function.name
            calls[d.index] = [d.function.name, ""]
        calls[d.index][1] += d.function.arguments
    assert list(calls.values()) == [[t.function.name, t.function.arguments] for t in ch.message.tool_calls]
    assert len(deltas) > 2 * len(calls)
    assert not "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == "tool_calls"
    # the call and its result as earlier turns: the conversation renders and goes on
    turns = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r = c.chat.completions.create(model=SMOL_NAME, messages=turns, tools=[weather, clock], tool_choice="none",
                                  max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
    # auto needs a parser this server was not started with
    r = httpx.post(f"{smol_url}/v1/chat/completions", timeout=30,
                   json={"model": SMOL_NAME, "messages": msgs, "tools": [weather]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"]
