"""The state an HTTP app's routes share (`Server`): the engine, the served name, the queue bound that answers
overload, the metrics, and the merge of a request's prompts into one stream of steps (choice index = prompt * n +
completion); closing that stream aborts what still runs. serve/app.py puts the routes on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from pieceworks.models.tokenizer import token_bytes, token_text
from pieceworks.serve import REASONING_PARSERS, reasoning, tools
from pieceworks.serve.metrics import ServerMetrics
from pieceworks.serve.protocol import BadRequest
from pieceworks.serve.tool_parsers import lost_markers
from pieceworks.serve.writers import Choice, Step

log = logging.getLogger("pieceworks.serve")
RETRY_AFTER_S = 1


class Overloaded(RuntimeError):
    """The queue of requests waiting for their first token is full."""


class EngineFailure(RuntimeError):
    """The engine finished a request with finish_reason "error" (e.g. non-finite logits)."""


class StepStream:
    """`Server.steps`' stream of `Step`s. Its generator gives the completions' places in the queue back as their
    prompts' first tokens arrive and the rest when it ends; a stream closed before its first step (a handler
    cancelled before its task ran) never started that generator, and `aclose` gives them back here."""

    def __init__(self, srv: "Server", gen: AsyncIterator[Step], queued: int) -> None:
        self._srv, self._gen, self._queued = srv, gen, queued

    def __aiter__(self) -> "StepStream":
        return self

    async def __anext__(self) -> Step:
        self._queued = 0  # the generator runs from here on and owns them
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        self._srv.num_queued -= self._queued
        self._queued = 0
        await self._gen.aclose()


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
        self.in_flight: set[str] = set()  # engine request ids of the streams open now
        self._token_str: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    # ---- requests to the engine -------------------------------------------------------------------

    def check_size(self, num_prompts: int, n: int = 1) -> None:
        """BadRequest unless one request of `num_prompts` prompts x `n` completions fits the queue at all."""
        if num_prompts > self.max_queue:
            raise BadRequest(f"{num_prompts} prompts in one request exceed the server's queue of {self.max_queue}: "
                             "send them in several requests", param="prompt")
        if num_prompts * n > self.max_queue:  # n completions each: as many sequences as n separate requests
            raise BadRequest(f"{num_prompts} prompt(s) x n = {n} completions exceed the server's queue of "
                             f"{self.max_queue}: lower n or send several requests", param="n")

    def admit(self, num_prompts: int, n: int = 1) -> None:
        self.check_size(num_prompts, n)
        if self.num_queued + num_prompts * n > self.max_queue:
            self.metrics.rejected += 1
            raise Overloaded(f"the server is at its limit of {self.max_queue} completions waiting for a first "
                             f"token; retry after {RETRY_AFTER_S} s")
        self.num_queued += num_prompts * n

    def steps(self, prompts: list[list[int]], params: list[Any], base_id: str, priority: int = 0,
              reasoning: bool = True) -> "StepStream":
        """The engine's outputs for every prompt, merged; choice index = prompt * n + completion. `reasoning`:
        structured outputs wait for the reasoning's end where `--reasoning-parser` is set (chat answers only).

        Takes the completions' places in the queue first (`admit`: Overloaded or BadRequest, before anything runs).
        Closing or cancelling the stream aborts every request still running (the pages return).
        """
        self.admit(len(prompts), params[0].n)
        gen = self._steps(prompts, params, base_id, priority, reasoning)
        return StepStream(self, gen, len(prompts) * params[0].n)

    async def _steps(self, prompts: list[list[int]], params: list[Any], base_id: str, priority: int,
                     reasoning: bool) -> AsyncIterator[Step]:
        n = params[0].n
        start = time.perf_counter()
        choices: dict[int, Choice] = {}
        queued = set(range(len(prompts)))
        # bounded: a client that stops reading stops the pumps, and the engine's streams merge what it has not read
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(prompts))
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        finished_ids: set[str] = set()
        self.in_flight.update(ids)

        reading = True  # until the loop below stops: then a pump's last put into a full queue would wait forever

        async def pump(i: int) -> None:
            try:
                async for out in self.engine.generate(prompts[i], params[i], ids[i], priority, reasoning):
                    await queue.put((i, out))
            except Exception as exc:  # handed to the consumer, which raises it
                if reading:
                    await queue.put((i, exc))
            finally:
                if reading:
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
                if i in queued and out.new_token_ids:  # its completions stop waiting with the first token
                    queued.discard(i)
                    self.num_queued -= n
                if out.new_token_ids and c.first_token_at is None:
                    c.first_token_at = now
                    self.metrics.ttft.observe(now - start)
                new_lp = _new_logprobs(out)
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(new_lp)
                delta = out.text_delta or ""
                c.text += delta  # the outputs are deltas (`mapping.sampling_params`): they add up to the text
                if out.finished:
                    c.finish_reason = out.finish_reason
                    self._record_finish(c, now, len(prompts[i]) if out.index == 0 else 0)
                    if out.finish_reason == "error" and out.error_param is not None:  # its own constraints conflict
                        raise BadRequest(out.error, param=out.error_param, code="unsatisfiable")
                    if out.finish_reason == "error":
                        raise EngineFailure(out.error or "the engine failed this request")
                yield Step(c, list(out.new_token_ids), delta, new_lp, out.finished)
        finally:
            reading = False
            self.num_queued -= n * len(queued)
            self.in_flight.difference_update(ids)
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

    async def abort_all(self) -> int:
        """Abort every request in flight (a shutdown's end): each stream ends with a finish_reason "abort" output.
        Returns how many were aborted."""
        ids = sorted(self.in_flight)
        for rid in ids:
            try:
                await self.engine.abort(rid)
            except RuntimeError:  # the engine is shut down or dead: nothing left to end
                return 0
        return len(ids)

    def _record_finish(self, c: Choice, now: float, prompt_tokens: int) -> None:
        m = self.metrics
        m.finished[c.finish_reason or "stop"] += 1
        m.generation_tokens += len(c.token_ids)
        m.prompt_tokens += prompt_tokens
        m.e2e.observe(now - c.start)
        if c.first_token_at is not None and len(c.token_ids) > 1:
            m.tpot.observe((now - c.first_token_at) / (len(c.token_ids) - 1))

    def token_str(self, tid: int, first: bool = False) -> str:
        """A token's text inside a completion (`token_text`); `first`: as the first token of a sequence reads,
        where a SentencePiece tokenizer drops the leading space (an echoed prompt's first token)."""
        if first and self.tokenizer is not None:
            return self.tokenizer.decode([tid])
        s = self._token_str.get(tid)
        if s is None:
            s = token_text(self.tokenizer, tid) if self.tokenizer is not None else f"token_id:{tid}"
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
    """The logprob dicts of this output's new tokens (the last of its logprobs, whichever its output_kind)."""
    lp = out.logprobs
    if not lp:
        return []
    k = len(out.new_token_ids)
    return list(lp[-k:]) if k else []
