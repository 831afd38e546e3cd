"""The `attention` op contract: paged GQA/MHA attention over the KV pool, writing into `out`.

Plan outside the graph, run inside it: `plan(meta)` is called on the host once per step (and before
every graph replay) with the step's metadata; it fills whatever static buffers `forward` reads.
`forward` must then be free of host syncs in the graph modes the backend declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pieceworks.backends.base import Backend

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

    def plan(self, meta: "StepMetadata") -> None:
        """Prepare for one step, on the host (fills static buffers; may sync). Called before the
        step's forward and before every replay of a graph that contains this backend's forward."""

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
            k: [T, Hkv, D] new keys; v: [T, Hkv, D] new values (written at meta.slot_mapping).
            out: [T, Hq, D] written in place (rows of padded tokens may hold anything).
            layer_id: index of the layer's KV buffers in `kv`.
            scale: softmax scale.
            kv: the KV pool (`kv.k_cache(layer_id)`, `kv.v_cache(layer_id)`: [pages, page_size, Hkv, D]).
        """
        raise NotImplementedError
