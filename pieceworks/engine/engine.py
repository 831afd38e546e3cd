"""The Engine: requests in, streamed outputs out, over one Executor.

A step reads top to bottom: schedule (admission, chunked prefill, preemption: engine/scheduler.py) ->
`Executor.forward` -> sample the rows whose requests computed all their tokens (engine/sampler.py, one
device-to-host copy) -> append, detokenize, check stop conditions -> outputs. Finished requests give
their pages back at once; their full pages stay in the prefix cache for later requests.
With `scheduler.async_steps`, one step stays in flight: a call launches step k, then waits for step
k - 1's ids and returns its outputs (engine/async_steps.py, `_complete`; the rules are in
docs/architecture.md).

One thread at a time (as the Executor): `add_request`, `abort` and `step` refuse with RuntimeError
while another thread is inside one of them. `AsyncEngine` shares one Engine between coroutines.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from pieceworks.config import Config, load_config
from pieceworks.core.batch import ForwardBatch
from pieceworks.engine.async_steps import AsyncSteps, InFlight, mark_pending
from pieceworks.engine.detokenize import eos_token_ids, load_tokenizer
from pieceworks.engine.logprobs import record_prompt_logprobs
from pieceworks.engine.params import SamplingParams
from pieceworks.engine.prompts import check_abort_id, checked_params, checked_request, new_request_id, prompt_list
from pieceworks.engine.request import Request, RequestOutput, new_group
from pieceworks.engine.sampler import Sampler, sampling_rows
from pieceworks.engine.scheduler import Scheduler
from pieceworks.engine.speculative import Speculator
from pieceworks.engine.structured import ADVANCE, Grammars, advance_grammars, grammar_error, grammar_stop
from pieceworks.errors import NonFiniteLogits, OutOfPages, RequestError
from pieceworks.executor.runner import Executor
from pieceworks.util import OneThread


class Engine:
    """Continuous batching of requests over an Executor, with prefix caching and preemption.

    Build with `Engine.from_config(cfg, overrides)` or `Engine(executor)`. Drive it with
    `add_request` + `step` until `has_unfinished()` is False, or call the blocking `generate`.

    Attributes:
        executor: the Executor it runs steps on. tokenizer: the model's Hugging Face tokenizer, or
        None (random weights, or no transformers). max_context: longest prompt + output. model_name:
        the model path or arch/preset. eos_token_ids: from generation_config.json / config.json.
    """

    def __init__(self, executor: Executor, tokenizer: Any = "auto") -> None:
        self.executor = executor
        cfg = executor.cfg
        if not (tokenizer is None or tokenizer == "auto" or (callable(tokenizer) and hasattr(tokenizer, "decode"))):
            raise TypeError(f"tokenizer must be 'auto', None or a Hugging Face tokenizer (callable, with decode), "
                            f"got {type(tokenizer).__name__}")
        self.tokenizer = load_tokenizer(executor) if tokenizer == "auto" else tokenizer
        self.max_context = executor.max_context
        self.model_name = cfg.model.path or f"{cfg.model.arch}-{cfg.model.preset or 'tiny'}"
        self.eos_token_ids = eos_token_ids(executor.model_dir, executor.vocab_size)
        self.scheduler = Scheduler(executor, cfg.scheduler)
        self.sampler = Sampler(executor.vocab_size, executor.device, cfg.runtime.seed)
        self.grammars = Grammars(self.tokenizer, executor.vocab_size, self.eos_token_ids,
                                 pin=executor.device.type == "cuda")
        self._requests: dict[str, list[Request]] = {}
        self._unfinished: dict[str, int] = {}  # per request id, completions still running: finishing is O(1)
        self._arrivals = itertools.count()
        self._ready: list[RequestOutput] = []  # outputs of aborts, returned by the next step
        self._busy = OneThread(lambda what: f"Engine.{what} called while another thread is inside this engine; an "
                               "Engine serves one thread at a time: share it through pieceworks.AsyncEngine")
        self.speculator = None if cfg.speculative.method is None else Speculator(cfg.speculative, self.max_context)
        self._async = cfg.scheduler.async_steps  # except for steps that may draft (`_step`)
        self._pipeline = AsyncSteps()
        self._fed: list = []  # (request, tokens) of the running step's forward, once it ran (`_fail_fed`)
        self.num_steps = 0
        self.num_async_steps = 0  # steps launched before the previous step's ids were on the host
        self.num_generated_tokens = 0

    @classmethod
    def from_config(cls, cfg: str | os.PathLike | dict | Config | None = None,
                    overrides: list[str] | None = None, *, progress: bool = True) -> "Engine":
        """An Engine over `Executor.from_config(cfg, overrides)` (same arguments and errors)."""
        cfg = load_config(cfg, overrides)  # a Config too: one made or replaced in code is checked as a YAML one is
        executor = Executor.from_config(cfg, progress=progress)
        try:
            return cls(executor)
        except BaseException:  # e.g. a broken generation_config.json: no half-built engine holds the model
            executor.close()
            raise

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, *, matchers: list | None = None,
                    reasoning: bool = True) -> str:
        """Queue a prompt (token ids, or text when the model has a tokenizer); returns its request id.

        With `params.n` > 1 the request has n completions (RequestOutput.index 0..n-1), each sampling
        on its own stream (seeded ones from seed + index). `priority` (an int, lower first) orders the
        queue under `scheduler.policy: priority`; with fcfs it must be 0. `matchers`: the structured outputs'
        matchers compiled ahead (`Engine.grammars.matchers`, any thread); else they are compiled here.
        `reasoning=False`: structured outputs apply from the first token even where `grammars.set_reasoning`
        holds them back until the reasoning ends (a prompt that is no chat turn: the server's /v1/completions).

        Raises:
            RequestError: a bad prompt, params or id, a prompt + max_tokens over the context limit, token ids
                of logit_bias / allowed_token_ids / stop_token_ids outside the vocabulary, allowed ids that
                min_tokens holds all back, stop strings without a tokenizer, structured outputs that do not compile
                (or without a tokenizer or llguidance), or a priority fcfs can't honour; nothing was queued.
        """
        with self._busy.held("add_request"):
            self._check_open()
            ids, params = checked_request(prompt, params, self.tokenizer, self.executor.vocab_size, self.max_context,
                                          self.eos_token_ids)
            self.scheduler.check_priority(priority)
            if params.stop and self.tokenizer is None:
                raise RequestError(f"SamplingParams.stop={params.stop!r} needs a tokenizer; this model has "
                                   "none: use stop_token_ids")
            request_id = new_request_id(request_id, self._requests, self._ready)
            matchers = self.grammars.for_params(params, matchers)
            thinking = None if matchers[0] is None or not reasoning else self.grammars.thinking(ids)
            group = new_group(request_id, ids, params, next(self._arrivals), priority, matchers, thinking,
                              self.tokenizer, self.eos_token_ids, self.executor.device, self.speculator)
            for req in group:
                self.scheduler.add(req)
            self._requests[request_id] = group
            self._unfinished[request_id] = len(group)
            return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request (all its completions) and give its pages back; the next `step` returns its
        final outputs with finish_reason "abort". Unknown or finished ids are ignored."""
        check_abort_id(request_id)
        with self._busy.held("abort"):
            self._unfinished.pop(request_id, None)
            for req in self._requests.pop(request_id, []):
                if req.finish_reason is None:
                    self._end(req, "abort")

    def discard_outputs(self, request_id: str) -> None:
        """Drop the final outputs an `abort` of this id left for the next step, for a caller that no longer
        reads them; the id is free for a new request at once."""
        with self._busy.held("discard_outputs"):
            self._ready = [o for o in self._ready if o.request_id != request_id]

    def close(self) -> None:
        """Drop every request and close the executor (`Executor.close`: the model, KV pool and graphs
        are released). The Engine refuses requests and steps afterwards; also on leaving a `with` block."""
        with self._busy.held("close"):
            self._requests.clear()
            self._unfinished.clear()
            self._ready, self._pipeline = [], AsyncSteps()
            self.scheduler.waiting.clear()
            self.scheduler.running.clear()
            self.scheduler.structured.clear()
            self.sampler = None  # its penalty tables and generator live on the device; steps are refused
            self.grammars.close()
            self.executor.close()

    def _check_open(self) -> None:
        if self.executor.closed:
            raise RuntimeError("this Engine is closed (close() was called); build a new one")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def has_unfinished(self) -> bool:
        """Whether any request is queued or running (or an abort's output is still to be returned)."""
        return bool(self._requests or self._ready)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns one output per completion that generated a token or finished.

        Raises:
            RuntimeError: another thread is inside this engine. Errors of `Executor.forward` propagate
                (the step changed nothing); an error after it (in sampling) propagates too, and the completions
                whose tokens the step fed but did not sample for finish with "error" (the next step returns them).
                OutOfPages: sequences created on the executor outside this engine hold the pages the next
                request needs.
        """
        self._busy.claim("step")
        try:
            self._check_open()
            return self._step(stream=True)
        except BaseException as exc:
            self._fail_fed(exc)
            raise
        finally:
            self._busy.release()

    def _step(self, stream: bool) -> list[RequestOutput]:
        """`step`; without `stream` only the outputs of completions that finished (`generate`, which
        returns nothing else, skips building the others)."""
        outputs, self._ready, self._fed = self._ready, [], []
        drafting = self.speculator is not None and self.speculator.drafting(len(self.scheduler.running))
        self.scheduler.drafter = self.speculator.draft if drafting else None
        pipe = self._pipeline
        if self._async and not drafting:
            scheduled = self.scheduler.schedule(preempt=False) if pipe.ready(self.executor, self.scheduler) else None
            if scheduled:
                reqs, logits, greedy = self._forward(scheduled)
                self.num_async_steps += 1
                # a grammar's mask needs step k - 1's ids: such a step samples after them
                grammar = bool(self.scheduler.structured) and any(r.matcher is not None for r in reqs)
                launched = pipe.sample(self.executor, reqs, logits, greedy, self.sampler) if reqs and not grammar \
                    else None
                mask = self._complete(pipe.inflight, outputs, stream, reqs if grammar else None) \
                    if pipe.inflight is not None else self.grammars.mask_later(reqs) if grammar else None
                if grammar:  # the GPU runs this step's forward meanwhile
                    launched = pipe.sample(self.executor, reqs, logits, greedy, self.sampler, mask.result())
                pipe.inflight = launched if launched is not None and mark_pending(launched.reqs) else None
                return outputs
        if pipe.inflight is not None:  # drain (nothing to launch, or drafts, which follow its ids): its outputs only
            self._complete(pipe.inflight, outputs, stream)
            pipe.inflight = None
            return outputs
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self._requests and not self.scheduler.running:
                # nothing of this engine holds pages, so sequences created on the executor directly do
                raise OutOfPages(
                    f"no queued request fits the KV pool: {self.executor.kv.allocator.num_used} pages are "
                    "held by sequences created outside this engine; free them (Executor.free)"
                )
            return outputs
        if self.speculator is not None and any([r.draft for r, _ in scheduled]):
            self.speculator.step(self, scheduled, outputs, stream)
            return outputs
        reqs, logits, greedy = self._forward(scheduled)
        if not reqs:
            return outputs  # only middle chunks of prompts ran
        mask = self.grammars.mask(reqs) if self.scheduler.structured else None
        result = self.sampler.sample(logits, [r.state for r in reqs], greedy, mask)
        for req, tok, finite, lp in zip(reqs, result.token_ids, result.finite, result.logprobs):
            self._accept(req, tok, finite, lp)
            if stream or req.finish_reason is not None:
                outputs.append(req.make_output([tok] if finite else [], not stream))
        return outputs

    def _forward(self, scheduled: list[tuple[Request, list[int]]]) -> tuple[list[Request], Any, Any]:
        """Run the step (async steps: its decode rows may read step k - 1's ids on the device), record the
        prompt logprobs its rows give, and return its sampling rows (`sampling_rows`)."""
        # valid by construction (checked prompts, sampled ids, own live sequences): no per-row checks
        every = [r.needs_prompt_logits for r, _ in scheduled]
        logits = self.executor.forward(ForwardBatch([r.seq for r, _ in scheduled], [t for _, t in scheduled],
                                                    every if any(every) else False), validate=False)
        self._fed = scheduled
        self.num_steps += 1
        if any(every):  # reads the logits on the host: waits for this step
            logits = record_prompt_logprobs(scheduled, every, logits)
        return sampling_rows(scheduled, logits, self.executor.greedy_ids)

    def _complete(self, step: InFlight, outputs: list[RequestOutput], stream: bool,
                  mask_for: list[Request] | None = None) -> Any:
        """Wait for `step`'s ids and accept them in place of its placeholders (a step launched after
        it may have fed them: they are patched in its sequences too). With `mask_for` (the next step's
        rows, some with a grammar) the matchers take the ids first, and that step's mask is computed on
        the grammar worker while the rest is accepted: returns its future."""
        caching = self.executor.kv.allocator.prefix_caching
        ids, logprobs = self._pipeline.await_ids(step)
        ended, mask = {}, None
        if mask_for is not None:
            ended = advance_grammars(step.reqs, ids)
            mask = self.grammars.mask_later(mask_for, frozenset(id(step.reqs[r]) for r, e in ended.items() if e))
        for row, (req, tok) in enumerate(zip(step.reqs, ids)):
            if req.finish_reason is not None or not req.pending:
                continue  # finished (or aborted) while the step ran: its row is dropped
            req.output.pop()
            req.pending = False
            seq = req.seq
            if seq.tokens[-1] < 0:  # the launched step fed the placeholder
                seq.tokens[-1] = max(tok, 0)
                if caching and len(seq.tokens) // self.executor.page_size > len(seq.block_keys):
                    self.executor.register_full_pages(seq)
            self._accept(req, tok, tok >= 0, logprobs[row] if logprobs is not None else None, ended.get(row, ADVANCE))
            if stream or req.finish_reason is not None:
                outputs.append(req.make_output([tok] if tok >= 0 else [], not stream))
        return mask

    def _accept(self, req: Request, tok: int, finite: bool, logprobs: dict[int, float] | None,
                grammar: str | None = ADVANCE) -> None:
        """Append a sampled token to its completion (or fail it on non-finite logits), and finish it
        when a stop condition holds. `grammar`: the outcome of `grammar_stop` where the matcher already
        took the token (`advance_grammars`)."""
        if not finite or req.nonfinite_prompt_at is not None:
            where = (f"after {len(req.output)} generated tokens" if req.nonfinite_prompt_at is None else
                     f"at prompt position {req.nonfinite_prompt_at} (its prompt_logprobs)")
            err = NonFiniteLogits(f"request {req.request_id!r} (completion {req.index}): the model produced "
                                  f"NaN or inf logits {where}")
            req.error = f"NonFiniteLogits: {err}"
            self._finish(req, "error")
            return
        req.output.append(tok)
        req.state.append(tok)
        self.num_generated_tokens += 1
        if req.logprobs is not None:
            req.logprobs.append(logprobs or {})
        stop_token = req.stop_token(tok, self.eos_token_ids)
        if req.detok is not None and (not stop_token or req.params.include_stop_str_in_output):
            req.detok.add(tok)
        reason = req.stop_reason(stop_token, self.max_context)
        # the grammar decides, on a stop token too: an EOS that a matcher in its error state let through is an error
        if req.matcher is not None and (reason is None or stop_token):
            outcome = grammar_stop(req, tok) if grammar is ADVANCE else grammar
            if reason is None or outcome == "error":
                reason = outcome
            if reason == "error":
                req.error, req.error_param = grammar_error(req, tok), "structured_outputs"
        if reason is not None:
            self._finish(req, reason)

    def _fail_fed(self, exc: BaseException) -> None:
        """After a step failed past its forward: finish with "error" each completion it fed that has nothing left
        to feed (its KV holds its last token, whose successor was never sampled: a next step would feed it no
        token and read another row's logits)."""
        for req, _ in self._fed:
            if req.finish_reason is None and req.seq is not None and req.seq.kv_len >= req.num_tokens:
                req.error = f"the step failed after its forward pass: {type(exc).__name__}: {exc}"
                self._end(req, "error")
        self._fed = []

    def _end(self, req: Request, reason: str) -> None:
        """Finish a running completion outside a step's sampling; its final output comes with the next step."""
        if req.pending:  # its in-flight row is dropped when the step's ids arrive
            req.output.pop()
            req.pending = False
        self._finish(req, reason)
        self._ready.append(req.make_output([]))

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self.scheduler.remove(req)
        self.sampler.release(req.state)  # its penalty table row
        req.group = []  # the group list holds req: without the cycle, a finished group is freed at once, not by gc
        left = self._unfinished.get(req.request_id)
        if left is None:
            return
        if left == 1:
            del self._requests[req.request_id], self._unfinished[req.request_id]
        else:
            self._unfinished[req.request_id] = left - 1

    # ---------------------------------------------------------------- conveniences
    def generate(self, prompts: list[list[int] | str] | str,
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion; returns the final output of every (prompt, index), in order.

        A str, a flat list of token ids or a 1-D tensor or numpy array is one prompt. Nothing is streamed, so
        a final output's text_delta is its whole text. Raises what `add_request` raises (before any prompt
        runs) and what `step` raises (then every request of this call is aborted); RequestError while requests
        added with `add_request` are unfinished (their outputs belong to the `step` caller, which `generate`'s
        own steps would consume).
        """
        if self.has_unfinished():
            raise RequestError(f"generate needs the engine to itself, and {len(self._requests)} request(s) added "
                               "with add_request are unfinished (or an abort's output is still to be returned): "
                               "call step() until has_unfinished() is false, or abort them, first")
        prompts, params = prompt_list(prompts), checked_params(params)
        ids = []
        try:
            for prompt in prompts:
                ids.append(self.add_request(prompt, params))
            final: dict[tuple[str, int], RequestOutput] = {}
            while len(final) < len(ids) * params.n:
                with self._busy.held("generate"):
                    outs = self._step(stream=False)
                for out in outs:
                    if out.finished:
                        final[(out.request_id, out.index)] = out
        except BaseException:
            for rid in ids:
                self.abort(rid)
            self._ready = [o for o in self._ready if o.request_id not in ids]
            raise
        return [final[(rid, i)] for rid in ids for i in range(params.n)]

    def stats(self) -> dict[str, int]:
        """Counters: running, waiting (completions), kv_pages_used, kv_pages_total, kv_pages_cached,
        prefix_cache_hit_tokens, prefix_cache_queried_tokens, num_preemptions, num_steps,
        num_async_steps (of num_steps, those launched with the previous one in flight or starting the
        pipeline: `scheduler.async_steps`), num_generated_tokens, num_draft_tokens and num_accepted_tokens
        (speculative decoding's drafts fed and accepted). Safe to read from another thread (plain ints; a snapshot)."""
        s, alloc = self.scheduler, self.executor.kv.allocator
        return {
            "running": len(s.running), "waiting": len(s.waiting),
            "kv_pages_used": alloc.num_used, "kv_pages_total": alloc.capacity, "kv_pages_cached": alloc.num_cached,
            "prefix_cache_hit_tokens": s.prefix_hit_tokens, "prefix_cache_queried_tokens": s.prefix_queried_tokens,
            "num_preemptions": s.num_preemptions, "num_steps": self.num_steps,
            "num_async_steps": self.num_async_steps, "num_generated_tokens": self.num_generated_tokens,
            "num_draft_tokens": self.speculator.num_draft_tokens if self.speculator else 0,
            "num_accepted_tokens": self.speculator.num_accepted_tokens if self.speculator else 0,
        }

