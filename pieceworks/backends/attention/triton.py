"""Paged GQA decode attention in Triton: a decode-only backend (`triton_decode_kernel.py`).

At batch 1 on the H200 FlashInfer's decode spends about 13 us per layer on a 512-token context (its
CUDA-core kernel plus a merge-states kernel, docs/benchmarks.md) to read 2 MB of K/V. This backend runs
one launch per layer: programs over (sequence, KV head, split of the sequence), with the splits merged
by the last program to finish. The number of splits depends only on the batch size (so a graph replays
the launch it captured): enough programs to cover the GPU's SMs about four times, at most 16.

It serves decode steps only (`forward_modes`) and is `auto`'s choice for them where it can serve
(priority above FlashInfer's: on the H200 the Llama-3.1-8B NVFP4 decode step, Executor.forward, is
faster with it at every batch size and context measured, docs/benchmarks.md); extend steps go to the
next backend (FlashInfer, else torch). Pin `backends.attention: flashinfer` to keep FlashInfer for
decode too. Safe in FULL decode graphs: plan() picks per-batch-size buffers at fixed addresses and
allocates the split buffers and counters, never inside a capture; sequence lengths come from the
step's token positions on the device (length = position + 1), so a step copies nothing for them.
Eager decode steps share one set of split buffers, grown when a larger batch needs more (their size
is batch x splits, and splits shrink as the batch grows). The kernel also writes the step's K/V rows
into the cache (no separate write launch) where they come one row per sequence, quantizing them for an FP8
pool; such a pool's K/V are read as words decoded into the query dtype, times the layer's scales
(`triton_decode_kernel.e4m3_rows`; docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch

from pieceworks.backends.attention.base import AttentionBackend, gqa_kernel_reasons
from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.kv_write import write_rows
from pieceworks.core.batch import ForwardMode, to_device
from pieceworks.core.kv import KV_FP8

TARGET_PROGRAMS = 512  # about four per SM on an H200 (132 SMs): the 11:25 launch sweep (docs/benchmarks.md)
MAX_SPLITS = 16


def num_splits(batch: int, num_kv_heads: int, target: int = TARGET_PROGRAMS, most: int = MAX_SPLITS) -> int:
    """KV splits per (sequence, head): ceil(target / (batch * heads)), between 1 and `most`."""
    return max(1, min(most, -(-target // max(1, batch * num_kv_heads))))


class TritonDecodeAttentionBackend(AttentionBackend):
    name = "triton"
    priority = 110  # above FlashInfer (100): `auto` takes it for decode steps, FlashInfer for the rest
    graph_modes = ALL_GRAPH_MODES
    forward_modes = frozenset({ForwardMode.DECODE})
    requires = Requirements(devices=("cuda",), min_capability=(8, 0), modules=("triton",),
                            install_hint="pip install triton (it comes with CUDA builds of torch)")
    fp8_kv = True
    description = "decode only: split-KV paged GQA attention in Triton, one launch per layer"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec) + gqa_kernel_reasons(spec.model, "its Triton kernels")
        m = spec.model
        if m.num_heads % m.num_kv_heads == 0 and m.num_heads // m.num_kv_heads > 64:
            reasons.append(f"at most 64 query heads per KV head (model: {m.num_heads // m.num_kv_heads})")
        if m.kv_fp8 and spec.capability is not None and spec.capability < (8, 9):
            reasons.append("quantizes the FP8 KV cache's new rows through Triton's e4m3 type, which needs sm_89 "
                           "or newer")
        return reasons

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        self._meta = None
        self._graph_bufs: dict[int, tuple] = {}
        self._eager_bufs: tuple | None = None  # (batch, batch x splits, part_o, part_lse, counters) capacity
        self._bufs = None

    def plan(self, meta) -> None:
        if meta.mode is not ForwardMode.DECODE:
            raise ValueError(f"attention.triton serves decode steps only (got {meta.mode.value}); select "
                             "it with backends.attention: {decode: triton}")
        self._meta = meta
        graph = meta.graph_batch_size is not None
        batch = meta.graph_batch_size or meta.num_seqs
        # Sequence lengths need no copy: a decode step's token positions are already on the device
        # (meta.positions, at fixed addresses under FULL graphs) and each sequence's length is its new
        # token's position + 1, which the kernel computes (graph padding rows: position 1, harmless
        # reads of the reserved page).
        if graph:
            # FULL graphs: buffers of this batch size at fixed addresses
            bufs = self._graph_bufs.get(batch)
            if bufs is None:
                splits = num_splits(batch, self.spec.model.num_kv_heads)
                bufs = self._graph_bufs[batch] = (splits, batch, *self._alloc(batch, batch * splits, meta.device))
        else:
            # eager steps of any batch size share one set of split buffers, grown when a step needs more
            splits = num_splits(batch, self.spec.model.num_kv_heads)
            cap_batch, cap_units = self._eager_bufs[:2] if self._eager_bufs else (0, 0)
            if cap_batch < batch or cap_units < batch * splits:
                cap_batch, cap_units = max(cap_batch, batch), max(cap_units, batch * splits)
                self._eager_bufs = (cap_batch, cap_units, *self._alloc(cap_batch, cap_units, meta.device))
            part_o, part_lse, counters = self._eager_bufs[2:]
            bufs = (splits, batch, part_o, part_lse, counters)
        self._bufs = bufs

    def _alloc(self, batch: int, units: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split partials for `units` (sequence, split) pairs and zeroed per-(sequence, head) counters
        for `batch` sequences."""
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attention.triton: plan() needs new buffers inside a CUDA graph capture")
        m = self.spec.model
        group = m.num_heads // m.num_kv_heads
        rows = units * m.num_kv_heads * max(16, 1 << (group - 1).bit_length())
        return (torch.empty(rows * m.head_dim, dtype=torch.float32, device=device),
                torch.empty(rows, dtype=torch.float32, device=device),
                torch.zeros(batch * m.num_kv_heads, dtype=torch.int32, device=device))

    def forward(self, q, k, v, out, layer_id, scale, kv) -> None:
        from pieceworks.backends.attention import triton_decode_kernel

        meta = self._meta
        kc, vc = kv.k_cache(layer_id), kv.v_cache(layer_id)
        splits, batch, part_o, part_lse, counters = self._bufs
        # The decode kernel writes the step's K/V rows itself (one launch less per layer) where they
        # are one row per sequence, at meta.slot_mapping's slot (graph padding rows: the reserved slot,
        # as the contract says), quantizing them for an FP8 pool. Else the separate write first.
        fuse = (k.shape[0] == batch and k.dtype == v.dtype and kc.dtype == vc.dtype
                and (kc.dtype == k.dtype or kc.dtype == KV_FP8) and k.stride(-1) == 1 and v.stride(-1) == 1)
        scales = kv.k_scale(layer_id), kv.v_scale(layer_id)
        if not fuse:  # the write kernel, quantizing an FP8 pool's rows
            width = kc.shape[2] * kc.shape[3]
            write_rows(kc.view(-1, width), k.reshape(k.shape[0], -1), vc.view(-1, width),
                       v.reshape(v.shape[0], -1), meta.slot_mapping[: k.shape[0]], scales)
        if out.shape[0] > batch:  # padding rows: keep them finite
            out[batch:].zero_()
        triton_decode_kernel.decode(q[:batch], kc, vc, out[:batch], meta.page_table[:batch],
                                    meta.positions[:batch], scale, splits, part_o, part_lse, counters,
                                    k_new=k if fuse else None, v_new=v if fuse else None,
                                    lens_are_positions=True, slots=meta.slot_mapping[:batch] if fuse else None,
                                    kv_scales=scales)


class TritonAttentionBackend(TritonDecodeAttentionBackend):
    """attention.triton's kernels for every step: decode as `triton`, extend and mixed steps through
    `triton_extend_kernel` (planned on the device, so safe in full extend graphs: executor/extend_graph.py).
    Below FlashInfer for `auto`; pin it with backends.attention: {decode: triton, extend: triton_all}."""

    name = "triton_all"
    priority = 50
    forward_modes = frozenset({ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED})
    full_extend = True
    description = "split-KV paged GQA decode and device-planned extend attention in Triton"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        if spec.model.kv_fp8:
            reasons.append("its extend kernel reads bf16 / fp16 pools only (kv_cache.dtype resolves to fp8)")
        return reasons

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        self._ext = None

    def plan(self, meta) -> None:
        if meta.mode is ForwardMode.DECODE:
            super().plan(meta)
            return
        self._meta = meta
        self._plan_extend(meta)

    def forward(self, q, k, v, out, layer_id, scale, kv) -> None:
        if self._meta.mode is ForwardMode.DECODE:
            super().forward(q, k, v, out, layer_id, scale, kv)
            return
        self._extend(q, k, v, out, layer_id, scale, kv)

    def _plan_extend(self, meta) -> None:
        """Extend / mixed steps: each sequence's query offsets and KV lengths, [qo (B + 1), lens (B)] int32 in
        one copy (`triton_extend_kernel`). Full graphs (`graph_batch_size` sequences, padding ones empty) read
        them from the extend graph runner's own copy at a fixed address (`StepMetadata.extend_index`)."""
        if meta.extend_index is not None:
            self._ext = (meta.graph_batch_size, meta.slot_mapping.shape[0], meta.extend_index)
            return
        if meta.graph_batch_size is not None:
            raise ValueError("attention.triton_all: a full graph's extend step needs StepMetadata.extend_index "
                             "(executor/extend_graph.py lays it out)")
        qo, lens = meta.qo_indptr(), meta.seq_lens
        self._ext = (len(lens), meta.num_tokens, to_device(torch.tensor(qo + lens, dtype=torch.int32), meta.device))

    def _extend(self, q, k, v, out, layer_id, scale, kv) -> None:
        from pieceworks.backends.attention import triton_extend_kernel

        kc, vc = kv.k_cache(layer_id), kv.v_cache(layer_id)
        if kc.dtype == KV_FP8:
            raise NotImplementedError("attention.triton's extend kernel reads bf16 / fp16 pools only")
        width = kc.shape[2] * kc.shape[3]
        write_rows(kc.view(-1, width), k.reshape(k.shape[0], -1), vc.view(-1, width), v.reshape(v.shape[0], -1),
                   self._meta.slot_mapping[: k.shape[0]], (kv.k_scale(layer_id), kv.v_scale(layer_id)))
        seqs, tokens, idx = self._ext
        # padding rows belong to no sequence: keep them finite (a full graph's token count changes per replay, so
        # there the kernel zeroes the rows past the step's tokens itself)
        full = self._meta.graph_batch_size is not None
        if full and os.environ.get("PIECEWORKS_EXP_ZERO_PAD") == "0":  # exp A/B only: the shipped out.zero_()
            out.zero_()
            full = False
        elif not full and out.shape[0] > self._meta.num_tokens:
            out[self._meta.num_tokens:].zero_()
        triton_extend_kernel.extend(q, kc, vc, out, self._meta.page_table, idx[: seqs + 1], idx[seqs + 1:],
                                    seqs, tokens, scale, zero_pad=full)
