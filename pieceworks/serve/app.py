"""The OpenAI-compatible HTTP app over one `AsyncEngine`: routes, streaming, errors, overload, metrics.

`build_app(engine)` returns a FastAPI app; `pieceworks serve` runs it under uvicorn. Each HTTP request
becomes one engine request per prompt (a completions request may carry several); its `n` choices are
the engine's `n`. A client that disconnects cancels the engine's stream, which aborts the request and
frees its pages. Requests that have not produced their first token count against `max_queue`; past it
the server answers 503 with Retry-After instead of queueing without bound. The state the routes share (the
engine, the queue bound, the metrics, a request's merged stream of steps) is `serve/server.py`'s `Server`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pieceworks.engine.async_engine import EngineDeadError
from pieceworks.errors import RequestError
from pieceworks.serve import mapping, tools
from pieceworks.serve import prompts as prompts_of
from pieceworks.serve.metrics import CONTENT_TYPE
from pieceworks.serve.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from pieceworks.serve.responses import ErrorInfo, ErrorResponse, ModelCard, ModelList, new_id, sse
from pieceworks.serve.server import RETRY_AFTER_S, EngineFailure, Overloaded, Server
from pieceworks.serve.writers import ChatWriter, CompletionWriter, Writer
from pieceworks.version import __version__

log = logging.getLogger("pieceworks.serve")
T = TypeVar("T")


class _Disconnected(Exception):
    """The client went away before the response started."""


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


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


MAX_BODY_BYTES = 32 * 2**20
"""The largest request body the server reads (413 past it), as vLLM's Rust frontend: a 128k-token prompt written
as token ids takes about 1 MiB."""


async def _body(request: Request) -> bytes:
    """The request's body; BadRequest 413 as soon as it is known to exceed MAX_BODY_BYTES (its Content-Length, or
    the bytes read so far), before more of it is read."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> BadRequest:
    return BadRequest(f"the request body exceeds the server's limit of {MAX_BODY_BYTES / 2**20:.4g} MiB: send fewer or "
                      "shorter prompts per request", code="request_too_large", status=413)


def build_app(engine: Any, served_model_name: str | None = None, max_queue: int = 256,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncEngine`); see the module docstring. The parsers: one of
    `TOOL_CALL_PARSERS` (serve/tools.py) and `REASONING_PARSERS` (serve/reasoning.py), or None. With `api_key`,
    the /v1 routes (OpenAI's API) answer 401 unless the request carries `Authorization: Bearer <api_key>`; the
    others (/health, /metrics, /tokenize, /docs) and OPTIONS requests (a CORS preflight carries no key) pass, as in
    vLLM."""
    srv = Server(engine, served_model_name, max_queue, tool_call_parser, reasoning_parser)
    app = FastAPI(title="pieceworks", version=__version__)
    app.state.server = srv
    # A request's JSON, prompts (tokenization, the chat template) and parameters are read on one worker thread
    # (vLLM's frontend tokenizes on one too): a long prompt stalls neither /health nor the streams in flight.
    reader = anyio.CapacityLimiter(1)

    async def read(request: Request, prepare: Callable[[bytes], T]) -> T:
        body = await _body(request)
        return await anyio.to_thread.run_sync(prepare, body, limiter=reader)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next: Any) -> Response:
            given = request.headers.get("authorization", "").encode()
            path = request.url.path
            guarded = (path == "/v1" or path.startswith("/v1/")) and request.method != "OPTIONS"
            if not guarded or hmac.compare_digest(given, expected):
                return await call_next(request)
            why = "no Authorization header" if not given else "a wrong API key"
            return error_response(401, f"{why}: send `Authorization: Bearer <key>` with the server's --api-key",
                                  "invalid_request_error", code="invalid_api_key")

    @app.exception_handler(RequestError)
    async def bad_request(_: Request, exc: RequestError) -> JSONResponse:
        srv.metrics.bad_requests += 1
        return error_response(getattr(exc, "status", 400), str(exc), "invalid_request_error",
                              getattr(exc, "param", None), getattr(exc, "code", None))

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

    card = ModelCard(id=srv.name, max_model_len=srv.max_context, vocab_size=srv.vocab_size)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model:path}")  # a served name may hold "/" (a model's path)
    async def model(model: str) -> JSONResponse:
        mapping.check_model(model, srv.name)
        return JSONResponse(card.model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(srv.engine.stats()), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        def prepare(body: bytes) -> dict:
            req = parse_body(body, TokenizeRequest)
            tok = mapping.tokenizer_for(req, srv.name, srv.tokenizer)
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            return {"tokens": ids, "count": len(ids), "max_model_len": srv.max_context}

        return JSONResponse(await read(request, prepare))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        def prepare(body: bytes) -> dict:
            req = parse_body(body, DetokenizeRequest)
            tok = mapping.tokenizer_for(req, srv.name, srv.tokenizer)
            bad = [t for t in req.tokens if not 0 <= t < srv.vocab_size]
            if bad:
                raise BadRequest(f"tokens {bad[:5]} are outside the vocabulary [0, {srv.vocab_size})", param="tokens")
            return {"prompt": tok.decode(req.tokens)}

        return JSONResponse(await read(request, prepare))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        def prepare(body: bytes) -> tuple:
            req = parse_body(body, CompletionRequest)
            mapping.check_model(req.model, srv.name)
            mapping.refuse_unsupported(req)
            prompts = prompts_of.completion_prompts(req, srv.tokenizer, srv.vocab_size,
                                                 lambda count: srv.check_size(count, 1 if req.n is None else req.n))
            params = mapping.prompt_params(req, prompts, srv.max_context, srv.vocab_size)
            writer = CompletionWriter(srv, req, prompts_of.echo_texts(req, srv.tokenizer, prompts))
            return req, prompts, params, writer

        req, prompts, params, writer = await read(request, prepare)
        return await _respond(request, req, prompts, params, new_id("cmpl"), writer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        def prepare(body: bytes) -> tuple:
            req = parse_body(body, ChatCompletionRequest)
            mapping.check_model(req.model, srv.name)
            mapping.refuse_unsupported(req)
            plan = tools.plan(req, srv.tool_call_parser, srv.keep_special)
            prompt = prompts_of.chat_prompt(req, srv.tokenizer, plan)
            params = mapping.prompt_params(req, [prompt], srv.max_context, srv.vocab_size, plan)
            return req, plan, prompt, params, ChatWriter(srv, req, plan, srv.reasoning_parser, srv.prompt_state(prompt))

        req, plan, prompt, params, writer = await read(request, prepare)
        return await _respond(request, req, [prompt], params, new_id("chatcmpl"), writer, plan)

    async def _respond(request: Request, req: Any, prompts: list[list[int]], params: list[Any], rid: str,
                       writer: Writer, plan: tools.ToolPlan | None = None) -> Response:
        """The response to `req`: the engine's refusals of its parameters name the request's own fields
        (`mapping.client_error`)."""
        try:  # the engine would refuse it too, without naming the field
            srv.engine.engine.scheduler.check_priority(req.priority)
        except RequestError as exc:
            raise BadRequest(str(exc), param="priority") from None
        steps = srv.steps(prompts, params, rid, req.priority, reasoning=isinstance(req, ChatCompletionRequest))
        if not req.stream:
            async def collect() -> Response:
                async for step in steps:
                    writer.note(step)
                return JSONResponse(writer.response(rid, prompts).model_dump())

            try:
                return await _unless_disconnected(request, collect())
            except RequestError as exc:
                raise mapping.client_error(exc, req, plan) from exc
            finally:
                await steps.aclose()
        # The first step before the response starts: a request the engine refuses is still a 400.
        try:
            first = await _unless_disconnected(request, anext(steps, None))
        except BaseException as exc:
            await steps.aclose()
            if isinstance(exc, RequestError):
                raise mapping.client_error(exc, req, plan) from exc
            raise
        # OpenAI's chunks carry "usage": null before the usage chunk, where the client asked for usage
        usage = req.stream_options is not None and req.stream_options.include_usage
        nulls = ("usage",) if usage else ()

        async def stream() -> AsyncIterator[str]:
            try:
                for chunk in writer.start(rid):
                    yield sse(chunk, nulls)
                step = first
                while step is not None:
                    for chunk in writer.chunks(rid, step):
                        yield sse(chunk, nulls)
                    step = await anext(steps, None)
                if usage:
                    yield sse(writer.usage_chunk(rid, prompts))
            except EngineFailure as exc:
                yield sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error", code="engine_error")))
            except BadRequest as exc:  # a completion's own constraints refused every token (error_param)
                srv.metrics.bad_requests += 1
                exc = mapping.client_error(exc, req, plan)
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
