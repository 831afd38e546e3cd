"""The `mla` op contract: paged multi-head latent attention in the absorbed form.

Each token's cache entry is one vector [kv_lora_rank + rope_dim]: the normalized latent c_kv followed
by the roped key k_pe. With W_UK absorbed into the query, scores are q_nope . c_kv + q_pe . k_pe; the
output is the attention-weighted latent (W_UV is applied by the model afterwards). Plan/run and the
padded-row rule as for `attention` (see attention/base.py): every row's [c_kv | k_pe] is written at
`meta.slot_mapping[row]`, and padded rows of `out` end finite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pieceworks.backends.base import Backend, contract, not_implemented

if TYPE_CHECKING:
    from pieceworks.core.batch import StepMetadata
    from pieceworks.executor.kv_cache import KVPool


class MLABackend(Backend):
    op = "mla"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        if spec.model.kv_fp8:
            reasons.append("no FP8 KV cache (MLA latents stay in the model dtype; set kv_cache.dtype: model)")
        return reasons

    def plan(self, meta: "StepMetadata") -> None:
        """Prepare for one step on the host; see AttentionBackend.plan."""

    @contract
    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
        scale: float,
        kv: "KVPool",
    ) -> None:
        """Write the new latents into the pool, then attend causally in latent space.

        Args:
            q_nope: [T, H, L] absorbed queries (L = kv_lora_rank).
            q_pe: [T, H, R] roped query part (R = qk_rope_head_dim).
            c_kv: [T, L] new normalized latents; k_pe: [T, R] new roped keys (every row written at
                meta.slot_mapping[row], padded rows too).
            out: [T, H, L] written in place; padded rows must end finite.
            layer_id: index of the layer's latent buffer in `kv` (`kv.latent_cache(layer_id)`:
                [pages, page_size, L + R]).
            scale: softmax scale (includes yarn's mscale correction).
            kv: the KV pool.
        """
        raise not_implemented(self, "forward")
