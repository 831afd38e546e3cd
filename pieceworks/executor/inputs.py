"""A step's inputs: the checks of a batch before anything changes (`check_batch`, `as_token_ids`), and
its host-side arrays: token ids, positions and KV slots of the new tokens, and the page table, sent to
the device as the step's `StepMetadata` (`step_inputs`), and the rows whose logits it returns.
Vectorized in numpy, a fixed number of array ops per step, because every step (and every decode-graph
replay) builds them on the host before its kernels can run."""

from __future__ import annotations

import itertools
import numbers
from typing import Any

import numpy as np
import torch

from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode, Sequence, StepMetadata, to_device
from pieceworks.errors import BatchError


def check_batch(batch: ForwardBatch, live: dict[int, Sequence], vocab_size: int,
                max_context: int) -> list[list[int]]:
    """The batch's new tokens as int lists; reads the batch, changes nothing. `live` maps the ids of
    the executor's sequences to their handles.

    Raises:
        BatchError: not a ForwardBatch of lists; a handle that is not a live Sequence of this executor,
            or one that appears twice; token ids that are not integers, none, or outside [0,
            vocab_size); more cached + new tokens than `max_context`.
    """
    if not isinstance(batch, ForwardBatch):
        raise BatchError(f"forward takes a ForwardBatch, got {type(batch).__name__}")
    for name in ("seqs", "tokens"):
        if not isinstance(getattr(batch, name), (list, tuple)):
            raise BatchError(f"ForwardBatch.{name} must be a list, got {type(getattr(batch, name)).__name__}")
    every = batch.return_all_logits
    if not isinstance(every, bool) and not (isinstance(every, list) and len(every) == len(batch.seqs)
                                            and all(isinstance(a, bool) for a in every)):
        raise BatchError(f"ForwardBatch.return_all_logits must be True, False or one bool per sequence, got {every!r}")
    bad_seqs = [s for s in batch.seqs if not isinstance(s, Sequence)]  # None among them too
    if bad_seqs:
        raise BatchError(f"ForwardBatch.seqs holds {type(bad_seqs[0]).__name__} {bad_seqs[0]!r}; give the "
                         "Sequence handles of Executor.new_sequence()")
    if len(batch.seqs) != len(batch.tokens):
        raise BatchError(f"batch has {len(batch.seqs)} sequences but {len(batch.tokens)} token lists")
    seen = set()
    out = []
    for seq, toks in zip(batch.seqs, batch.tokens):
        if seq.freed or live.get(seq.id) is not seq:
            raise BatchError(f"sequence {seq.id} was freed (or belongs to another executor)")
        if seq.id in seen:
            raise BatchError(f"sequence {seq.id} appears twice in one batch")
        seen.add(seq.id)
        toks = as_token_ids(toks, f"sequence {seq.id}")
        if not toks:
            raise BatchError(f"sequence {seq.id}: no new tokens (an empty prompt can't be run)")
        bad = [t for t in toks if not 0 <= t < vocab_size]
        if bad:
            raise BatchError(f"sequence {seq.id}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if seq.kv_len + len(toks) > max_context:
            raise BatchError(
                f"sequence {seq.id}: {seq.kv_len} cached + {len(toks)} new tokens exceed the context "
                f"limit of {max_context} (model.max_context / KV pool size)"
            )
        out.append(toks)
    return out


_INT = frozenset({int})


def only_ints(xs: Any) -> bool:
    """Whether every element of the list `xs` is a plain int (bools are not). One pass of C-level
    calls: on a 2,500-token prompt about 45 us on the CPU machine, where `all(type(t) is int ...)`
    takes 80."""
    return frozenset(map(type, xs)) <= _INT


def as_token_ids(toks: Any, what: str) -> list[int]:
    """Token ids as a list of Python ints: from a list or tuple of integers (Python or numpy), or a 1-D
    integer numpy array or torch tensor. `what` names the owner in messages ("sequence 3", "prompt 0").

    Raises:
        BatchError: None, a string, floats, bools, a tensor or array of another dtype or rank.
    """
    if type(toks) is list and only_ints(toks):
        return list(toks)  # what every step of the Engine passes: skip the checks below (ABC lookups)
    if isinstance(toks, (torch.Tensor, np.ndarray)):
        dtype = toks.dtype
        integer = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
                   if isinstance(toks, torch.Tensor) else dtype.kind in "iu")
        if not integer or toks.ndim != 1:
            raise BatchError(f"{what}: token ids must be a 1-D integer tensor or list, got {type(toks).__name__} "
                             f"of {dtype} with shape {list(toks.shape)}")
        return [int(t) for t in toks.tolist()]
    if not isinstance(toks, (list, tuple, range)):
        raise BatchError(f"{what}: token ids must be a list of ints or a 1-D integer tensor, got "
                         f"{type(toks).__name__} {_short(toks)}")
    bad = [t for t in toks if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral)][:1]
    if bad:
        bad = bad[0]
        raise BatchError(f"{what}: token ids must be ints, got {type(bad).__name__} {_short(bad)}")
    return [int(t) for t in toks]


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def token_rows(tokens: list[list[int]], kv_lens: list[int], table: np.ndarray, page_size: int,
               pad_to: int | None, pad_slot: int, out: np.ndarray | None = None) -> np.ndarray:
    """int64 [3, T] rows (token ids, positions, KV slots) of a step's new tokens, sequence after sequence,
    padded to `pad_to` tokens with id 0, position 0 and `pad_slot`.

    Sequence i's tokens sit at positions kv_lens[i], kv_lens[i] + 1, ... and their K/V go to slot
    page * page_size + position % page_size of the page that holds the position, read from row i of
    `table` (`page_table`'s array). Vectorized in numpy (a fixed number of array ops per step): on the
    CPU machine an 8192-token prefill's rows took 4.5 ms with per-token Python and tensors built from
    lists, 0.3 ms this way (an eager 32-sequence decode step: 35 -> 25 us). Written into `out` (int64
    [3, T]) when given. One sequence (every prefill chunk of a request alone) takes a path of half as many
    array ops (`step_inputs` of 500 tokens behind 2,000 cached: 63-80 -> 45 us on the CPU machine).
    """
    n = sum(map(len, tokens))
    total = pad_to or n
    rows = np.empty((3, total), dtype=np.int64) if out is None else out
    ids, positions, slots = rows
    ids[n:] = positions[n:] = 0
    slots[n:] = pad_slot
    if len(tokens) == 1:
        pos = np.arange(kv_lens[0], kv_lens[0] + n)
        ids[:n] = tokens[0]
        positions[:n] = pos
        slots[:n] = table[0, pos // page_size].astype(np.int64) * page_size + pos % page_size
    elif n:
        counts = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        seq = np.repeat(np.arange(len(tokens)), counts)
        first = np.cumsum(counts) - counts  # row of each sequence's first new token
        pos = np.asarray(kv_lens, dtype=np.int64)[seq] + np.arange(n) - first[seq]
        ids[:n] = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=n)
        positions[:n] = pos
        slots[:n] = table[seq, pos // page_size].astype(np.int64) * page_size + pos % page_size
    return rows


def page_table(pages: list[list[int]], width: int, fill: int = 0, out: np.ndarray | None = None) -> torch.Tensor:
    """[len(pages), width] int32 host tensor of each sequence's pages, padded with `fill`.

    Built in numpy, the table filled and then each row's pages stored as one slice, for every eager and piecewise
    step (`step_inputs`) and every full extend graph's step, whose table is as wide as the longest sequence allowed
    (576 pages for 9216 tokens in pages of 16; decode graphs rewrite only changed rows). On the CPU machine 5 us at
    8 sequences of 8 pages, 27 us at 33 of 33, 53 us at 128 of 8 and 0.52 ms at 256 of 128, where one masked store
    of the flattened lists took 12, 39 and 92 us and 0.59 ms (a nested Python list: 1.4 ms at 32 sequences); what is
    left is numpy's conversion of the lists. Written into `out` (int32 [len(pages), width]) when given.
    """
    longest = max(map(len, pages), default=0)
    if longest > width:
        raise ValueError(f"a sequence has {longest} pages, more than the table's width {width}")
    if out is None:
        out = np.empty((len(pages), width), dtype=np.int32)
    out[:] = fill
    for i, row in enumerate(pages):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def step_inputs(mode: ForwardMode, graph: GraphMode, seqs: list[Sequence], tokens: list[list[int]], page_size: int,
                pad_slot: int, device: torch.device, pad_to: int | None = None,
                table_width: int | None = None) -> tuple[StepMetadata, torch.Tensor]:
    """(`StepMetadata`, token ids) of one step on `device` (`Executor.prepare_step`; the sequences'
    pages already reserved). Padded tokens (up to `pad_to`) get token id 0, position 0 and `pad_slot`;
    the page table is `table_width` wide (default: the longest page list).

    Both go to the device in one copy: one int64 host buffer holds the token rows [3, T] and then the
    page table as int32 pairs (starting on a 16-byte boundary), and the metadata's tensors are views of
    its device copy (each copy through pinned memory costs 30-90 us of host time on the H200 machine)."""
    pages = [s.pages for s in seqs]
    kv_lens = [s.kv_len for s in seqs]
    width = table_width or max(1, max(map(len, pages)))
    total = pad_to or sum(map(len, tokens))
    at = -(-3 * total // 2) * 2  # the table's first int64, even: 16-byte aligned
    buf = np.empty(at + -(-len(pages) * width // 2), dtype=np.int64)
    table = buf[at:].view(np.int32)[: len(pages) * width].reshape(len(pages), width)
    page_table(pages, width, out=table)
    token_rows(tokens, kv_lens, table, page_size, pad_to, pad_slot, out=buf[: 3 * total].reshape(3, total))
    dev = to_device(torch.from_numpy(buf), device)
    ids, positions, slots = dev[: 3 * total].view(3, total)
    meta = StepMetadata(
        mode=mode, graph_mode=graph, extend_lens=[len(t) for t in tokens], prefix_lens=kv_lens,
        page_size=page_size, page_table=dev[at:].view(torch.int32)[: len(pages) * width].view(len(pages), width),
        slot_mapping=slots, positions=positions, page_lists=pages,
    )
    return meta, ids


def take_previous_ids(ids: torch.Tensor, prev: torch.Tensor) -> None:
    """Token ids that are placeholders -(r + 1) take row r's id of the previous step (`prev`, int64 on the
    device), in place and in stream order: the Engine's async steps launch a step before the previous one's
    ids reach the host. A -1 (non-finite) id becomes 0: that row's request fails and its row is dropped."""
    src = (-1 - ids).clamp_(0, prev.shape[0] - 1)
    ids.copy_(torch.where(ids < 0, prev.index_select(0, src).clamp_(min=0), ids))


def num_logit_rows(tokens: list[list[int]], all_rows: bool | list[bool]) -> int:
    """How many rows `logit_rows` names."""
    if isinstance(all_rows, list):
        return sum(len(t) if a else 1 for t, a in zip(tokens, all_rows))
    return sum(map(len, tokens)) if all_rows else len(tokens)


def logit_rows(tokens: list[list[int]], all_rows: bool | list[bool], device: torch.device) -> torch.Tensor:
    """The rows of a step's hidden states whose logits it returns: every row (True), each sequence's last
    (False), or per sequence (a list): all of its rows where True, its last where False."""
    if all_rows is True:
        return torch.arange(sum(map(len, tokens)), device=device)
    ends = list(itertools.accumulate(len(t) for t in tokens))
    if all_rows is False or not any(all_rows):
        return to_device(torch.tensor([e - 1 for e in ends]), device)
    rows = [r for t, e, a in zip(tokens, ends, all_rows) for r in (range(e - len(t), e) if a else (e - 1,))]
    return to_device(torch.tensor(rows), device)
