"""Reference paged attention in plain torch: gathered pages, softmax in float32.

Extend and mixed steps loop over sequences on the host (fine: under piecewise graphs attention runs
eagerly between pieces). Decode steps use a masked, batched form with no host syncs, so the reference
is also capturable in full decode graphs; it gathers every sequence's pages to the page table's width, in
groups of sequences whose float32 keys and values fit `DECODE_GATHER_BYTES` (a FULL graph's table is as wide as
the longest context: 8 GiB for 256 sequences of Gemma 3 1B at once).
"""

from __future__ import annotations

import torch

from pieceworks.backends.attention.base import AttentionBackend
from pieceworks.backends.base import ALL_GRAPH_MODES
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.kv import KV_FP8, dequantize_kv, store_quantized

DECODE_GATHER_BYTES = 256 << 20  # float32 keys + values a decode step gathers at once


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix: int,
           window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of n new queries over S = prefix + n keys, float32.

    Args:
        q: [n, Hq, D]; k, v: [S, Hkv, D] (Hq a multiple of Hkv).
        window: each query sees itself and the window - 1 keys before it (0: every earlier key).
        softcap: scores become softcap * tanh(scores / softcap) before the mask (0: unchanged).
    Returns:
        [n, Hq, D] float32.
    """
    n, hq, d = q.shape
    s, hkv, _ = k.shape
    qf = q.float().view(n, hkv, hq // hkv, d)
    scores = _capped(torch.einsum("nhgd,shd->hgns", qf, k.float()) * scale, softcap)
    q_pos = torch.arange(n, device=q.device).unsqueeze(1) + prefix
    k_pos = torch.arange(s, device=q.device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if window:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hgns,shd->nhgd", probs, v.float()).reshape(n, hq, v.shape[-1])


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap else scores


class ReferencePlan:
    """plan() of the torch references: keep the step's metadata and, once per step rather than per layer,
    its real-token count and (extend, mixed) its sequences; for decode, the per-sequence lengths (in FULL
    graphs a static buffer per graph batch size, refilled for every replay)."""

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        self._meta = None
        self._static_lens: dict[int, torch.Tensor] = {}
        self._seqs: list[tuple[int, int, torch.Tensor, slice]] = []
        self._num_tokens = 0

    def plan(self, meta) -> None:
        self._meta = meta
        self._num_tokens = meta.num_tokens
        if meta.mode is ForwardMode.DECODE:
            full = meta.graph_mode is GraphMode.FULL
            self._seq_lens = _static_seq_lens(self._static_lens, meta) if full else meta.seq_lens_tensor()
            if full:  # every row of the graph batch is computed, padding sequences' too: no rows to clear, and
                self._num_tokens = meta.graph_batch_size  # one value for every step the graph replays
        else:  # extend and mixed steps (also EagerExtendRunner's stand-in for full extend graphs)
            self._seqs = list(self._sequences(meta))

    @staticmethod
    def _sequences(meta):
        """Per sequence of the step: (cached prefix, KV length, its pages (int64: an int32 index is
        converted by every gather), rows of its new tokens)."""
        indptr = meta.qo_indptr()
        for i, (prefix, seq_len) in enumerate(zip(meta.prefix_lens, meta.seq_lens)):
            pages = meta.page_table[i, : -(-seq_len // meta.page_size)].long()
            yield prefix, seq_len, pages, slice(indptr[i], indptr[i + 1])

    def _slots(self, rows: int) -> torch.Tensor:
        """The step's slot mapping for `rows` new K/V rows."""
        slots = self._meta.slot_mapping
        return slots if slots.shape[0] == rows else slots[:rows]


class TorchAttentionBackend(ReferencePlan, AttentionBackend):
    name = "torch"
    priority = 0
    graph_modes = ALL_GRAPH_MODES
    windows = softcap = fp8_kv = True
    description = ("reference: gathered pages, float32 softmax; serves sliding-window layers, soft-capped scores "
                   "and FP8 KV pools")

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        self._views: dict[int, tuple] = {}

    def forward(self, q, k, v, out, layer_id, scale, kv) -> None:
        views = self._views.get(layer_id)
        if views is None or views[0] is not kv:  # per layer, once: the pool's views never change
            kc, vc = kv.k_cache(layer_id), kv.v_cache(layer_id)
            views = self._views[layer_id] = (kv, kc, vc, kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:]))
        _, kc, vc, k_rows, v_rows = views
        slots = self._slots(k.shape[0])
        ks, vs = kv.k_scale(layer_id), kv.v_scale(layer_id)
        if kc.dtype == KV_FP8:
            store_quantized(k_rows, slots, k, ks)
            store_quantized(v_rows, slots, v, vs)
        else:
            k_rows.index_copy_(0, slots, k.to(kc.dtype))
            v_rows.index_copy_(0, slots, v.to(vc.dtype))
        if q.shape[0] > self._num_tokens:  # padding rows: keep them finite for the next piece
            out[self._num_tokens :].zero_()
        window, cap = self.window(layer_id), self.spec.model.attn_logit_softcap
        if self._meta.mode is ForwardMode.DECODE:
            self._decode(q, out, kc, vc, scale, window, cap, (ks, vs))
            return
        for prefix, seq_len, pages, rows in self._seqs:
            keys = dequantize_kv(kc[pages].flatten(0, 1)[:seq_len], ks)
            vals = dequantize_kv(vc[pages].flatten(0, 1)[:seq_len], vs)
            out[rows] = attend(q[rows], keys, vals, scale, prefix, window, cap).to(out.dtype)

    def _decode(self, q, out, kc, vc, scale, window: int = 0, softcap: float = 0.0,
                scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """Batched decode without host syncs: every sequence's pages gathered to the table width, in groups of
        sequences (`DECODE_GATHER_BYTES`)."""
        b = self._seq_lens.shape[0]
        per_sequence = self._meta.page_table.shape[1] * kc.shape[1] * kc.shape[2] * kc.shape[3] * 4 * 2
        group = max(1, DECODE_GATHER_BYTES // per_sequence)
        for lo in range(0, b, group):
            self._decode_group(q, out, kc, vc, scale, window, softcap, scales, lo, min(b, lo + group))

    def _decode_group(self, q, out, kc, vc, scale, window, softcap, scales, lo: int, hi: int) -> None:
        """`_decode` of sequences lo..hi - 1."""
        lens = self._seq_lens[lo:hi]
        b = hi - lo
        table = self._meta.page_table[lo:hi]
        keys = kc[table].flatten(1, 2)  # [B, P*ps, Hkv, D]
        vals = vc[table].flatten(1, 2)
        _, s, hkv, d = keys.shape
        hq = q.shape[1]
        k_pos = torch.arange(s, device=q.device).unsqueeze(0)
        valid = k_pos < lens.unsqueeze(1)
        if window:  # the query sits at lens - 1
            valid &= k_pos >= lens.unsqueeze(1) - window
        # Slots past a sequence's length (other pages, the reserved page) may hold anything, NaN
        # included: zero them, since a masked score times a NaN value is still NaN.
        keep = valid[:, :, None, None]
        keys = torch.where(keep, dequantize_kv(keys, scales[0]), 0.0)
        vals = torch.where(keep, dequantize_kv(vals, scales[1]), 0.0)
        qf = q[lo:hi].float().view(b, hkv, hq // hkv, d)
        scores = _capped(torch.einsum("bhgd,bshd->bhgs", qf, keys) * scale, softcap)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1)
        res = torch.einsum("bhgs,bshd->bhgd", probs, vals)
        out[lo:hi] = res.reshape(b, hq, vals.shape[-1]).to(out.dtype)


def _static_seq_lens(cache: dict[int, torch.Tensor], meta) -> torch.Tensor:
    """The per-graph-size sequence-length buffer, filled for this replay (padding rows: length 1)."""
    bs = meta.graph_batch_size or meta.num_seqs
    buf = cache.get(bs)
    if buf is None:
        buf = cache[bs] = torch.ones(bs, dtype=torch.int32, device=meta.device)
    lens = torch.ones(bs, dtype=torch.int32)
    lens[: meta.num_seqs] = torch.tensor(meta.seq_lens, dtype=torch.int32)
    buf.copy_(lens, non_blocking=False)
    return buf
