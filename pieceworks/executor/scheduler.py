"""Conveniences on top of `Executor.forward`: continuous-batching `generate` and `score`.

Serving stacks bring their own scheduler; these exist for the CLI, tests and simple embedders.
Admission reserves each prompt's worst case (prompt + max_new_tokens) against the free KV pages, so a
running sequence never runs out of pages and nothing needs preempting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
import time
from typing import Any, Iterable, Protocol

import torch

from pieceworks.core.batch import ForwardBatch, ForwardMode, Sequence
from pieceworks.errors import BatchError
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
    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass
class _Request:
    index: int
    prompt: list[int]
    seq: Sequence | None = None
    done_prompt: int = 0
    out: list[int] = field(default_factory=list)

    def pages_needed(self, max_new: int, page_size: int) -> int:
        return -(-(len(self.prompt) + max_new) // page_size)


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


def generate(
    ex: StepRunner,
    prompts: list[list[int]],
    max_new_tokens: int = 32,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token_ids: Iterable[int] = (),
    max_step_tokens: int | None = None,
    stats: StepStats | None = None,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` for every prompt; returns the new tokens per prompt.

    Greedy when temperature == 0, else sampling (temperature, top_p) from a generator seeded with
    `seed` (default: runtime.seed). Prompts are admitted as KV pages allow and prefilled in chunks
    of at most `max_step_tokens` tokens per step, mixed with the decodes of running prompts.

    Raises:
        BatchError: an empty prompt, a bad token id, or a prompt that can never fit the context or the
            KV pool; raised before any work, so nothing changes.
    """
    if max_new_tokens < 1:
        raise BatchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ps = ex.page_size
    reqs = [_Request(i, list(p)) for i, p in enumerate(prompts)]
    for r in reqs:
        if not r.prompt:
            raise BatchError(f"prompt {r.index} is empty")
        bad = [t for t in r.prompt if not (isinstance(t, int) and 0 <= t < ex.vocab_size)]
        if bad:
            raise BatchError(f"prompt {r.index}: token id(s) {bad[:5]} outside the vocabulary [0, {ex.vocab_size})")
        if len(r.prompt) + max_new_tokens > ex.max_context:
            raise BatchError(
                f"prompt {r.index}: {len(r.prompt)} tokens + max_new_tokens={max_new_tokens} exceed the "
                f"context limit of {ex.max_context}"
            )
        if r.pages_needed(max_new_tokens, ps) > ex.kv.allocator.capacity:
            raise BatchError(f"prompt {r.index} can never fit the KV pool ({ex.kv.num_tokens} tokens)")
    gen = torch.Generator().manual_seed(ex.cfg.runtime.seed if seed is None else seed)
    stop = set(stop_token_ids)
    budget = max_step_tokens or _step_budget(ex)
    pending, active = deque(reqs), []
    try:
        while pending or active:
            outstanding = sum(r.pages_needed(max_new_tokens, ps) - len(r.seq.pages) for r in active)
            while pending and pending[0].pages_needed(max_new_tokens, ps) + outstanding <= ex.kv.allocator.num_free:
                r = pending.popleft()
                r.seq = ex.new_sequence()
                outstanding += r.pages_needed(max_new_tokens, ps)
                active.append(r)
            if not active:
                raise BatchError("the KV pool is too small for the next prompt")  # guarded above
            step: list[tuple[_Request, list[int]]] = []
            left = budget
            for r in active:  # running sequences decode their last token
                if r.done_prompt == len(r.prompt):
                    step.append((r, [r.out[-1]]))
                    left -= 1
            for r in active:  # prompts prefill in chunks within the step's token budget
                if r.done_prompt < len(r.prompt) and left > 0:
                    chunk = r.prompt[r.done_prompt : r.done_prompt + left]
                    step.append((r, chunk))
                    left -= len(chunk)
            t0 = time.perf_counter()
            batch = ForwardBatch([r.seq for r, _ in step], [t for _, t in step])
            mode = batch.mode
            logits = ex.forward(batch)
            for (r, toks), row in zip(step, logits):
                if r.done_prompt < len(r.prompt):
                    r.done_prompt += len(toks)
                    if r.done_prompt < len(r.prompt):
                        continue  # a middle chunk: its logits predict prompt tokens
                r.out.append(sample(row, temperature, top_p, gen))
            if stats is not None:
                stats.add(mode, sum(map(len, batch.tokens)), time.perf_counter() - t0)
            finished = [r for r in active if r.out and (len(r.out) >= max_new_tokens or r.out[-1] in stop)]
            for r in finished:
                ex.free(r.seq)
                active.remove(r)
    finally:
        for r in active:
            if r.seq is not None and not r.seq.freed:
                ex.free(r.seq)
    return [r.out for r in reqs]


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from a [V] float32 logits row: argmax, or temperature + nucleus sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


def score(ex: StepRunner, sequences: list[list[int]], max_step_tokens: int | None = None) -> list[torch.Tensor]:
    """Per-position logits [len, V] (float32) of each sequence, prefilling in chunks."""
    budget = max_step_tokens or _step_budget(ex)
    out = []
    for toks in sequences:
        toks = list(toks)
        seq = ex.new_sequence()
        try:
            parts = [ex.forward(ForwardBatch([seq], [toks[i : i + budget]], return_all_logits=True))
                     for i in range(0, max(len(toks), 1), budget)]
        finally:
            ex.free(seq)
        out.append(torch.cat(parts))
    return out
