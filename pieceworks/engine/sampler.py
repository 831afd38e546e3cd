"""The batched device sampler: one pass over a step's [B, V] logits with per-row SamplingParams.

Per row, in vLLM v1's order: ids a structured output's grammar does not allow next (a bitmask from
engine/structured.py), ids outside allowed_token_ids and (min_tokens) EOS and stop ids are set to -inf;
logit_bias is added; the repetition penalty (over prompt + output tokens) and the presence and
frequency penalties (over output tokens) change the logits; greedy rows take the argmax; sampled rows
divide by their temperature, drop tokens below min_p times the top probability, keep their top_k, keep
their top_p nucleus, and draw by an exponential race (argmax of probs / Exp(1)), which is a draw from
probs with one random number per token. A row whose request has a seed draws its Exp(1) numbers from its
own generator, so the same prompt and seed give the same tokens whatever else is in the batch; rows
without a seed share the sampler's generator.

Host traffic per step: at most one host-to-device copy (the rows' parameters, the logit_bias entries and
the token ids that allowed_token_ids, the penalties and min_tokens need, packed in one pinned buffer;
a second one in steps where a row has a grammar: the bitmask) and exactly one device-to-host copy (the
B token ids with the rows' finite flags and the requested logprobs, packed in one tensor). Nothing syncs
per row and no [B, V] tensor leaves the device. CPU runs the same code. A seeded row costs one kernel of
its own per step (its generator's draw); everything else is batched.

Logprobs are those of the model's raw distribution, log_softmax of the logits before any bias, penalty,
temperature or truncation: what vLLM v1 reports by default (`logprobs_mode="raw_logprobs"`), and
independent of how the request samples.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from pieceworks.core.batch import to_device
from pieceworks.engine.logprobs import SampleResult, to_host
from pieceworks.engine.params import SamplingParams
from pieceworks.engine.penalties import PenaltyTable
from pieceworks.engine.rows import TokenMask, allowed_ids, bias_entries, check_mask, min_tokens_mask
from pieceworks.engine.processors import apply_min_p, apply_penalties, apply_top_k, apply_top_k_top_p
from pieceworks.executor.cuda_graph import finite_rows, greedy_token_ids

def sampling_rows(scheduled: list, logits: torch.Tensor,
                  greedy: torch.Tensor | None) -> tuple[list, torch.Tensor, torch.Tensor | None]:
    """After a step of `scheduled` (request, new tokens) pairs ran: the requests that computed all their known
    tokens (the others ran a middle chunk of their prompt), their rows of `logits`, and `greedy` (a decode
    graph's in-graph argmax) where every row is theirs, else None. The row indices reach the device through
    pinned memory: nothing waits for the GPU."""
    rows = [i for i, (r, _) in enumerate(scheduled) if r.seq.kv_len == r.num_tokens]
    if len(rows) < len(scheduled):
        logits, greedy = logits[to_device(torch.tensor(rows, dtype=torch.int64), logits.device)], None
    return [scheduled[i][0] for i in rows], logits, greedy


_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """float32 [256, 8]: for each byte, 0 at its set bits and -inf at the others (lowest bit first): a grammar
    mask's bytes index it into what is added to the logits (one gather and one add; on the CPU 3x faster than
    unpacking the bits with shifts and a masked_fill: 1.25 against 4.2-5.6 ms at 32 x 49152, one-off script)."""
    table = _BYTE_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BYTE_TABLES[device] = torch.where(bits == 1, 0.0, float("-inf")).to(device)
    return table


def _held(x: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """x with values past float32's range held at its limits, except the ids masked to -inf (`dead`): the
    softmax stays finite, a masked id is never drawn, and a token held at a limit ties with the others there."""
    big = torch.finfo(torch.float32).max
    return x.clamp(-big, big).masked_fill_(dead, float("-inf"))


def _masked(x: torch.Tensor, token_mask: TokenMask, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`x` with -inf added where the mask's rows do not allow a token (bit t % 32 of word t // 32); the other
    rows keep every token. `rows`: the mask's row indices on the device, or None where they are 0..B-1 in
    order."""
    words = to_device(token_mask.words, x.device).view(torch.uint8)  # little-endian: byte t // 8, bit t % 8
    add = _byte_table(x.device)[words.long()].view(len(token_mask.rows), -1)[:, : x.shape[1]]
    return x + add if rows is None else x.index_add(0, rows, add)


_NUM_ROW_PARAMS = 8  # temperature, top_k, top_p, min_p, presence, frequency, repetition, greedy
_TINY = torch.finfo(torch.float32).tiny


@dataclass(eq=False)
class SamplingState:
    """What the sampler needs of one running completion; the engine creates one per (request, index)
    and keeps it for the completion's lifetime (preemption included: the penalties count its output).

    `output_token_ids` only grows, through `append`, after the engine has accepted a sampled token
    (the sampler never appends). The sampler keeps the penalty counts of a state on the device and
    adds only the tokens appended since the previous step; a list that shrank is recounted.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    """The request's own generator on the logits' device (seeded requests that sample), else None."""
    plain: bool = field(default=False, init=False, repr=False)
    """Greedy without penalties, min_tokens or logprobs: the row needs its argmax only."""
    in_flight: int = field(default=0, init=False, repr=False)
    """Tokens `sample_ids` drew that `append` has not recorded yet (0 or 1 under async steps): they count
    for min_tokens, and the penalty counts on the device already hold them."""
    _row: tuple[float, ...] | None = field(default=None, init=False, repr=False)
    _penalty: tuple[PenaltyTable, int, int] | None = field(default=None, init=False, repr=False)
    _release: weakref.finalize | None = field(default=None, init=False, repr=False)
    _ids: dict[tuple[str, int], np.ndarray] = field(default_factory=dict, init=False, repr=False)
    """allowed_token_ids and logit_bias's ids and values as arrays, checked once per vocabulary size."""

    def __post_init__(self) -> None:
        p = self.params
        self.plain = (p.greedy and not p.uses_penalties and not p.min_tokens and p.logprobs is None
                      and not p.logit_bias and not p.allowed_token_ids and p.structured_outputs is None)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Iterable[int],
        eos_token_ids: Iterable[int],
        device: torch.device | str,
        seed_offset: int = 0,
    ) -> SamplingState:
        """A state for one completion. `seed_offset` is the completion's index for n > 1: a seeded
        request's completions draw from seed + index (vLLM's rule), so they differ from each other."""
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(device=device)
            gen.manual_seed((params.seed + seed_offset) % 2**64)
        return cls(params, list(prompt_token_ids), [], frozenset(eos_token_ids), gen)

    def append(self, token_id: int) -> None:
        """Record a generated token (after the engine accepted it)."""
        self.output_token_ids.append(token_id)
        if self.in_flight:
            self.in_flight -= 1


class Sampler:
    """Samples one token per row of a step's logits, on the logits' device.

    vocab_size: the logits' width V. device: where the logits live (the shared generator and the
    penalty tables live there too). seed: the shared generator's seed (rows without a seed).
    """

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed % 2**64)
        self._table = PenaltyTable(vocab_size, self.device)
        # host staging buffers of the one host-to-device copy, used in turn (a step's copy may still be
        # pending while the next step samples: async steps), each with the event after its last copy
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._pinned_done: list[torch.cuda.Event | None] = [None, None]

    def sample(self, logits: torch.Tensor, states: list[SamplingState],
               greedy_ids: torch.Tensor | None = None, token_mask: TokenMask | None = None) -> SampleResult:
        """Sample row i of `logits` ([B, V] float32 on the sampler's device) for `states[i]`.

        `greedy_ids`: optionally int64 [B] on the same device, `greedy_token_ids(logits)` already
        computed (a decode graph's, `Executor.greedy_ids`); a batch whose rows are all plain greedy
        then costs no kernel here, only the copy of the ids to the host. The penalty bookkeeping of
        `states` advances to their current output; the states' lists are not changed (the engine
        appends the accepted tokens). `token_mask`: optionally the tokens some rows may sample (structured
        outputs' `Grammars.mask`); their other tokens' logits are -inf before any other processing.
        """
        self._check(logits, states, greedy_ids, token_mask)
        if not states:
            return SampleResult([], [], [])
        if token_mask is None and all([s.plain for s in states]):  # the common case, with the least host work per step
            if greedy_ids is None:
                greedy_ids = greedy_token_ids(logits)
            token_ids = greedy_ids.tolist()  # the one device-to-host copy of the step
            return SampleResult(token_ids, [t >= 0 for t in token_ids], [None] * len(token_ids))
        ids, finite, _ = self._device_ids(logits, states, token_mask)
        return to_host(logits, ids, finite, [s.params for s in states])

    def sample_ids(self, logits: torch.Tensor, states: list[SamplingState],
                   greedy_ids: torch.Tensor | None = None, token_mask: TokenMask | None = None) -> torch.Tensor:
        """`sample` without the copy to the host: int64 [B] on the logits' device, row i's token or -1
        where its logits are not all finite. Nothing waits for the GPU, so a step can be launched
        before the previous step's tokens are known (the Engine's async steps feed these ids to the
        next step on the device). Each row's token counts as in flight (`SamplingState.in_flight`)
        until the engine appends it: min_tokens counts it, and the rows with penalties have it added to
        their counts on the device now. Rows asking for logprobs get them from `logprob_table` of
        these ids. `token_mask`: as `sample`'s."""
        self._check(logits, states, greedy_ids, token_mask)
        if token_mask is None and all([s.plain for s in states]):
            return greedy_ids if greedy_ids is not None else greedy_token_ids(logits)
        ids, finite, slots = self._device_ids(logits, states, token_mask)
        ids = torch.where(finite, ids, -1)
        if slots is not None:  # count the drawn tokens of the rows with penalties (slot 0: none)
            t, V = self._table, self.vocab_size
            t.counts.view(-1).scatter_add_(0, slots * V + ids.clamp(min=0), ((slots > 0) & (ids >= 0)).int())
            for s in states:
                if s._penalty is not None:
                    s._penalty = (t, s._penalty[1], s._penalty[2] + 1)
        for s in states:
            s.in_flight += 1
        return ids

    def _check(self, logits: torch.Tensor, states: list[SamplingState], greedy_ids: torch.Tensor | None,
               token_mask: TokenMask | None = None) -> None:
        if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"Sampler.sample takes [B, {self.vocab_size}] float32 logits, got {tuple(logits.shape)} {logits.dtype}"
            )
        if logits.device.type != self.device.type:
            raise ValueError(f"Sampler.sample got logits on {logits.device}; this sampler works on {self.device}")
        if logits.shape[0] != len(states):
            raise ValueError(f"Sampler.sample got {logits.shape[0]} logits rows for {len(states)} states")
        if greedy_ids is not None and greedy_ids.shape != (len(states),):
            raise ValueError(f"Sampler.sample got greedy_ids of shape {tuple(greedy_ids.shape)} for {len(states)} rows")
        if token_mask is not None:
            check_mask(token_mask, len(states), self.vocab_size)

    def _device_ids(self, logits: torch.Tensor, states: list[SamplingState], token_mask: TokenMask | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every row's token and whether its raw logits are all finite (int64 [B], bool [B], on the device),
        and the rows' penalty slots (int64 [B] on the device, 0 for rows without penalties) or None."""
        params = [s.params for s in states]
        finite = finite_rows(logits)
        mask_idx = min_tokens_mask(states, self.vocab_size)
        bias, allowed = bias_entries(states, self.vocab_size), allowed_ids(states, self.vocab_size)
        pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        plain = not len(mask_idx) and not len(bias[0]) and not len(allowed) and not pen_rows
        if plain and all([p.greedy for p in params]):
            if token_mask is None:
                return logits.argmax(dim=-1), finite, None  # greedy batch: nothing to upload, nothing to process
            if token_mask.rows == list(range(len(states))):  # every row greedy and held by a grammar: mask, argmax
                return _masked(logits, token_mask).argmax(dim=-1), finite, None
        ids, slots = self._sample(logits, states, params, mask_idx, bias, allowed, pen_rows, token_mask)
        return ids, finite, slots

    def release(self, state: SamplingState) -> None:
        """Free `state`'s penalty bookkeeping now (a finished or aborted completion); without this
        call it is freed when the state is garbage-collected."""
        if state._release is not None:
            state._release()
            state._release = None
        state._penalty = None

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        params: list[SamplingParams],
        mask_idx: np.ndarray,
        bias: tuple[np.ndarray, np.ndarray],
        allowed: np.ndarray,
        pen_rows: list[int],
        token_mask: TokenMask | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, V = logits.shape
        rows = [x for s in states for x in self._row_params(s)]
        plan = self._table.plan(states, pen_rows) if pen_rows else None
        grammar_rows = token_mask.rows if token_mask is not None and token_mask.rows != list(range(B)) else []
        prm64, (mask_t, bias_t, allowed_t, grammar_t, *plan_t) = self._upload(
            [rows, bias[1]], [mask_idx, bias[0], allowed, grammar_rows] + (list(plan[:4]) if plan else []))
        table = prm64[: B * _NUM_ROW_PARAMS].view(B, _NUM_ROW_PARAMS)
        prm = table.float()  # float32 as vLLM's
        temperature, top_p, min_p, presence, frequency, repetition = (prm[:, c] for c in (0, 2, 3, 4, 5, 6))
        x = logits
        if token_mask is not None:
            x = _masked(x, token_mask, grammar_t if grammar_rows else None)
        if len(allowed):  # rows with an allowed list keep only those ids (the lists are never empty)
            keep = torch.zeros(B * V, dtype=torch.bool, device=x.device).index_fill_(0, allowed_t, True).view(B, V)
            x = x.masked_fill(~keep & keep.any(dim=1, keepdim=True), float("-inf"))
        # a bias near float32's limits, scaled past them by a repetition penalty or the temperature: inf, which
        # makes the softmax NaN (and the draw token 0, masked or not); held at the limits (`_held`)
        scaled = len(bias[0]) or any(params[i].repetition_penalty != 1 for i in pen_rows)
        dead = torch.isneginf(x) if scaled else None  # the ids masked so far (bias and penalties keep them -inf)
        if len(mask_idx) or len(bias[0]):
            x = x.clone(memory_format=torch.contiguous_format) if x is logits else x  # flat indices: row-major
        if len(mask_idx):
            x.view(-1).index_fill_(0, mask_t, float("-inf"))
            if dead is not None:
                dead.view(-1).index_fill_(0, mask_t, True)
        if len(bias[0]):
            x.view(-1).index_add_(0, bias_t, prm64[B * _NUM_ROW_PARAMS :].float())
        if plan:
            row_slots, zero_slots, count_idx, prompt_idx = plan_t
            t = self._table
            if zero_slots.numel():
                t.counts.index_fill_(0, zero_slots, 0)
                t.prompt.index_fill_(0, zero_slots, False)
            if prompt_idx.numel():
                t.prompt.view(-1).index_fill_(0, prompt_idx, True)
            if count_idx.numel():
                t.counts.view(-1).scatter_add_(0, count_idx, torch.ones_like(count_idx, dtype=torch.int32))
            for i, slot, counted in zip(pen_rows, plan[4], plan[5]):
                states[i]._penalty = (t, slot, counted)
            pen = [params[i] for i in pen_rows]
            use_rep = any(p.repetition_penalty != 1 for p in pen)
            x = apply_penalties(
                x, t.prompt.index_select(0, row_slots) if use_rep else None, t.counts.index_select(0, row_slots),
                presence if any(p.presence_penalty for p in pen) else None,
                frequency if any(p.frequency_penalty for p in pen) else None,
                repetition if use_rep else None,
            )
        if dead is not None:
            x = _held(x, dead)
        greedy = [p.greedy for p in params]
        greedy_ids = x.argmax(dim=-1) if any(greedy) else None
        row_slots = plan_t[0] if plan else None
        if all(greedy):
            return greedy_ids, row_slots
        sampled = [p for p, g in zip(params, greedy) if not g]
        x = x / temperature.unsqueeze(1)
        if dead is not None:
            x = _held(x, dead)
        if any(p.min_p > 0 for p in sampled):
            x = apply_min_p(x, min_p)
        k_max = max([p.top_k for p in sampled if 1 < p.top_k < V], default=0)
        use_p = any(p.top_p < 1 for p in sampled)
        if use_p:
            x = apply_top_k_top_p(x, table[:, 1].long() if k_max else None, top_p)
        elif k_max:
            x = apply_top_k(x, table[:, 1].long(), k_max)
        probs = x.softmax(dim=-1)
        ids = probs.div_(self._exponentials(probs, states, greedy)).argmax(dim=-1)
        if greedy_ids is not None:
            ids = torch.where(prm[:, 7] != 0, greedy_ids, ids)
        return ids, row_slots

    def _row_params(self, s: SamplingState) -> tuple[float, ...]:
        if s._row is None:
            p, V = s.params, self.vocab_size
            if p.greedy:  # the greedy argmax is taken before temperature and truncation
                s._row = (1.0, V, 1.0, 0.0, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, 1.0)
            else:
                k = V if p.top_k <= 0 else min(p.top_k, V)
                s._row = (p.temperature, k, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                          p.repetition_penalty, 0.0)
        return s._row

    def _upload(self, floats: list, ints: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's one host-to-device copy: the sections of `floats` (lists or arrays) as float64 [n] and each
        section of `ints` as an int64 tensor, packed in one int64 buffer (the floats by their bits), so nothing
        needs a cast. numpy converts the lists; the arrays (a request's ids) are copied as they are."""
        floats = np.concatenate([np.asarray(f, dtype=np.float64) for f in floats])
        n, sizes = len(floats), [len(i) for i in ints]
        packed = np.empty(n + sum(sizes), dtype=np.int64)
        packed[:n] = floats.view(np.int64)
        at = n
        for sec, k in zip(ints, sizes):
            packed[at : at + k] = sec
            at += k
        host = torch.from_numpy(packed)
        if self.device.type == "cuda":
            self._pinned.reverse()
            self._pinned_done.reverse()
            done = self._pinned_done[0]
            if done is not None and not done.query():
                done.synchronize()  # the copy two steps back still reads this buffer: rare (a failed step)
            if self._pinned[0] is None or self._pinned[0].numel() < host.numel():
                self._pinned[0] = torch.empty(max(host.numel(), 4096), dtype=torch.int64, pin_memory=True)
            buf = self._pinned[0][: host.numel()]
            buf.copy_(host)
            dev = buf.to(self.device, non_blocking=True)
            self._pinned_done[0] = torch.cuda.Event()
            self._pinned_done[0].record()
        elif self.device.type == "cpu":
            dev = host
        else:
            dev = host.to(self.device)
        return dev[:n].view(torch.float64), list(dev[n:].split(sizes))

    def _exponentials(self, probs: torch.Tensor, states: list[SamplingState], greedy: list[bool]) -> torch.Tensor:
        """Exp(1) draws [B, V]: a seeded row's from its own generator (V numbers per step whatever the
        batch), the other sampled rows' from the shared one. Greedy rows' values are unused."""
        q = torch.empty_like(probs)
        if any(not g and s.generator is None for s, g in zip(states, greedy)):
            q.exponential_(generator=self.generator)
        for i, (s, g) in enumerate(zip(states, greedy)):
            if s.generator is not None and not g:
                q[i].exponential_(generator=s.generator)
        return q.clamp_min_(_TINY)  # an exact 0 would divide a masked (0) probability into NaN
