"""On-device penalty bookkeeping of the sampler: which tokens each penalized completion's prompt holds and
how often it generated each token, kept as [S, V] tables on the logits' device and advanced per step by
the tokens appended since the previous one (`PenaltyTable.plan` on the host, a few index kernels on the
device: `Sampler._sample`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from pieceworks.errors import RequestError


class PenaltyTable:
    """On-device penalty bookkeeping of the states that use penalties, one slot (row) each:
    counts [S, V] int32 (times each token was generated) and prompt [S, V] bool (token in the prompt).
    Slot 0 stays zero and serves the rows without penalties. A slot returns to the free list by
    `Sampler.release(state)` or when its state is garbage-collected."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self.free: list[int] = []

    def acquire(self, state: Any) -> int:
        """A free slot for `state` (a `sampler.SamplingState`), the table doubled when none is left."""
        if not self.free:
            old = self.counts.shape[0]
            new = 2 * old
            counts = self.counts.new_zeros(new, self.vocab_size)
            prompt = self.prompt.new_zeros(new, self.vocab_size)
            counts[:old] = self.counts
            prompt[:old] = self.prompt
            self.counts, self.prompt = counts, prompt
            self.free.extend(range(new - 1, old - 1, -1))
        if state._release is not None:  # a slot in another sampler's table
            state._release()
        slot = self.free.pop()
        state._release = weakref.finalize(state, self.free.append, slot)
        return slot

    def plan(self, states: list[Any], pen_rows: list[int]):
        """Host side of the penalty bookkeeping of `states` (`sampler.SamplingState`s): each row's slot (0 for rows
        without penalties), the slots to clear, the flat [S * V] indices of the output tokens to count and
        the prompt tokens to mark since each state's previous step, and per penalty row its slot and the
        number of its tokens counted then. Tokens in flight (`sample_ids`) are counted already: a state's
        counted tokens are the first `_penalty[2]` of its output, appended or not."""
        V, t = self.vocab_size, self
        row_slots = [0] * len(states)
        zero_slots: list[int] = []
        count_idx: list[int] = []
        prompt_idx: list[int] = []
        slots, counted = [], []
        for i in pen_rows:
            s = states[i]
            out = s.output_token_ids
            mine = s._penalty if s._penalty is not None and s._penalty[0] is t else None
            if mine is not None and len(out) + s.in_flight >= mine[2]:
                slot, new = mine[1], out[mine[2]:]
            else:  # first step here, or the output shrank: clear the slot and count everything
                slot = mine[1] if mine is not None else t.acquire(s)
                zero_slots.append(slot)
                check_ids(s.prompt_token_ids, V, "prompt")
                prompt_idx.extend(slot * V + tok for tok in s.prompt_token_ids)
                new = out
            check_ids(new, V, "output")
            count_idx.extend(slot * V + tok for tok in new)
            row_slots[i] = slot
            slots.append(slot)
            counted.append(len(out) if new is out else mine[2] + len(new))
        return row_slots, zero_slots, count_idx, prompt_idx, slots, counted


def check_ids(ids: list[int], V: int, what: str) -> None:
    """RequestError unless every id of `what` (prompt, output, logit_bias, allowed_token_ids) lies in [0, V)."""
    if ids and (min(ids) < 0 or max(ids) >= V):
        raise RequestError(f"{what} token ids must lie in [0, {V}) for the sampler, got {min(ids)}..{max(ids)}")
