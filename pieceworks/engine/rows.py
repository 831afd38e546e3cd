"""The sampler's per-row token sets, built on the host each step: the ids min_tokens holds back, the logit_bias
entries and the allowed_token_ids as flat [B * V] indices (a request's ids become arrays once, checked against
the vocabulary then), and structured outputs' `TokenMask`. `states` are the sampler's `SamplingState`s."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from pieceworks.engine.penalties import check_ids


class TokenMask(NamedTuple):
    """Structured outputs' allowed next tokens for some rows of a step (engine/structured.py): `rows`, indices
    into the step's rows, and `words`, int32 [len(rows), ceil(V / 32)] on the host (pinned for a GPU), bit
    t % 32 of word t // 32 set where token t is allowed."""

    rows: list[int]
    words: torch.Tensor


def check_mask(mask: TokenMask, batch: int, V: int) -> None:
    """ValueError unless `mask` fits a step of `batch` rows over V tokens."""
    rows, words = mask
    shape = (len(rows), (V + 31) // 32)
    if words.shape != shape or words.dtype != torch.int32 or words.device.type != "cpu":
        raise ValueError(f"Sampler.sample takes token_mask.words as int32 {list(shape)} on the host, got "
                         f"{tuple(words.shape)} {words.dtype} on {words.device}")
    if len(set(rows)) != len(rows) or not all(0 <= r < batch for r in rows):
        raise ValueError(f"token_mask.rows must be distinct row indices below {batch}, got {rows}")


def min_tokens_mask(states: list[Any], V: int) -> np.ndarray:
    """Flat [B * V] indices of the EOS and stop ids of rows that haven't generated min_tokens yet (tokens
    in flight included)."""
    idx = []
    for i, s in enumerate(states):
        p = s.params
        if p.min_tokens and len(s.output_token_ids) + s.in_flight < p.min_tokens:
            ids = s._ids.get(("min_tokens", V))
            if ids is None:  # once per request: its ids are constant
                stop = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stop |= s.eos_token_ids
                ids = s._ids[("min_tokens", V)] = np.array(sorted(t for t in stop if t < V), dtype=np.int64)
            idx.append(ids + i * V)
    return np.concatenate(idx) if idx else _NONE


def bias_entries(states: list[Any], V: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat [B * V] indices and values of the rows' logit_bias entries."""
    idx, val = [], []
    for i, s in enumerate(states):
        if s.params.logit_bias:
            ids = s._ids.get(("bias", V))
            if ids is None:
                bias = s.params.logit_bias
                check_ids(list(bias), V, "logit_bias")
                ids = s._ids[("bias", V)] = np.fromiter(bias, dtype=np.int64, count=len(bias))
                s._ids[("bias_values", V)] = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
            idx.append(ids + i * V)
            val.append(s._ids[("bias_values", V)])
    return (np.concatenate(idx), np.concatenate(val)) if idx else (_NONE, _NONE_F)


def allowed_ids(states: list[Any], V: int) -> np.ndarray:
    """Flat [B * V] indices of the rows' allowed_token_ids."""
    idx = []
    for i, s in enumerate(states):
        if s.params.allowed_token_ids:
            ids = s._ids.get(("allowed", V))
            if ids is None:
                check_ids(s.params.allowed_token_ids, V, "allowed_token_ids")
                ids = s._ids[("allowed", V)] = np.asarray(s.params.allowed_token_ids, dtype=np.int64)
            idx.append(ids + i * V)
    return np.concatenate(idx) if idx else _NONE


_NONE, _NONE_F = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
