"""Structured outputs: generation held to a JSON schema, a regex, a choice or a grammar, with llguidance.

A request's `StructuredOutputsParams` compiles to one llguidance grammar (checked at `add_request`: a schema
or grammar that does not compile is a RequestError naming llguidance's message), and each of its
completions gets a matcher over the model's tokenizer. Each step, before sampling, the matchers of the
rows that sample write the tokens they allow next as a bitmask on the host, one bit per token id in int32
words ([rows with a grammar, ceil(V / 32)]), computed in parallel by llguidance's threads; the sampler
applies it to those rows on the device (`Sampler.sample(token_mask=...)`). After a token is
accepted its matcher consumes it; a matcher that has stopped (its grammar is complete and admits nothing
but EOS) ends the completion with finish_reason "stop", without sampling the EOS. A token the matcher
refuses (every token masked, e.g. by allowed_token_ids that the grammar excludes) ends it with "error".

Under async steps a step with such rows launches its forward, feeds the previous step's ids to the matchers
(`advance_grammars`), fills its mask on a worker thread while the step thread accepts those ids, and then
samples; the GPU runs the forward meanwhile, and the tokens are those of synchronous steps. The worker needs
the GIL until llguidance releases it, which the accepts hold: on the H200 most of a fill runs once the step
thread waits for it (docs/benchmarks.md, structured outputs). The last `Grammars.CACHE_SIZE` compiled grammars
are kept; with `set_reasoning` a completion's grammar starts after the reasoning's end.
llguidance is imported on first use; without it, such requests are refused with how to install it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pieceworks.engine.params import SamplingParams, StructuredOutputsParams
from pieceworks.engine.rows import TokenMask
from pieceworks.errors import RequestError

if TYPE_CHECKING:
    from pieceworks.engine.request import Request

_NO_MASK: Future = Future()  # `mask_later` where no row has a grammar
_NO_MASK.set_result(None)


def grammar_text(llg: Any, spec: StructuredOutputsParams) -> str:
    """The llguidance grammar (its serialized form) of `spec`; `llg` is the llguidance module."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else '{"type": "object"}'
        if isinstance(schema, str) and schema.strip() == "true":
            schema = "{}"  # the boolean schema: any value (llguidance applies its options to object schemas only)
        options = {"whitespace_flexible": not spec.disable_any_whitespace}
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llg.grammar_from("choice", spec.choice)
    return llg.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark


class Grammars:
    """The Engine's structured-output state: llguidance's tokenizer (built on first use: 0.3 s for SmolLM2's
    49K vocabulary) and the executor that fills masks in parallel.

    tokenizer: the model's Hugging Face tokenizer (a fast one), or None. vocab_size: the logits' width V
    (ids the tokenizer lacks are never allowed). eos_token_ids: the ids that end a completion; a matcher
    allows them where its grammar may end. pin: allocate the masks in pinned memory (a CUDA device).
    """

    CACHE_SIZE = 128  # compiled grammars kept (`matchers`)

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int] | set[int],
                 pin: bool = False) -> None:
        self.tokenizer = tokenizer
        self.pin = pin  # masks in pinned memory (a CUDA device's sampler copies them asynchronously)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = sorted(eos_token_ids)
        self._llg: Any = None
        self._lltok: Any = None
        self._executor: Any = None
        self._loading = threading.Lock()  # `matchers` may run on several threads (AsyncEngine compiles off its loop)
        # grammar text -> a matcher at its start, never advanced: requests with the same structured outputs
        # (a server's one schema) copy it instead of compiling again; the least recently used go first
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None  # `mask_later`'s thread
        self.reasoning: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # `set_reasoning`'s start, end ids

    def _load(self) -> tuple[Any, Any]:
        with self._loading:
            if self._lltok is None:
                self._build()
            return self._llg, self._lltok

    def _build(self) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError as exc:
            raise RequestError(f"structured outputs need llguidance, which does not import here ({exc}): "
                               "pip install llguidance (or pieceworks[serve])") from None
        if self.tokenizer is None:
            raise RequestError("structured outputs need the model's tokenizer, and this model has none (random "
                               "weights): use allowed_token_ids or logit_bias to constrain token ids")
        try:
            eos = self.eos_token_ids or None  # None: the tokenizer's own
            lltok = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except Exception as exc:  # a slow (Python) tokenizer, or one larger than the model's vocabulary
            raise RequestError(f"structured outputs can't use this model's tokenizer "
                               f"({type(self.tokenizer).__name__}): {exc}") from None
        self._llg, self._executor, self._lltok = llguidance, llguidance.LLExecutor(), lltok

    def set_reasoning(self, start: str, end: str) -> None:
        """Hold structured outputs back while a thinking model reasons (vLLM's behaviour with a reasoning
        parser): a completion's grammar starts after the output's first `end` (e.g. "</think>"), unless its
        prompt already closed a reasoning block (`end` after the last `start`: a chat template that switches
        thinking off writes an empty block). `pieceworks serve --reasoning-parser` sets <think>, </think>."""
        if self.tokenizer is None:
            raise RequestError("set_reasoning needs the model's tokenizer, and this model has none")
        ids = [tuple(self.tokenizer.encode(t, add_special_tokens=False)) for t in (start, end)]
        if not all(ids):
            raise RequestError(f"set_reasoning: start and end must be non-empty text, got {start!r}, {end!r}")
        self.reasoning = (ids[0], ids[1])

    def thinking(self, prompt: list[int]) -> tuple[tuple[int, ...], int] | None:
        """`Request.thinking` at the start of a completion of `prompt`: None where its grammar is on at once."""
        if self.reasoning is None:
            return None
        start, end = self.reasoning
        closed = last_index(prompt, end)
        return None if closed >= 0 and closed > last_index(prompt, start) else (end, 0)

    def for_params(self, params: SamplingParams, given: list[Any] | None = None) -> list[Any]:
        """One matcher per completion of `params` (None each where it has no structured outputs): `given`,
        compiled ahead by `matchers`, or compiled now."""
        spec = params.structured_outputs
        if spec is None:
            return [None] * params.n
        if given is None:
            return self.matchers(spec, params.n)
        if len(given) != params.n:
            raise RequestError(f"{len(given)} matchers given for n={params.n} completions; pass "
                               f"Engine.grammars.matchers(params.structured_outputs, params.n)")
        return list(given)

    def matchers(self, spec: StructuredOutputsParams, n: int) -> list[Any]:
        """`n` matchers at the start of `spec`'s grammar (one per completion). Thread-safe; llguidance
        compiles without holding the GIL, so other Python threads run meanwhile. The last `CACHE_SIZE`
        grammars stay compiled: a spec met again costs its grammar text and n copies (3-37 us against
        0.3-1.1 ms for a schema, regex or 100-way choice over SmolLM2's vocabulary, one-off script).

        Raises:
            RequestError: llguidance is missing, the model has no (usable) tokenizer, or the schema, regex
                or grammar does not compile (llguidance's message, with where).
        """
        llg, lltok = self._load()
        try:
            text = grammar_text(llg, spec)
        except ValueError as exc:
            raise RequestError(f"StructuredOutputsParams.{spec.kind}: {exc}") from None
        with self._cache_lock:
            start = self._compiled.get(text)
            if start is not None:
                self._compiled.move_to_end(text)
                return [start.deep_copy() for _ in range(n)]
        start = llg.LLMatcher(lltok, text, log_level=0)
        if start.is_error():
            raise RequestError(f"StructuredOutputsParams.{spec.kind} does not compile: "
                               f"{start.get_error().strip()}")
        with self._cache_lock:
            self._compiled[text] = start
            while len(self._compiled) > self.CACHE_SIZE:
                self._compiled.popitem(last=False)
            return [start.deep_copy() for _ in range(n)]

    def mask(self, reqs: list[Request], skip: frozenset[int] = frozenset()) -> TokenMask | None:
        """The allowed next tokens of a step's sampling rows that have a grammar (`TokenMask`: their row
        indices and bitmask words), or None where none has. Rows of completions that have finished (an async
        step's row after the previous step's token ended it) are left out, as rows without a grammar are,
        and the requests whose id() is in `skip` (their grammar ended, their finish not yet recorded)."""
        rows = _rows(reqs, skip)
        return self._fill(reqs, rows) if rows else None

    def mask_later(self, reqs: list[Request], skip: frozenset[int] = frozenset()) -> Future:
        """`mask`, its rows chosen now and its words filled on a worker thread (llguidance fills them without
        the GIL): the caller goes on with host work that touches none of these rows' matchers, then takes
        `.result()`."""
        rows = _rows(reqs, skip)
        if not rows:
            return _NO_MASK
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="pieceworks-grammar-mask")
        return self._worker.submit(self._fill, reqs, rows)

    def _fill(self, reqs: list[Request], rows: list[int]) -> TokenMask:
        words = torch.empty((len(rows), self.words), dtype=torch.int32, pin_memory=self.pin)
        self._executor.unsafe_compute_mask_ptr([(reqs[i].matcher, j) for j, i in enumerate(rows)],
                                               words.data_ptr(), self.words * 4, len(rows))
        return TokenMask(rows, words)

    def close(self) -> None:
        """Stop the mask worker thread, if one started."""
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


def _rows(reqs: list[Request], skip: frozenset[int]) -> list[int]:
    return [i for i, r in enumerate(reqs)
            if r.matcher is not None and r.thinking is None and r.finish_reason is None and id(r) not in skip]


def last_index(seq: list[int], sub: tuple[int, ...]) -> int:
    """Where the last occurrence of `sub` in `seq` starts, or -1."""
    arr, n = np.asarray(seq), len(sub)
    for i in np.flatnonzero(arr[: len(arr) - n + 1] == sub[0])[::-1]:
        if tuple(arr[i: i + n].tolist()) == sub:
            return int(i)
    return -1


def grammar_stop(req: Request, tok: int) -> str | None:
    """Feed an accepted token to the completion's matcher: "stop" where its grammar is now complete,
    "error" where the grammar refuses the token (`grammar_error` says why), else None. While the completion
    reasons (`Request.thinking`) the token only counts towards the reasoning's end."""
    if req.thinking is not None:
        end, k = req.thinking
        k = end_progress(end, k, tok)
        req.thinking = None if k == len(end) else (end, k)
        return None
    matcher = req.matcher
    if not matcher.consume_token(tok) or matcher.is_error():
        return "error"
    return "stop" if matcher.is_stopped() else None


def end_progress(end: tuple[int, ...], k: int, tok: int) -> int:
    """How many of `end`'s tokens the output ends with after `tok`, where it ended with the first k: the longest
    prefix of `end` that is a suffix of end[:k] + (tok,) (a marker whose tokens repeat, e.g. (a, a, b) after
    a, a, a, is still found)."""
    seen = end[:k] + (tok,)
    for n in range(min(len(seen), len(end)), 0, -1):
        if seen[len(seen) - n:] == end[:n]:
            return n
    return 0


def grammar_error(req: Request, tok: int) -> str:
    """The error of a completion whose matcher refused `tok` (`grammar_stop`'s "error")."""
    return (f"structured_outputs: the sampled token {tok} does not continue the request's "
            f"{req.params.structured_outputs.kind}: either it matches no text (e.g. an empty character class), or no "
            "token was allowed both by it and by the other sampling options (e.g. allowed_token_ids): "
            f"{req.matcher.get_error().split('<state>')[0].strip() or 'refused'}")  # not its state and grammar dump


ADVANCE = "advance"  # `Engine._accept`'s grammar outcome where the matcher is still to take the token


def advance_grammars(reqs: list[Request], ids: list[int]) -> dict[int, str | None]:
    """`grammar_stop` for each row of an async step whose completion has a grammar and takes its id (a
    pending row of an unfinished completion, a finite id); row -> its outcome. The Engine advances every
    matcher first so that the next step's mask can be computed while it accepts the rest."""
    return {row: grammar_stop(req, tok) for row, (req, tok) in enumerate(zip(reqs, ids))
            if req.matcher is not None and req.pending and req.finish_reason is None and tok >= 0}
