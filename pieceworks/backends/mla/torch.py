"""Reference paged MLA (absorbed form) in plain torch, float32 softmax.

Same structure as the reference attention: a host loop for extend/mixed (eager between pieces), a
masked batched form for decode that is capturable in full graphs.
"""

from __future__ import annotations

import torch

from pieceworks.backends.attention.torch import ReferencePlan
from pieceworks.backends.base import ALL_GRAPH_MODES
from pieceworks.backends.mla.base import MLABackend
from pieceworks.core.batch import ForwardMode


def attend_latent(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, scale: float, prefix: int
) -> torch.Tensor:
    """Causal latent attention of n queries over S cached entries, float32.

    Args:
        q_nope: [n, H, L]; q_pe: [n, H, R]; cache: [S, L + R] (latent, then rope key).
    Returns:
        [n, H, L] float32.
    """
    n, _, rank = q_nope.shape
    c = cache.float()
    scores = (torch.einsum("nhl,sl->hns", q_nope.float(), c[:, :rank])
              + torch.einsum("nhr,sr->hns", q_pe.float(), c[:, rank:])) * scale
    q_pos = torch.arange(n, device=q_nope.device).unsqueeze(1) + prefix
    allowed = torch.arange(c.shape[0], device=q_nope.device).unsqueeze(0) <= q_pos
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hns,sl->nhl", probs, c[:, :rank])


class TorchMLABackend(ReferencePlan, MLABackend):
    name = "torch"
    priority = 0
    graph_modes = ALL_GRAPH_MODES
    description = "reference: gathered latent pages, float32 softmax"

    def forward(self, q_nope, q_pe, c_kv, k_pe, out, layer_id, scale, kv) -> None:
        meta = self._meta
        cache = kv.latent_cache(layer_id)
        slots = self._slots(c_kv.shape[0])
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots, torch.cat([c_kv, k_pe], -1).to(cache.dtype))
        if q_nope.shape[0] > self._num_tokens:  # padding rows: keep them finite for the next piece
            out[self._num_tokens :].zero_()
        if meta.mode is ForwardMode.DECODE:
            self._decode(q_nope, q_pe, out, cache, scale)
            return
        for prefix, seq_len, pages, rows in self._seqs:
            entries = cache[pages].flatten(0, 1)[:seq_len]
            out[rows] = attend_latent(q_nope[rows], q_pe[rows], entries, scale, prefix).to(out.dtype)

    def _decode(self, q_nope, q_pe, out, cache, scale) -> None:
        lens = self._seq_lens
        b = lens.shape[0]
        entries = cache[self._meta.page_table[:b]].flatten(1, 2).float()  # [B, S, L + R]
        valid = torch.arange(entries.shape[1], device=cache.device).unsqueeze(0) < lens.unsqueeze(1)
        entries = torch.where(valid[:, :, None], entries, 0.0)  # slots past the length may hold NaN
        rank = q_nope.shape[-1]
        scores = (torch.einsum("bhl,bsl->bhs", q_nope[:b].float(), entries[..., :rank])
                  + torch.einsum("bhr,bsr->bhs", q_pe[:b].float(), entries[..., rank:])) * scale
        probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
        out[:b] = torch.einsum("bhs,bsl->bhl", probs, entries[..., :rank]).to(out.dtype)
