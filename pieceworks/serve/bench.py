"""`pieceworks bench`: a serving benchmark against a running server (HTTP, streamed) or an in-process
`AsyncEngine`.

A workload is N requests, each a prompt (random token ids of random length, or text from a file) and an
output length (fixed by `ignore_eos`, so every run generates the same number of tokens). Requests are
sent at Poisson arrivals of a given rate (exponential gaps; `inf` sends all at once) and/or with at most
C in flight. The result is `stats.summarize`'s table and JSON.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pieceworks.serve.stats import RequestRecord, format_table, summarize


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: a prompt (token ids, or text the server tokenizes) and its output length."""

    prompt: list[int] | str
    prompt_tokens: int  # for text prompts: counted by the server (0 until then)
    output_len: int


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def check_range_ratio(range_ratio: float) -> None:
    """ValueError unless 0 <= range_ratio < 1 (NaN included)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio {range_ratio}: must be in [0, 1)")


def check_request_rate(rate: float) -> None:
    """ValueError unless `rate` is positive (inf: all at once); NaN is refused."""
    if not rate > 0:
        raise ValueError(f"--request-rate {rate}: must be a positive number of requests/s (inf: all at once)")


def dataset_lines(path: Path) -> list[str]:
    """The non-empty lines of a UTF-8 text file, stripped.

    Raises:
        FileNotFoundError: `path` is missing or a directory.
        ValueError: the OS won't read it, it is not UTF-8, or it has no non-empty line.
    """
    from pieceworks.util import flag_text

    text = flag_text("--dataset", path)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"--dataset {path}: no non-empty line to use as a prompt")
    return lines


def check_result_path(path: Path) -> None:
    """ValueError unless `path` can be written as a file: not a directory, in an existing directory, opened for
    writing (checked before a run, which would otherwise end without its result; a file the check creates is
    removed, an existing one is left as it is)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--result-json {path}: is a directory; give a file path such as {path / 'bench.json'}")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise ValueError(f"--result-json {path}: {parent} {what}; give a path in an existing directory")
    existed = path.exists()
    try:
        with open(path, "a"):  # an access check can't tell: root, read-only mounts, /proc
            pass
    except OSError as exc:
        raise ValueError(f"--result-json {path}: can't be written ({exc.strerror}); write elsewhere") from None
    if not existed:
        path.unlink(missing_ok=True)


def random_workload(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int = 0) -> list[WorkItem]:
    """`num` prompts of random token ids; lengths uniform in mean * [1 - range_ratio, 1 + range_ratio]."""
    check_range_ratio(range_ratio)
    rng = random.Random(seed)
    items = []
    for _ in range(num):
        n = _length(rng, input_len, range_ratio)
        items.append(WorkItem([rng.randrange(vocab_size) for _ in range(n)], n, _length(rng, output_len, range_ratio)))
    return items


def text_workload(path: Path, num: int, output_len: int, range_ratio: float, seed: int = 0) -> list[WorkItem]:
    """`num` prompts drawn (with replacement, seeded) from the non-empty lines of a UTF-8 text file."""
    check_range_ratio(range_ratio)
    lines = dataset_lines(path)
    rng = random.Random(seed)
    return [WorkItem(rng.choice(lines), 0, _length(rng, output_len, range_ratio)) for _ in range(num)]


def arrival_gaps(num: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request: a Poisson process of `rate` requests/s (0 for inf)."""
    check_request_rate(rate)
    rng = random.Random(seed + 1)
    return [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(num)]


# A driver sends one item and fills in its record; it must not raise.
Driver = Callable[[WorkItem, RequestRecord], Any]


async def run_workload(items: list[WorkItem], driver: Driver, rate: float, max_concurrency: int | None,
                       seed: int = 0, progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Send every item through `driver` at the arrivals and concurrency asked; (records, seconds)."""
    gaps = arrival_gaps(len(items), rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    bar = _Progress(len(items), progress)

    async def one(item: WorkItem) -> None:
        if sem is not None:
            async with sem:
                await send(item)
        else:
            await send(item)

    async def send(item: WorkItem) -> None:
        rec = RequestRecord(prompt_tokens=item.prompt_tokens, start=time.perf_counter())
        records.append(rec)
        try:
            await driver(item, rec)
        except Exception as exc:  # a failed request is counted, not fatal to the run
            rec.error = f"{type(exc).__name__}: {exc}"
        bar.advance()

    start = time.perf_counter()
    tasks = []
    with bar:
        for item, gap in zip(items, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(item)))
        await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self._p, self._task = total, enabled, None, None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._p = Progress("requests", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False)
            self._p.__enter__()
            self._task = self._p.add_task("bench", total=self.total)
        return self

    def advance(self) -> None:
        if self._p is not None:
            self._p.advance(self._task)

    def __exit__(self, *exc: Any) -> None:
        if self._p is not None:
            self._p.__exit__(*exc)


# ---- drivers -------------------------------------------------------------------------------------


async def _sse_events(response: Any) -> AsyncIterator[dict]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def http_driver(client: Any, url: str, model: str, timeout: float | None = None) -> Driver:
    """Streams /v1/completions of the server at `url` (greedy, ignore_eos, token ids returned); a request not done
    within `timeout` seconds (from its start to its last event) fails."""

    async def drive(item: WorkItem, rec: RequestRecord) -> None:
        try:
            await asyncio.wait_for(stream(item, rec), timeout)
        except asyncio.TimeoutError:
            rec.error = f"not done within --timeout {timeout:g} s ({rec.output_tokens} of {item.output_len} tokens)"

    async def stream(item: WorkItem, rec: RequestRecord) -> None:
        body = {"model": model, "prompt": item.prompt, "max_tokens": item.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return
            finish = None
            async for ev in _sse_events(resp):
                if "error" in ev:
                    rec.error = ev["error"].get("message", "error event")
                    return
                t = time.perf_counter()
                for ch in ev.get("choices", []):
                    rec.add_chunk(t, len(ch.get("token_ids") or []))
                    finish = ch.get("finish_reason") or finish
                if ev.get("usage"):
                    rec.prompt_tokens = ev["usage"]["prompt_tokens"]
        rec.end = time.perf_counter()
        rec.error = cut_short(finish, rec.output_tokens, item.output_len)

    return drive


def cut_short(finish: str | None, got: int, asked: int) -> str | None:
    """The error of a request that did not run its course (a failed one in the results): the server aborted it
    (a restart, a shutdown's drain), or its stream ended without a finish_reason; None for one that finished."""
    if finish == "abort":
        return f"the server aborted the request after {got} of {asked} tokens (finish_reason abort)"
    if finish is None:
        return f"the stream ended after {got} of {asked} tokens without a finish_reason"
    return None


def engine_driver(engine: Any) -> Driver:
    """Runs each item through an in-process `AsyncEngine` (greedy, ignore_eos)."""
    from pieceworks.engine import SamplingParams

    async def drive(item: WorkItem, rec: RequestRecord) -> None:
        prompt = item.prompt
        if isinstance(prompt, str):
            prompt = engine.tokenizer.encode(prompt)
            rec.prompt_tokens = len(prompt)
        params = SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True)
        finish = None
        async for out in engine.generate(prompt, params):
            rec.add_chunk(time.perf_counter(), len(out.new_token_ids))
            if out.finished:
                finish = out.finish_reason
                if finish == "error":
                    rec.error = out.error or "engine error"
        rec.end = time.perf_counter()
        rec.error = rec.error or cut_short(finish, rec.output_tokens, item.output_len)

    return drive


# ---- the command ---------------------------------------------------------------------------------


def _workload(args: Any, vocab_size: int, max_context: int) -> list[WorkItem]:
    if args.dataset is not None:
        return text_workload(args.dataset, args.num_prompts, args.output_len, args.range_ratio, args.seed)
    items = random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_size,
                            args.seed)
    longest = max(len(i.prompt) + i.output_len for i in items)
    if longest > max_context:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} (range ratio "
                         f"{args.range_ratio}) reaches {longest} tokens, beyond the model's context of "
                         f"{max_context}: shorten them")
    return items


async def _served_models(client: Any, url: str) -> list[dict]:
    """The model cards of the server at `url` (GET /v1/models).

    Raises:
        ConnectionError: nothing answers at `url` (an OSError: the CLI's one-line error, exit 2).
        ValueError: something answers, but not with an OpenAI model list.
    """
    import httpx

    try:
        resp = await client.get(f"{url}/v1/models")
    except httpx.TransportError as exc:
        reason = str(exc) or type(exc).__name__
        raise ConnectionError(f"can't reach the server at {url}: {reason}; is `pieceworks serve` running?") from None
    if resp.status_code == 401:
        why = ("refused the --api-key given" if "authorization" in client.headers
               else "wants an API key; give it with --api-key")
        raise ValueError(f"{url}/v1/models answered HTTP 401 (unauthorized): the server {why}")
    try:
        models = resp.json()["data"] if resp.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        models = None
    if not isinstance(models, list) or not models:
        raise ValueError(f"{url}/v1/models answered HTTP {resp.status_code} without a list of models; "
                         f"is --url a `pieceworks serve` (or other OpenAI-compatible) server?")
    return models


async def _check_server_tokenizes(client: Any, url: str, model: str, dataset: Path) -> None:
    """--dataset sends text prompts: ValueError, before the run, where the server refuses to tokenize the file's
    first prompt (POST /tokenize, pieceworks' and vLLM's route; a server without it leaves the answer to the
    requests themselves)."""
    import httpx

    body = {"model": model, "prompt": dataset_lines(dataset)[0]}
    try:
        resp = await client.post(f"{url}/tokenize", json=body)
    except httpx.TransportError as exc:
        reason = str(exc) or type(exc).__name__
        raise ConnectionError(f"can't reach the server at {url}: {reason}; is `pieceworks serve` running?") from None
    if resp.status_code != 400:
        return
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:200]
    raise ValueError(f"--dataset {dataset}: the server at {url} can't tokenize its text prompts ({message}); "
                     "serve a model with a tokenizer, or leave out --dataset for random token-id prompts (--input-len)")


async def _bench_http(args: Any) -> dict:
    import httpx

    from pieceworks.serve.cli import api_key

    url = args.url.rstrip("/")
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    key = api_key(args.api_key)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        models = await _served_models(client, url)
        card = models[0] if args.model is None else next((m for m in models if m["id"] == args.model), None)
        if card is None:
            raise ValueError(f"--model {args.model!r}: the server serves {[m['id'] for m in models]}")
        if args.dataset is not None:
            await _check_server_tokenizes(client, url, card["id"], args.dataset)
        if args.dataset is None and not isinstance(card.get("vocab_size"), int):
            raise ValueError(f"the server at {url} lists {card.get('id')!r} without its vocab_size (a field of "
                             "`pieceworks serve`'s model cards), which random token-id prompts need; give text "
                             "prompts with --dataset FILE")
        max_len = card.get("max_model_len")
        items = _workload(args, card.get("vocab_size"), max_len if isinstance(max_len, int) else 1 << 62)
        records, duration = await run_workload(items, http_driver(client, url, card["id"], args.timeout),
                                               args.request_rate, args.max_concurrency, args.seed,
                                               not args.no_progress)
    return {"backend": "http", "url": url, "model": card["id"], **summarize(records, duration)}


async def _bench_engine(engine: Any, args: Any) -> dict:
    if args.dataset is not None and engine.tokenizer is None:
        raise ValueError(f"--dataset {args.dataset}: text prompts need a tokenizer, and {engine.model_name} has "
                         "none; use a model with one, or leave out --dataset for random token-id prompts "
                         "(--input-len)")
    vocab = int(engine.engine.executor.vocab_size)
    items = _workload(args, vocab, engine.max_context)
    records, duration = await run_workload(items, engine_driver(engine), args.request_rate, args.max_concurrency,
                                           args.seed, not args.no_progress)
    return {"backend": "engine", "model": engine.model_name, **summarize(records, duration)}


def finite(value: Any) -> Any:
    """`value` with its non-finite floats as None (JSON's null: strict parsers refuse NaN and Infinity), e.g. the
    request rate inf (all at once) and the percentiles of a run in which every request failed."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def run_bench(args: Any, cfg: Any = None) -> int:
    """Run the benchmark from parsed arguments (`cfg` for the in-process engine); print and write JSON."""
    if args.url is not None:
        result = asyncio.run(_bench_http(args))
    else:
        from pieceworks.engine import AsyncEngine

        with AsyncEngine.from_config(cfg, progress=not args.no_progress) as engine:
            result = asyncio.run(_bench_engine(engine, args))
    result["workload"] = {
        "num_prompts": args.num_prompts, "input_len": None if args.dataset else args.input_len,
        "dataset": str(args.dataset) if args.dataset else None, "output_len": args.output_len,
        "range_ratio": args.range_ratio, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "seed": args.seed,
    }
    title = f"{result['model']} ({result['backend']}, concurrency {args.max_concurrency or 'unbounded'}, " \
            f"rate {args.request_rate})"
    print(format_table(result, title))
    if args.result_json is not None:
        Path(args.result_json).write_text(json.dumps(finite(result), indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.result_json}")
    return 0 if result["failed"] == 0 else 1
