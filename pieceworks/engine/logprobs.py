"""A step's sampled ids and the logprobs rows asked for, brought to the host in one copy: the table
`logprob_table` builds on the device and `read_logprobs` reads (the sampler's `sample`, and async steps,
which copy it into pinned memory with the ids)."""

from __future__ import annotations

import math
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
    return _table(logits, ids, min(max(p.logprobs for p in params if p.logprobs is not None), logits.shape[1]))


def _table(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    lp = logits.log_softmax(dim=-1)
    cols = [ids.unsqueeze(1).double(), lp.gather(1, ids.clamp(min=0).unsqueeze(1)).double()]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        cols += [top_ids.double(), top_lp.double()]
    return torch.cat(cols, dim=1)


PROMPT_ROWS_PER_PASS = 1024  # a prompt chunk's rows are scored in blocks: [block, V] float32 temporaries


def prompt_logprobs(logits: torch.Tensor, rows: list[int], targets: list[int], ks: list[int]) -> list[dict[int, float]]:
    """{token id: logprob} of the target token of each of `rows` of `logits` [R, V] float32 and that row's top
    ks[i] (SamplingParams.prompt_logprobs), brought to the host in one copy per block of rows."""
    k, out = min(max(ks), logits.shape[1]), []
    for i in range(0, len(rows), PROMPT_ROWS_PER_PASS):
        block = torch.tensor(rows[i : i + PROMPT_ROWS_PER_PASS], dtype=torch.int64).to(logits.device)
        ids = torch.tensor(targets[i : i + PROMPT_ROWS_PER_PASS], dtype=torch.int64).to(logits.device)
        out += _table(logits.index_select(0, block), ids, k).tolist()
    return _read(out, ks)[1]


def read_logprobs(rows: list[list[float]], params: list[SamplingParams]) -> SampleResult:
    """The SampleResult of a `logprob_table` brought to the host (as lists)."""
    token_ids, logprobs = _read(rows, [p.logprobs for p in params])
    return SampleResult(token_ids, [t >= 0 for t in token_ids], logprobs)


def _read(rows: list[list[float]], asked: list[int | None]) -> tuple[list[int], list[dict[int, float] | None]]:
    k = (len(rows[0]) - 2) // 2 if rows else 0
    token_ids = [int(r[0]) for r in rows]
    logprobs: list[dict[int, float] | None] = []
    for r, tok, a in zip(rows, token_ids, asked):
        if a is None or tok < 0:
            logprobs.append(None if a is None else {})
            continue
        d = {tok: r[1]}
        for j in range(min(a, k)):
            d.setdefault(int(r[2 + j]), r[2 + k + j])
        logprobs.append(d)
    return token_ids, logprobs


def record_prompt_logprobs(scheduled: list, every: list[bool], logits: torch.Tensor) -> torch.Tensor:
    """Append the prompt logprobs that a step's rows give to the requests that asked for them: `scheduled`
    the step's (request, new tokens) pairs, `every` marks those whose every row is in `logits` (the
    others gave their last row only). Returns the step's last row per request, as a step without prompt
    logprobs returns."""
    rows, targets, owners, last, start = [], [], [], [], 0
    for (req, toks), all_rows in zip(scheduled, every):
        n = len(toks) if all_rows else 1
        last.append(start + n - 1)
        if all_rows and req.needs_prompt_logits:  # row j predicts position first + j + 1; recorded ones skipped
            first = req.seq.kv_len - len(toks)
            for j in range(n):
                pos = first + j + 1
                if len(req.prompt_logprobs) <= pos < len(req.prompt):
                    rows.append(start + j)
                    targets.append(req.prompt[pos])
                    owners.append(req)
        start += n
    if rows:
        ks = [r.params.prompt_logprobs for r in owners]
        for req, d in zip(owners, prompt_logprobs(logits, rows, targets, ks)):
            if req.nonfinite_prompt_at is None and not all(map(math.isfinite, d.values())):
                req.nonfinite_prompt_at = len(req.prompt_logprobs)
            req.prompt_logprobs.append(d)
    return logits[last]
