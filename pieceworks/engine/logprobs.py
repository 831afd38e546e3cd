"""A step's sampled ids and the logprobs rows asked for, brought to the host in one copy: the table
`logprob_table` builds on the device and `read_logprobs` reads (the sampler's `sample`, and async steps,
which copy it into pinned memory with the ids)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pieceworks.engine.params import SamplingParams


@dataclass
class SampleResult:
    """One step's samples, on the host.

    token_ids[i]: row i's token, or -1 when its raw logits were not all finite. finite[i]: whether
    they were (when False the request should fail with NonFiniteLogits; a -1 that reached the model
    would be refused as a bad token id). logprobs[i]: None unless row i asked for logprobs; else
    {token id: logprob} of the sampled token and the row's top `logprobs` tokens (raw distribution,
    see the module docstring), empty for a non-finite row.
    """

    token_ids: list[int]
    finite: list[bool]
    logprobs: list[dict[int, float] | None]


def to_host(
    logits: torch.Tensor, ids: torch.Tensor, finite: torch.Tensor, params: list[SamplingParams]
) -> SampleResult:
    """Bring ids [B] (-1 where `finite` [B] is False) and the requested logprobs over in the step's one
    device-to-host copy: an int64 [B] tensor, or with logprobs the float64 `logprob_table`."""
    checked = torch.where(finite, ids, -1)  # the finite flag rides on the id's sign
    if all([p.logprobs is None for p in params]):
        token_ids = checked.tolist()  # the one device-to-host copy of the step
        return SampleResult(token_ids, [t >= 0 for t in token_ids], [None] * len(token_ids))
    return read_logprobs(logprob_table(logits, checked, params).tolist(), params)


def logprob_table(logits: torch.Tensor, ids: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float64 [B, 2 + 2k] on the logits' device, one row per step row: its id (-1: non-finite logits), the
    id's logprob, then the top k ids and their logprobs (k: the most logprobs a row asks for, at most V);
    exact for ids < 2**53 and float32 logprobs. `read_logprobs` reads it on the host."""
    k = min(max(p.logprobs for p in params if p.logprobs is not None), logits.shape[1])
    lp = logits.log_softmax(dim=-1)
    cols = [ids.unsqueeze(1).double(), lp.gather(1, ids.clamp(min=0).unsqueeze(1)).double()]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        cols += [top_ids.double(), top_lp.double()]
    return torch.cat(cols, dim=1)


def read_logprobs(rows: list[list[float]], params: list[SamplingParams]) -> SampleResult:
    """The SampleResult of a `logprob_table` brought to the host (as lists)."""
    k = (len(rows[0]) - 2) // 2 if rows else 0
    token_ids = [int(r[0]) for r in rows]
    logprobs: list[dict[int, float] | None] = []
    for r, tok, p in zip(rows, token_ids, params):
        a = p.logprobs
        if a is None or tok < 0:
            logprobs.append(None if a is None else {})
            continue
        d = {tok: r[1]}
        for j in range(min(a, k)):
            d.setdefault(int(r[2 + j]), r[2 + k + j])
        logprobs.append(d)
    return SampleResult(token_ids, [t >= 0 for t in token_ids], logprobs)
