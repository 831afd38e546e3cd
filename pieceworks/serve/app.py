"""The OpenAI-compatible HTTP app over one `AsyncEngine`: routes, streaming, errors, overload, metrics.

`build_app(engine)` returns a FastAPI app; `pieceworks serve` runs it under uvicorn. Each HTTP request
becomes one engine request per prompt (a completions request may carry several); its `n` choices are
the engine's `n`. A client that disconnects cancels the engine's stream, which aborts the request and
frees its pages. Requests that have not produced their first token count against `max_queue`; past it
the server answers 503 with Retry-After instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pieceworks.engine.async_engine import EngineDeadError
from pieceworks.errors import RequestError
from pieceworks.models.tokenizer import token_bytes
from pieceworks.serve import REASONING_PARSERS, mapping, reasoning, tools
from pieceworks.serve.metrics import CONTENT_TYPE, ServerMetrics
from pieceworks.serve.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    new_id,
    parse_body,
    sse,
)
from pieceworks.serve.tool_parsers import lost_markers
from pieceworks.serve.writers import ChatWriter, Choice, CompletionWriter, Step, Writer
from pieceworks.version import __version__

log = logging.getLogger("pieceworks.serve")
T = TypeVar("T")
RETRY_AFTER_S = 1


class Overloaded(RuntimeError):
    """The queue of requests waiting for their first token is full."""


class EngineFailure(RuntimeError):
    """The engine finished a request with finish_reason "error" (e.g. non-finite logits)."""


class _Disconnected(Exception):
    """The client went away before the response started."""


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class Server:
    """The state the routes share: the engine, the served name, the queue bound, the metrics."""

    def __init__(self, engine: Any, served_model_name: str | None = None, max_queue: int = 256,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue = {max_queue}: must be at least 1 (requests waiting for a first token)")
        for name, value, known in (("tool_call_parser", tool_call_parser, tools.PARSERS),
                                   ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
            if value not in (None, *known):
                raise ValueError(f"{name} = {value!r}: takes one of {known} or None")
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        lost = lost_markers(engine.tokenizer, tool_call_parser) if tool_call_parser and engine.tokenizer else []
        self.keep_special = bool(lost)
        if lost:
            log.info("--tool-call-parser %s: %s are special tokens of this tokenizer; requests under tool_choice "
                     "auto decode with special tokens kept", tool_call_parser, ", ".join(lost))
        if reasoning_parser and engine.tokenizer is not None:  # structured outputs start after the reasoning
            engine.engine.grammars.set_reasoning(*reasoning.tags(reasoning_parser))
        self.engine = engine
        self.name = served_model_name or engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_context = engine.max_context
        self.vocab_size = int(engine.engine.executor.vocab_size)
        self.max_queue = max_queue
        self.num_queued = 0
        self.metrics = ServerMetrics()
        self._token_str: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    # ---- requests to the engine -------------------------------------------------------------------

    def admit(self, num_prompts: int, n: int = 1) -> None:
        if num_prompts > self.max_queue:
            raise BadRequest(f"{num_prompts} prompts in one request exceed the server's queue of {self.max_queue}: "
                             "send them in several requests", param="prompt")
        if num_prompts * n > self.max_queue:  # n completions each: as many sequences as n separate requests
            raise BadRequest(f"{num_prompts} prompt(s) x n = {n} completions exceed the server's queue of "
                             f"{self.max_queue}: lower n or send several requests", param="n")
        if self.num_queued + num_prompts > self.max_queue:
            self.metrics.rejected += 1
            raise Overloaded(f"the server is at its limit of {self.max_queue} requests waiting for a first "
                             f"token; retry after {RETRY_AFTER_S} s")
        self.num_queued += num_prompts

    async def steps(self, prompts: list[list[int]], params: list[Any], base_id: str,
                    priority: int = 0) -> AsyncIterator[Step]:
        """The engine's outputs for every prompt, merged; choice index = prompt * n + completion.

        Closing or cancelling this iterator aborts every request still running (the pages return).
        """
        n = params[0].n
        start = time.perf_counter()
        choices: dict[int, Choice] = {}
        queued = set(range(len(prompts)))
        queue: asyncio.Queue = asyncio.Queue()
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        finished_ids: set[str] = set()

        async def pump(i: int) -> None:
            try:
                async for out in self.engine.generate(prompts[i], params[i], ids[i], priority):
                    await queue.put((i, out))
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(prompts))]
        remaining = len(tasks)
        try:
            while remaining:
                i, out = await queue.get()
                if out is None:
                    remaining -= 1
                    finished_ids.add(ids[i])
                    continue
                if isinstance(out, Exception):
                    raise out
                now = time.perf_counter()
                c = choices.setdefault(i * n + out.index, Choice(i * n + out.index, start, prompt_ids=prompts[i]))
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if i in queued and out.new_token_ids:
                    queued.discard(i)
                    self.num_queued -= 1
                if out.new_token_ids and c.first_token_at is None:
                    c.first_token_at = now
                    self.metrics.ttft.observe(now - start)
                new_lp = _new_logprobs(out)
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(new_lp)
                delta = out.text_delta or ""
                c.text = out.text if out.text is not None else c.text + delta
                if out.finished:
                    c.finish_reason = out.finish_reason
                    self._record_finish(c, now, len(prompts[i]) if out.index == 0 else 0)
                    if out.finish_reason == "error" and out.error_param is not None:  # its own constraints conflict
                        raise BadRequest(out.error, param=out.error_param, code="unsatisfiable")
                    if out.finish_reason == "error":
                        raise EngineFailure(out.error or "the engine failed this request")
                yield Step(c, list(out.new_token_ids), delta, new_lp, out.finished)
        finally:
            self.num_queued -= len(queued)
            for t in tasks:
                t.cancel()
            # Shielded: a disconnect arrives as a cancellation, and the aborts must still reach the engine.
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
                for rid in ids:
                    if rid not in finished_ids:
                        try:
                            await self.engine.abort(rid)
                        except RuntimeError:  # the engine is shut down or dead: nothing left to free
                            pass

    def _record_finish(self, c: Choice, now: float, prompt_tokens: int) -> None:
        m = self.metrics
        m.finished[c.finish_reason or "stop"] += 1
        m.generation_tokens += len(c.token_ids)
        m.prompt_tokens += prompt_tokens
        m.e2e.observe(now - c.start)
        if c.first_token_at is not None and len(c.token_ids) > 1:
            m.tpot.observe((now - c.first_token_at) / (len(c.token_ids) - 1))

    def token_str(self, tid: int) -> str:
        s = self._token_str.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            self._token_str[tid] = s
        return s

    def prompt_state(self, prompt: list[int]) -> str:
        """Whether the chat template left a reasoning block open or closed at the prompt's end (serve/reasoning.py)."""
        tags = self.engine.engine.grammars.reasoning if self.reasoning_parser and self.tokenizer is not None else None
        return "none" if tags is None else reasoning.prompt_state(prompt, *tags, self.tokenizer.decode)

    def token_bytes(self, tid: int) -> list[int]:
        """The token's own bytes (chat logprobs' `bytes`): a token that holds part of a character decodes to
        U+FFFD, its bytes are the part's."""
        b = self._token_bytes.get(tid)
        if b is None:
            s = self.token_str(tid)
            b = list(token_bytes(self.tokenizer, tid, s) if self.tokenizer is not None else s.encode())
            self._token_bytes[tid] = b
        return b


def _new_logprobs(out: Any) -> list[dict[int, float]]:
    """The logprob dicts of this output's new tokens (the engine may report them cumulatively)."""
    lp = out.logprobs
    if not lp:
        return []
    k = len(out.new_token_ids)
    return list(lp[-k:]) if k else []


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `_Disconnected` (with `work` cancelled, hence aborted) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise _Disconnected()
    return task.result()


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator when it ends for any reason (a disconnect
    cancels the stream while the iterator may sit at a `yield`; closing it aborts the request now
    rather than whenever it is garbage-collected)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _parse(request: Request, model: type[T]) -> T:
    return parse_body(await request.body(), model)


def build_app(engine: Any, served_model_name: str | None = None, max_queue: int = 256,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncEngine`); see the module docstring. The parsers: one of
    `TOOL_CALL_PARSERS` (serve/tools.py) and `REASONING_PARSERS` (serve/reasoning.py), or None."""
    srv = Server(engine, served_model_name, max_queue, tool_call_parser, reasoning_parser)
    app = FastAPI(title="pieceworks", version=__version__)
    app.state.server = srv

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        srv.metrics.bad_requests += 1
        return error_response(400, str(exc), "invalid_request_error", getattr(exc, "param", None),
                              getattr(exc, "code", None))

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return error_response(503, str(exc), "server_overloaded", code="overloaded",
                              headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineFailure)
    async def engine_failure(_: Request, exc: EngineFailure) -> JSONResponse:
        return error_response(500, str(exc), "server_error", code="engine_error")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(500, str(exc), "server_error", code="engine_dead")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(_Disconnected)
    async def disconnected(_: Request, exc: _Disconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.get("/health")
    async def health() -> Response:
        if srv.engine.alive:
            return Response(status_code=200)
        # a load balancer or orchestrator takes this server out of rotation (or restarts it)
        return error_response(503, "the engine's step loop has stopped (failed or shut down); this server "
                              "cannot run requests: restart it", "server_error", code="engine_dead")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=srv.name, max_model_len=srv.max_context, vocab_size=srv.vocab_size)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(srv.engine.stats()), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await _parse(request, TokenizeRequest)
        tok = mapping.tokenizer_for(req, srv.name, srv.tokenizer)
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": srv.max_context})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await _parse(request, DetokenizeRequest)
        tok = mapping.tokenizer_for(req, srv.name, srv.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < srv.vocab_size]
        if bad:
            raise BadRequest(f"tokens {bad[:5]} are outside the vocabulary [0, {srv.vocab_size})", param="tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        mapping.check_model(req, srv.name)
        mapping.refuse_unsupported(req)
        prompts = mapping.completion_prompts(req, srv.tokenizer, srv.vocab_size)
        params = [mapping.sampling_params(req, mapping.max_tokens_for(req, len(p), srv.max_context), srv.vocab_size)
                  for p in prompts]
        writer = CompletionWriter(srv, req, mapping.echo_texts(req, srv.tokenizer, prompts))
        return await _respond(request, req, prompts, params, new_id("cmpl"), writer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        mapping.check_model(req, srv.name)
        mapping.refuse_unsupported(req)
        plan = tools.plan(req, srv.tool_call_parser, srv.keep_special)
        prompt = mapping.chat_prompt(req, srv.tokenizer, plan)
        params = [mapping.sampling_params(req, mapping.max_tokens_for(req, len(prompt), srv.max_context),
                                          srv.vocab_size, plan)]
        writer = ChatWriter(srv, req, plan, srv.reasoning_parser, srv.prompt_state(prompt))
        return await _respond(request, req, [prompt], params, new_id("chatcmpl"), writer)

    async def _respond(request: Request, req: Any, prompts: list[list[int]], params: list[Any], rid: str,
                       writer: Writer) -> Response:
        try:  # the engine would refuse it too, without naming the field
            srv.engine.engine.scheduler.check_priority(req.priority)
        except RequestError as exc:
            raise BadRequest(str(exc), param="priority") from None
        srv.admit(len(prompts), params[0].n)
        steps = srv.steps(prompts, params, rid, req.priority)
        if not req.stream:
            async def collect() -> Response:
                async for step in steps:
                    writer.note(step)
                return JSONResponse(writer.response(rid, prompts).model_dump())

            try:
                return await _unless_disconnected(request, collect())
            finally:
                await steps.aclose()
        # The first step before the response starts: a request the engine refuses is still a 400.
        try:
            first = await _unless_disconnected(request, anext(steps, None))
        except BaseException:
            await steps.aclose()
            raise

        async def stream() -> AsyncIterator[str]:
            try:
                for chunk in writer.start(rid):
                    yield sse(chunk)
                step = first
                while step is not None:
                    for chunk in writer.chunks(rid, step):
                        yield sse(chunk)
                    step = await anext(steps, None)
                if req.stream_options and req.stream_options.include_usage:
                    yield sse(writer.usage_chunk(rid, prompts))
            except EngineFailure as exc:
                yield sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error", code="engine_error")))
            except BadRequest as exc:  # a completion's own constraints refused every token (error_param)
                srv.metrics.bad_requests += 1
                yield sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="invalid_request_error",
                                                        param=exc.param, code=exc.code)))
            except Exception as exc:  # the engine died mid-stream, or a bug: the client still gets an event
                log.exception("stream failed")
                code = "engine_dead" if isinstance(exc, EngineDeadError) else None
                yield sse(ErrorResponse(error=ErrorInfo(message=f"{type(exc).__name__}: {exc}", type="server_error",
                                                        code=code)))
            finally:
                await steps.aclose()
            yield sse("[DONE]")

        return _SSEResponse(stream(), media_type="text/event-stream")

    return app
