"""The `attention` op contract: paged GQA/MHA attention over the KV pool, writing into `out`.

Plan outside the graph, run inside it: `plan(meta)` is called on the host once per step (and before
every graph replay) with the step's metadata; it fills whatever static buffers `forward` reads.
`forward` must then be free of host syncs in the graph modes the backend declares.

Padded rows. A step may hand `forward` more rows than `meta.num_tokens`: PIECEWISE steps are padded to a
captured size, FULL decode graphs to their batch size (`meta.graph_batch_size`; each padding sequence has
position 1 and a page-table row of the reserved page). For every row, padded ones included, `forward`
writes the row's K/V at `meta.slot_mapping[row]` (padded rows map to the pool's reserved page, so the
write is harmless and the row count needs no host knowledge), and leaves row `row` of `out` finite: the
real rows hold the attention result, padded rows any finite value (zero is simplest), because the next
piece or the rest of the graph computes on them. The reserved page holds only finite values.
`pieceworks.testing` checks all of this for every graph mode a backend declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pieceworks.backends.base import Backend, contract, not_implemented

if TYPE_CHECKING:
    from pieceworks.core.batch import StepMetadata
    from pieceworks.executor.kv_cache import KVPool


def gqa_kernel_reasons(model, kernels: str) -> list[str]:
    """Reasons a GPU GQA kernel family (`kernels`, e.g. "FlashInfer kernels") can't serve `model`: it
    is built for head_dim 64/128/256, bf16/fp16 activations, and whole query-head groups."""
    reasons = []
    if model.head_dim not in (64, 128, 256):
        reasons.append(f"{kernels} are built for head_dim 64, 128 or 256 (model: {model.head_dim})")
    if model.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"needs bf16 or fp16 activations (model dtype: {model.dtype})")
    if model.num_heads % model.num_kv_heads:
        reasons.append(f"num_heads {model.num_heads} is not a multiple of num_kv_heads {model.num_kv_heads}")
    return reasons


class AttentionBackend(Backend):
    op = "attention"
    windows = False  # serves sliding-window layers (`ModelFacts.sliding_windows`)
    softcap = False  # serves soft-capped scores (`ModelFacts.attn_logit_softcap`)
    fp8_kv = False  # serves an FP8 KV pool (`ModelFacts.kv_fp8`: e4m3 K/V with per-layer scales)

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        if any(spec.model.sliding_windows) and not cls.windows:
            reasons.append("no sliding-window attention (the model has windowed layers)")
        if spec.model.attn_logit_softcap and not cls.softcap:
            reasons.append("no soft-capped attention scores (the model caps them)")
        if spec.model.kv_fp8 and not cls.fp8_kv:
            reasons.append("no FP8 KV cache (kv_cache.dtype resolves to fp8)")
        return reasons

    def window(self, layer_id: int) -> int:
        """The keys a query of layer `layer_id` sees (itself and the W - 1 before it), 0 for all of them."""
        windows = self.spec.model.sliding_windows
        return windows[layer_id] if windows else 0

    def plan(self, meta: "StepMetadata") -> None:
        """Prepare for one step, on the host (fills static buffers; may sync). Called before the
        step's forward and before every replay of a graph that contains this backend's forward."""

    @contract
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
        scale: float,
        kv: "KVPool",
    ) -> None:
        """Write the step's new K/V into the pool, then attend every new token causally over its
        sequence's cached prefix and the new tokens before it.

        Args:
            q: [T, Hq, D] queries (T may exceed meta.num_tokens: rows past it are padding).
            k: [T, Hkv, D] new keys; v: [T, Hkv, D] new values, every row written at
                meta.slot_mapping[row] (padded rows too: they map to the reserved page).
            out: [T, Hq, D] written in place; padded rows must end finite (see the module docstring).
            layer_id: index of the layer's KV buffers in `kv`.
            scale: softmax scale.
            kv: the KV pool (`kv.k_cache(layer_id)`, `kv.v_cache(layer_id)`: [pages, page_size, Hkv, D]); an
                FP8 pool (backends that declare `fp8_kv`) stores `core.kv.quantize_kv(k, kv.k_scale(layer_id))`
                and likewise V, and reads them back times those scales.
        """
        raise not_implemented(self, "forward")
