"""AsyncEngine: one Engine shared by many coroutines, its step loop on one background thread.

Coroutines never touch the Engine: `generate` posts an add command and reads its outputs from a
queue that the loop thread fills (`call_soon_threadsafe`; a slow reader's backlog merges: `_Outputs`);
cancelling or closing the iterator posts an abort. The loop thread alone calls `add_request`, `abort`
and `step`, between steps, so nothing is refused and nothing interleaves. A request's structured outputs
compile before its add command is posted, on the event loop's default executor (llguidance releases the
GIL): a large schema's compile does not hold up the steps of the requests already running. An exception in
the loop fails every waiting coroutine with it (and every later call): the engine's state is not trusted
after an unexpected error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections import deque
from typing import Any, AsyncIterator

from pieceworks.engine.engine import Engine
from pieceworks.engine.prompts import check_abort_id
from pieceworks.engine.params import SamplingParams
from pieceworks.engine.request import RequestOutput
from pieceworks.errors import RequestError


def _put_all(items: list[tuple["_Outputs", RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


MERGE_AFTER = 16
"""Outputs of one completion that wait for a slow reader before later ones merge into the last (`_Outputs`)."""


class _Outputs:
    """One stream's outputs waiting for its reader (an asyncio queue of this event loop's thread). Once MERGE_AFTER
    outputs of a completion wait, a later one merges into the last of them (the later output, with the new tokens
    and text deltas of both): a reader that stops reading while its request runs on holds a bounded number of
    outputs per completion, not one per step (each carries the whole output so far: quadratic in its length; under
    output_kind "delta" their token_ids, logprobs and text join as their deltas do)."""

    def __init__(self, delta: bool = False) -> None:
        self._delta = delta  # SamplingParams.output_kind "delta": token_ids, logprobs and text join too
        self._order: deque = deque()  # per waiting item: its completion's index, or (item,) for an exception
        self._waiting: dict[int, deque] = {}  # completion index -> its waiting outputs
        self._ready = asyncio.Event()

    def put_nowait(self, item: Any) -> None:
        if isinstance(item, RequestOutput):
            waiting = self._waiting.setdefault(item.index, deque())
            if len(waiting) >= MERGE_AFTER:
                old = waiting[-1]
                delta = None if item.text_delta is None else (old.text_delta or "") + item.text_delta
                joined = dict(new_token_ids=old.new_token_ids + item.new_token_ids, text_delta=delta)
                if self._delta:
                    joined.update(token_ids=old.token_ids + item.token_ids, text=delta, logprobs=None
                                  if item.logprobs is None else (old.logprobs or []) + item.logprobs)
                waiting[-1] = dataclasses.replace(item, **joined)
                return
            waiting.append(item)
            self._order.append(item.index)
        else:
            self._order.append((item,))
        self._ready.set()

    async def get(self) -> Any:
        while not self._order:
            self._ready.clear()
            await self._ready.wait()
        head = self._order.popleft()
        return head[0] if isinstance(head, tuple) else self._waiting[head].popleft()


class EngineDeadError(RuntimeError):
    """The AsyncEngine's step loop stopped (an error in a step, or shutdown)."""


class AsyncEngine:
    """Serve an Engine to asyncio code: `async for out in engine.generate(prompt, params)`.

    Attributes: engine (the wrapped Engine), tokenizer, max_context, model_name (the Engine's).
    Use as a context manager, or call `shutdown()` to stop and join the loop thread.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_context = engine.max_context
        self.model_name = engine.model_name
        self._cond = threading.Condition()
        self._commands: deque[tuple] = deque()
        # request id -> (event loop, queue, stream number); `_added` maps an id to the number of the stream whose
        # add the loop thread has taken: outputs go to that stream only, so that a stream that reuses the id of
        # one just cancelled never reads the old request's abort output
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Outputs, int]] = {}
        self._added: dict[str, int] = {}
        self._num_streams = 0
        self._stopping = False
        self._error: BaseException | None = None
        self._failed = threading.Event()  # set when the step loop fails (not on shutdown)
        self._owns_engine = False  # built by `from_config`: closed by `shutdown`
        self._thread = threading.Thread(target=self._run, name="pieceworks-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: Any = None, overrides: list[str] | None = None, *,
                    progress: bool = True) -> "AsyncEngine":
        """An AsyncEngine over `Engine.from_config(cfg, overrides)`, which `shutdown` closes (an Engine passed to
        the constructor stays the caller's)."""
        engine = cls(Engine.from_config(cfg, overrides, progress=progress))
        engine._owns_engine = True
        return engine

    # ---------------------------------------------------------------- the caller's side
    async def generate(self, prompt: list[int] | str, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       reasoning: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (one per step, per completion; a reader more than MERGE_AFTER outputs
        behind gets later steps merged into one output, their new tokens and text deltas joined) until every one
        of its n completions has finished. Cancelling (or closing) the iterator aborts the request; a `break` out of
        `async for` leaves the closing to asyncio's finalizer at the loop's next turn (its id is taken until then):
        `async with contextlib.aclosing(engine.generate(...)) as outs:` closes it at the break.
        `priority`, `reasoning`: as `Engine.add_request`'s.

        Raises:
            RequestError: what `Engine.add_request` refuses (a duplicate id included).
            EngineDeadError: the loop failed (the cause is chained) or the engine was shut down.
        """
        params = SamplingParams() if params is None else params
        request_id = uuid.uuid4().hex if request_id is None else request_id
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty str, got {request_id!r}")
        loop = asyncio.get_running_loop()
        matchers = None
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            self._check_alive()
            matchers = await loop.run_in_executor(None, self.engine.grammars.matchers, params.structured_outputs,
                                                  params.n)
        queue = _Outputs(delta=params.output_kind == "delta")
        with self._cond:
            self._check_alive()
            if request_id in self._streams:
                raise RequestError(f"request_id {request_id!r} is already running; use a new id")
            self._num_streams += 1
            number = self._num_streams
            self._streams[request_id] = (loop, queue, number)
            self._commands.append(("add", request_id, number, prompt, params, priority, matchers, reasoning))
            self._cond.notify()
        left = params.n if isinstance(params, SamplingParams) else 1
        try:
            while left:
                item = await queue.get()
                if isinstance(item, BaseException):
                    left = 0
                    raise item
                if item.finished:
                    left -= 1
                yield item
        finally:
            with self._cond:
                own = self._streams.get(request_id, (None, None, None))[2] == number  # else `_orphaned` ended it
                if own:
                    del self._streams[request_id]
                if self._added.get(request_id) == number:
                    del self._added[request_id]
                if left and own and not self._stopping:
                    self._commands.append(("abort", request_id))
                    self._cond.notify()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends with a finish_reason "abort" output."""
        check_abort_id(request_id)  # refused here: the loop thread must not meet it
        with self._cond:
            self._check_alive()
            self._commands.append(("abort", request_id))
            self._cond.notify()

    @property
    def alive(self) -> bool:
        """Whether requests can still run: the step loop has neither failed nor been shut down."""
        return self._error is None and not self._stopping

    def wait_failed(self, timeout: float | None = None) -> BaseException | None:
        """Block until the step loop fails (or `timeout` s pass): the exception that stopped it, or None.
        A shutdown does not count: a server watching this from a thread stops serving on a failure only."""
        self._failed.wait(timeout)
        return self._error

    def stats(self) -> dict[str, int]:
        """The Engine's counters (a snapshot)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the loop thread and join it; waiting coroutines get EngineDeadError, unfinished
        requests are aborted (their pages returned)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        if not self.engine.executor.closed:  # an embedder may close the Engine first
            for rid in list(self.engine._requests):
                self.engine.abort(rid)
            try:
                if self.engine.has_unfinished():
                    self.engine.step()  # returns the aborts' outputs, nobody reads them
            except Exception:
                if self._error is None:
                    raise
                # the step that failed the loop fails again: the pages stay with the engine, which is not trusted
        self._fail_all("the AsyncEngine was shut down")
        if self._owns_engine and not self.engine.executor.closed:
            self.engine.close()  # its model, KV pool and grammar worker

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the AsyncEngine's step loop failed: {self._error!r}") from self._error
        if self._stopping:
            raise EngineDeadError("the AsyncEngine was shut down")

    # ---------------------------------------------------------------- the loop thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished()):
                        self._cond.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, deque()
                for cmd in commands:
                    if cmd[0] == "add":
                        _, rid, number, prompt, params, priority, matchers, reasoning = cmd
                        engine.discard_outputs(rid)  # an earlier stream's abort of this id: nobody reads it
                        with self._cond:
                            if self._streams.get(rid, (None, None, None))[2] == number:  # still listening
                                self._added[rid] = number
                        try:
                            engine.add_request(prompt, params, rid, priority, matchers=matchers, reasoning=reasoning)
                        except Exception as exc:  # refused before the engine took it: this caller's error
                            self._deliver(rid, exc)
                    else:
                        engine.abort(cmd[1])
                if engine.has_unfinished():
                    self._deliver_step(engine.step())
        except BaseException as exc:
            with self._cond:
                self._error = exc
            self._failed.set()
            self._fail_all(f"the AsyncEngine's step loop failed: {exc!r}", exc)

    def _stream(self, request_id: str) -> tuple[asyncio.AbstractEventLoop, _Outputs, int] | None:
        """The stream that reads this id's outputs (under `_cond`): None once its caller stopped listening, or
        while the id's stream is a new one whose add the loop thread has not taken yet."""
        stream = self._streams.get(request_id)
        return stream if stream is not None and self._added.get(request_id) == stream[2] else None

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._cond:
            stream = self._stream(request_id)
        if stream is None:
            return  # the caller stopped listening
        loop, queue, _ = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed
            self._orphaned(loop, [request_id])

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per event loop per step, not one per output: each `call_soon_threadsafe` writes
        to the loop's self-pipe, and at 32+ requests per step those writes cost more than the puts."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cond:
            for out in outputs:
                stream = self._stream(out.request_id)
                if stream is not None:
                    batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed
                self._orphaned(loop, [out.request_id for _, out in items])

    def _orphaned(self, loop: asyncio.AbstractEventLoop, request_ids: list[str]) -> None:
        """The streams of `request_ids` on `loop`, which is closed (its generators never finalized: a loop closed
        without shutdown_asyncgens): no reader will come, so their requests are aborted and their ids free again.
        On the loop thread."""
        with self._cond:
            gone = [rid for rid in dict.fromkeys(request_ids) if self._streams.get(rid, (None,))[0] is loop]
            for rid in gone:
                del self._streams[rid]
                self._added.pop(rid, None)
        for rid in gone:
            self.engine.abort(rid)

    def _fail_all(self, message: str, cause: BaseException | None = None) -> None:
        """An EngineDeadError of `message` (`cause` chained) to every stream, those whose add is still a command
        included; one per stream, so that one caller's traceback does not gather the others' frames."""
        with self._cond:
            streams = list(self._streams.values())
        for loop, queue, _ in streams:
            dead = EngineDeadError(message)
            dead.__cause__ = cause
            try:
                loop.call_soon_threadsafe(queue.put_nowait, dead)
            except RuntimeError:
                pass  # the caller's event loop is closed
