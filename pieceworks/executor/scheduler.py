"""Conveniences on top of `Executor.forward`: continuous-batching `generate` and `score`.

Serving stacks bring their own scheduler; these exist for the CLI, tests and simple embedders.
`generate` follows the Engine's rules (engine/scheduler.py) in a few lines: a prompt is admitted when
the pages its first chunk needs now (plus `scheduler.watermark` of the pool while others run) are free,
not its whole prompt + max_new_tokens, and sequences take pages as they grow. When a decoding sequence
can't get its next page, the most recently admitted one is preempted by recompute: its pages are freed
and it is queued first again, to prefill its prompt and the tokens it generated so far, then continue.
(The executor layer can't use the Engine itself: it sits below it.)
"""

from __future__ import annotations

import math
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

import torch

from pieceworks.core.batch import ForwardBatch, ForwardMode, Sequence
from pieceworks.errors import BatchError, NonFiniteLogits, OutOfPages, RequestError
from pieceworks.executor.cuda_graph import finite_rows, greedy_token_ids
from pieceworks.executor.inputs import as_token_ids
from pieceworks.executor.kv_cache import KVPool


class StepRunner(Protocol):
    """What these conveniences use of `pieceworks.executor.runner.Executor` (typed structurally, so this
    module sits below the runner that calls it)."""

    cfg: Any
    kv: KVPool
    piecewise: Any
    page_size: int
    vocab_size: int
    max_context: int

    def new_sequence(self) -> Sequence: ...
    def free(self, seq: Sequence) -> None: ...
    def pages_needed(self, seqs: list[Sequence], num_new_tokens: list[int]) -> int: ...
    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass
class _Request:
    index: int
    prompt: list[int]
    seq: Sequence | None = None
    feed: list[int] = field(default_factory=list)  # what to prefill: the prompt (+ out, after a preemption)
    done: int = 0  # tokens of feed in the KV cache
    out: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.feed = self.prompt

    @property
    def decoding(self) -> bool:
        """Prefilled: the KV holds prompt + out[:-1], and each step feeds out[-1]."""
        return self.done == len(self.feed)


@dataclass
class StepStats:
    """Wall time of each generate step (until its sampled tokens reached the host)."""

    steps: list[tuple[ForwardMode, int, float]] = field(default_factory=list)

    def add(self, mode: ForwardMode, num_tokens: int, seconds: float) -> None:
        self.steps.append((mode, num_tokens, seconds))

    def summary(self) -> str:
        def line(label: str, modes: tuple[ForwardMode, ...]) -> str:
            xs = [(n, s) for m, n, s in self.steps if m in modes]
            if not xs:
                return f"{label}: no steps"
            total = sum(s for _, s in xs)
            return (f"{label}: {len(xs)} steps, mean {1e3 * total / len(xs):.2f} ms/step, "
                    f"{sum(n for n, _ in xs) / total:.1f} tokens/s")
        return "\n".join([line("prefill (extend/mixed)", (ForwardMode.EXTEND, ForwardMode.MIXED)),
                          line("decode", (ForwardMode.DECODE,))])


def _step_budget(ex: StepRunner) -> int:
    pw = ex.piecewise
    return pw.max_tokens if pw is not None else ex.cfg.cuda_graph.piecewise.max_tokens


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RequestError(f"{name}: {value!r} must be a finite number")
    return float(value)


def _count(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RequestError(f"{name}: {value!r} must be an integer >= 1" + (" or None" if allow_none else ""))
    return int(value)


def _stop_ids(stop_token_ids: Any) -> set[int]:
    if stop_token_ids is None:
        return set()
    if isinstance(stop_token_ids, (set, frozenset)):
        stop_token_ids = sorted(stop_token_ids, key=repr)
    return set(as_token_ids(stop_token_ids, "stop_token_ids"))


def check_prompts(ex: StepRunner, prompts: Any, what: str = "prompts") -> list[list[int]]:
    """The prompts as lists of ints, each non-empty with ids in the vocabulary.

    Raises:
        RequestError: `prompts` is not a list of prompts (None, a string, one flat list of ints).
        BatchError: a prompt is empty, or holds something other than integer ids in [0, V).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise RequestError(f"{what}: expected a list of prompts (each a list of token ids), got "
                           f"{type(prompts).__name__}")
    if prompts and all(isinstance(p, numbers.Integral) for p in prompts):
        raise RequestError(f"{what}: got one flat list of ints; pass a list of prompts, e.g. [[1, 2, 3]]")
    out = []
    for i, p in enumerate(prompts):
        toks = as_token_ids(p, f"prompt {i}")
        if not toks:
            raise BatchError(f"prompt {i} is empty")
        bad = [t for t in toks if not 0 <= t < ex.vocab_size]
        if bad:
            raise BatchError(f"prompt {i}: token id(s) {bad[:5]} outside the vocabulary [0, {ex.vocab_size})")
        out.append(toks)
    return out


def check_room(ex: StepRunner, label: str, tokens: int, what: str) -> None:
    """BatchError where `tokens` (described by `what`) exceed the context limit or could never fit the KV pool."""
    if tokens > ex.max_context:
        pool = ex.kv.allocator.capacity * ex.page_size
        why = (f"the KV pool's {pool} tokens: kv_cache.num_tokens" if ex.max_context == pool else
               "the model's: model.max_context, else its max_position_embeddings")
        raise BatchError(f"{label}: {what} exceed the context limit of {ex.max_context} ({why})")
    if -(-tokens // ex.page_size) > ex.kv.allocator.capacity:
        raise BatchError(f"{label} can never fit the KV pool ({ex.kv.num_tokens} tokens)")


def generate(
    ex: StepRunner,
    prompts: list[list[int]],
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] | None = (),
    max_step_tokens: int | None = None,
    stats: StepStats | None = None,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` for every prompt; returns the new tokens per prompt.

    Greedy when temperature == 0, else sampling (temperature, top_p) from a generator seeded with
    `seed` (default: runtime.seed). Prompts are admitted as KV pages allow and prefilled in chunks
    of at most `max_step_tokens` tokens per step, mixed with the decodes of running prompts; a full
    pool preempts the latest admitted prompt by recompute (see the module docstring).

    Args:
        prompts: token ids per prompt (lists of ints, or 1-D integer numpy arrays / torch tensors).
        max_new_tokens: integer >= 1. temperature: finite, >= 0. top_p: in (0, 1].
        seed: integer or None. stop_token_ids: ids in the vocabulary (None: none).
        max_step_tokens: integer >= 1 or None (piecewise.max_tokens).

    Raises:
        RequestError: an argument of the wrong type or out of range (the same rules as the config's
            generation section); BatchError (a RequestError): an empty prompt, a bad token id, or a
            prompt that can never fit the context or the KV pool. Both before any work: nothing changes.
        NonFiniteLogits: a step produced NaN or inf logits for a prompt (broken weights, overflow);
            the message names the prompt, and every page is given back.
        OutOfPages: sequences created on the executor outside this call hold the pages the next
            prompt needs (every page this call took is given back).
    """
    max_new_tokens = _count("max_new_tokens", max_new_tokens)
    if _number("temperature", temperature) < 0:
        raise RequestError(f"temperature: {temperature!r} must be >= 0 (0 = greedy)")
    if not 0.0 < _number("top_p", top_p) <= 1.0:
        raise RequestError(f"top_p: {top_p!r} must be in (0, 1]")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not -(2**63) <= seed < 2**64):
        raise RequestError(f"seed: {seed!r} must be an integer in [-2**63, 2**64) or None")
    budget = _count("max_step_tokens", max_step_tokens, allow_none=True) or _step_budget(ex)
    if stats is not None and not isinstance(stats, StepStats):
        raise RequestError(f"stats: {type(stats).__name__} must be a StepStats or None")
    stop = _stop_ids(stop_token_ids)
    outside = sorted(t for t in stop if not 0 <= t < ex.vocab_size)
    if outside:
        raise RequestError(f"stop_token_ids: {outside[:5]} outside the vocabulary [0, {ex.vocab_size})")
    reqs = [_Request(i, p) for i, p in enumerate(check_prompts(ex, prompts))]
    for r in reqs:
        check_room(ex, f"prompt {r.index}", len(r.prompt) + max_new_tokens,
                   f"{len(r.prompt)} tokens + max_new_tokens={max_new_tokens}")
    gen = torch.Generator().manual_seed(ex.cfg.runtime.seed if seed is None else int(seed))
    pending, active = deque(reqs), []
    try:
        while pending or active:
            step = _schedule(ex, pending, active, budget)
            t0 = time.perf_counter()
            batch = ForwardBatch([r.seq for r, _ in step], [t for _, t in step])
            mode = batch.mode
            logits = ex.forward(batch)
            for r, toks in step:
                if not r.decoding:
                    r.done += len(toks)
            sampled = [i for i, (r, _) in enumerate(step) if r.decoding]
            if sampled:  # middle prefill chunks' logits predict prompt tokens: nothing to sample
                rows = logits if len(sampled) == len(step) else logits[sampled]
                ids = sample_rows(rows, temperature, top_p, gen)
                bad = [step[i][0].index for i, tok in zip(sampled, ids) if tok is None]
                if bad:
                    raise NonFiniteLogits(
                        f"prompt(s) {bad[:8]}: the step's logits hold NaN or inf (non-finite weights or an "
                        "overflow in the model); nothing was generated from them"
                    )
                for i, tok in zip(sampled, ids):
                    step[i][0].out.append(tok)
            if stats is not None:
                stats.add(mode, sum(map(len, batch.tokens)), time.perf_counter() - t0)
            finished = [r for r in active if r.out and (len(r.out) >= max_new_tokens or r.out[-1] in stop)]
            for r in finished:
                ex.free(r.seq)
                active.remove(r)
    finally:  # a closed executor (a tensor-parallel step that failed closes it) took every page with it: the
        # error on its way out is the step's, not a free's "closed"
        for r in active:
            if r.seq is not None and not r.seq.freed and not ex.closed:
                ex.free(r.seq)
    return [r.out for r in reqs]


def _schedule(ex: StepRunner, pending: deque[_Request], active: list[_Request],
              budget: int) -> list[tuple[_Request, list[int]]]:
    """The next step of `generate`: (request, new tokens) pairs. Running sequences decode their last
    token, then prompts prefill in chunks within the step's token budget (as far as free pages go),
    then queued prompts are admitted with their first chunk while its pages and the watermark fit.
    A decode that can't get its page preempts the most recently admitted request (requeued first;
    it may be the decoding one itself). Updates `pending` and `active`."""
    alloc, ps = ex.kv.allocator, ex.page_size
    free, promised, left = alloc.num_free, 0, budget
    step: list[tuple[_Request, list[int]]] = []

    def preempt() -> None:
        victim = active.pop()
        ex.free(victim.seq)
        victim.seq, victim.feed, victim.done = None, victim.prompt + victim.out, 0
        pending.appendleft(victim)

    for r in list(active):  # decodes, in admission order; a preempted one is gone from `active`
        if r.decoding and r.seq is not None:
            need = ex.pages_needed([r.seq], [1])
            while need > free - promised and r.seq is not None:
                preempt()  # the latest admitted, never one scheduled before r (those were admitted earlier)
                free = alloc.num_free
            if r.seq is not None:
                step.append((r, [r.out[-1]]))
                promised += need
                left -= 1
    while True:
        for r in active:  # prompt chunks, as large as the budget and the free pages allow
            if not r.decoding and left > 0:
                room = (len(r.seq.pages) + free - promised) * ps - r.seq.kv_len  # tokens the free pages hold
                n = min(len(r.feed) - r.done, left, room)
                if n > 0:
                    step.append((r, r.feed[r.done : r.done + n]))
                    promised += ex.pages_needed([r.seq], [n])
                    left -= n
        if step or not active:
            break
        preempt()  # every running sequence is prefilling and none can grow: make room
        free = alloc.num_free
    watermark = int(ex.cfg.scheduler.watermark * alloc.capacity)
    while pending and left > 0:
        r = pending[0]
        n = min(len(r.feed), left)
        need = -(-n // ps)
        if need + (watermark if active else 0) > free - promised:
            break
        pending.popleft()
        r.seq = ex.new_sequence()
        active.append(r)
        step.append((r, r.feed[:n]))
        promised += need
        left -= n
    if not step:
        raise OutOfPages(
            f"the next prompt needs {-(-min(len(pending[0].feed), budget) // ps)} KV pages and only "
            f"{alloc.num_free} are free: sequences created on this executor outside generate() hold the rest; "
            "free them (Executor.free)"
        )
    return step


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> list[int | None]:
    """One token per row of [n, V] float32 logits; None for a row holding NaN or inf.

    Greedy: argmax and the finiteness of each row are computed on the device and read back in one
    transfer. Sampling moves the rows to the host once and samples there (`sample`, seeded by `gen`).
    """
    if temperature <= 0:
        return [t if t >= 0 else None for t in greedy_token_ids(logits).tolist()]
    finite = finite_rows(logits)
    host, ok = logits.cpu(), finite.cpu().tolist()
    return [sample(row, temperature, top_p, gen) if f else None for row, f in zip(host, ok)]


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from a [V] float32 logits row: argmax, or temperature + nucleus sampling, in float64 (a
    temperature or top_p that float32 can't hold, e.g. 1e-40, still samples: the near-argmax or the top token)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def score(ex: StepRunner, sequences: list[list[int]], max_step_tokens: int | None = None) -> list[torch.Tensor]:
    """Per-position logits [len, V] (float32) of each sequence, prefilling in chunks.

    Raises:
        RequestError / BatchError: as `generate`'s prompts and `max_step_tokens`; before any work.
    """
    budget = _count("max_step_tokens", max_step_tokens, allow_none=True) or _step_budget(ex)
    checked = check_prompts(ex, sequences, "sequences")
    for i, toks in enumerate(checked):
        check_room(ex, f"sequence {i}", len(toks), f"{len(toks)} tokens")
    out = []
    for toks in checked:
        seq = ex.new_sequence()
        try:
            parts = [ex.forward(ForwardBatch([seq], [toks[i : i + budget]], return_all_logits=True))
                     for i in range(0, len(toks), budget)]
        finally:
            if not ex.closed:  # as in generate: a failed step's own error goes out
                ex.free(seq)
        out.append(torch.cat(parts))
    return out
