"""Speculative decoding with n-gram drafts (vLLM's prompt lookup), checked in one step.

A decode row whose last tokens occurred before in its prompt + output gets drafts d1..dk: the tokens that
followed that earlier occurrence (the longest trailing n-gram that occurred before wins; its latest
occurrence). The step feeds [last, d1..dk] and returns the logits of every fed token; the sampler draws each
row's token t0..tk as in any step (its own rules: masks, logit_bias, greedy or temperature and truncation), and
the row keeps t0, t1, ... while each draft equals the token drawn before it: t_j is kept when d1..dj equal
t0..t(j-1), so every kept token was drawn from the distribution plain decoding draws it from, given the same
tokens before it. A greedy row thus gets plain greedy decoding's tokens; a sampled row gets tokens distributed
as plain sampling's (for a draft of one fixed token, speculative sampling's accept-with-probability-p(d), else
draw from p without d, is exactly this: draw from p, keep going if it was d). A step yields 1 to k + 1 tokens
per row, and the KV of the drafts that were not kept is cut off (`Executor.truncate`).

Which rows draft: completions without penalties, structured outputs or prompt logprobs, once min_tokens are
out (their next-token rule does not depend on which drafts are kept); the others run one token per step
beside them. Drafts never run past max_tokens or the context limit, and take only the step's tokens and KV
pages that the running requests' own tokens left (`Scheduler._add_drafts`). Steps that may draft run synchronously
(the next step's drafts depend on what this one kept); with `speculative.max_batch`, steps over more running
requests do not draft and run asynchronously where `scheduler.async_steps` allows, and drafting resumes once the
step in flight is accepted (the index reads the tokens it missed at its next lookup). A seeded row draws once per
fed position from its own generator: reproducible, but not the tokens it draws without speculation.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.config import SpeculativeConfig
from pieceworks.core.batch import ForwardBatch, to_device
from pieceworks.engine.logprobs import record_prompt_logprobs


class NgramIndex:
    """One completion's n-grams: for each n in [lo, hi], where (after which token) each n-gram of its
    prompt + output last ended. It reads the tokens it has not seen from the request at each lookup, so
    a step costs (hi - lo + 1) dictionary entries per new token."""

    __slots__ = ("tokens", "ends", "lo", "hi")

    def __init__(self, lo: int, hi: int) -> None:
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(lo, hi + 1)]
        self.lo, self.hi = lo, hi

    def propose(self, req: Any, k: int) -> list[int]:
        """Up to `k` draft tokens for `req` (prompt + output), or [] where no trailing n-gram occurred before."""
        toks = self.tokens
        seen = len(toks)
        toks += req.tokens(seen)
        L = len(toks)
        # index the n-grams ending before the last token (those ending at it are the ones looked up); a later end
        # overwrites an earlier one, so each n-gram keeps its latest
        if L - seen > 16:  # a prompt: zipped slices (2,000 tokens: 0.45 ms, 1.10 in the loop below; one-off script)
            for n, ends in enumerate(self.ends, start=self.lo):
                first = max(seen, n)
                if first < L:
                    ends.update(zip(zip(*[toks[first - n + i:L - n + i] for i in range(n)]), range(first, L)))
        else:  # a step's 1 to k + 1 tokens
            for e in range(max(seen, 1), L):
                for n, ends in enumerate(self.ends, start=self.lo):
                    if e >= n:
                        ends[tuple(toks[e - n:e])] = e
        for n in range(min(self.hi, L), self.lo - 1, -1):
            e = self.ends[n - self.lo].get(tuple(toks[L - n:]))
            if e is not None:
                return toks[e:e + k]
        return []


class Speculator:
    """The Engine's drafts (`draft`, called by the scheduler per decode row) and its verify step (`step`).

    Counters: num_draft_tokens (drafts fed), num_accepted_tokens (drafts accepted).
    """

    def __init__(self, cfg: SpeculativeConfig, max_context: int) -> None:
        self.k = cfg.num_speculative_tokens
        self.max_batch = cfg.max_batch  # drafts while at most this many requests run (None: always)
        self.lo, self.hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.max_context = max_context
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def drafting(self, running: int) -> bool:
        """Whether a step over `running` requests may draft (`max_batch`)."""
        return self.max_batch is None or running <= self.max_batch

    def index_for(self, params: Any, matcher: Any) -> NgramIndex | None:
        """A new completion's n-gram index, or None where its rows can't draft (module docstring)."""
        if params.uses_penalties or matcher is not None or params.prompt_logprobs is not None:
            return None
        return NgramIndex(self.lo, self.hi)

    def draft(self, req: Any, budget: int) -> list[int]:
        """The drafts of `req`'s next decode step, at most `budget` tokens (the step's tokens left after its
        own); [] where it does not draft."""
        p = req.params
        if req.ngram is None or len(req.output) < p.min_tokens:
            return []
        k = min(self.k, budget, self.max_context - req.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - len(req.output) - 1)
        return req.ngram.propose(req, k) if k > 0 else []

    def step(self, engine: Any, scheduled: list[tuple[Any, list[int]]], outputs: list, stream: bool) -> None:
        """Run a step in which some rows carry drafts (`Request.draft`), sample every row in one pass, and accept
        what each row's drafts earned; appends the step's outputs to `outputs`."""
        ex = engine.executor
        every = [r.needs_prompt_logits or bool(r.draft) for r, _ in scheduled]
        try:
            logits = ex.forward(ForwardBatch([r.seq for r, _ in scheduled], [t for _, t in scheduled], every),
                                validate=False)
        except BaseException:  # the step changed nothing (Executor.forward): neither do its drafts
            for req, _ in scheduled:
                req.draft = []
            raise
        engine.num_steps += 1
        engine._fed = scheduled
        if any(r.needs_prompt_logits for r, _ in scheduled):
            record_prompt_logprobs(scheduled, every, logits)
        plain, plain_rows, spec, spec_rows, start = [], [], [], [], 0
        for (req, toks), all_rows in zip(scheduled, every):
            n = len(toks) if all_rows else 1
            if req.draft:
                spec.append(req)
                spec_rows.extend(range(start, start + n))
            elif req.seq.kv_len == req.num_tokens:  # else a middle chunk of a prompt ran
                plain.append(req)
                plain_rows.append(start + n - 1)
            start += n
        # one sampling pass: the plain rows first (a grammar's mask names their row indices), then each
        # drafting row's k + 1 rows under its own state (no penalties: the same rule at every position; a
        # seeded state draws for its rows in order, one draw each)
        rows = to_device(torch.tensor(plain_rows + spec_rows, dtype=torch.int64), logits.device)
        states = [r.state for r in plain] + [r.state for r in spec for _ in range(len(r.draft) + 1)]
        mask = engine.grammars.mask(plain) if plain and engine.scheduler.structured else None
        result = engine.sampler.sample(logits[rows], states, None, mask)
        ids, finite, lps = result.token_ids, result.finite, result.logprobs
        for i, req in enumerate(plain):
            engine._accept(req, ids[i], finite[i], lps[i])
            if stream or req.finish_reason is not None:
                outputs.append(req.make_output([ids[i]] if finite[i] else [], not stream))
        i = len(plain)
        for req in spec:
            draft, new = req.draft, []
            self.num_draft_tokens += len(draft)
            for j in range(len(draft) + 1):
                tok = ids[i + j]
                engine._accept(req, tok, finite[i + j], lps[i + j])
                if not finite[i + j]:
                    break
                new.append(tok)
                matched = j < len(draft) and tok == draft[j]
                self.num_accepted_tokens += matched
                if req.finish_reason is not None or not matched:
                    break
            i += len(draft) + 1
            req.draft = []
            if req.seq is not None:  # running on: drop the KV of the drafts not accepted
                ex.truncate(req.seq, req.num_tokens - 1)
            if stream or req.finish_reason is not None:
                outputs.append(req.make_output(new, not stream))
