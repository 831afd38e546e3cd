"""The per-token shape of a model's KV cache, which a model declares and the executor's pool is built
from (here, below both, so models need not import the executor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Per-token KV shape: GQA (num_kv_heads, head_dim) for K and V, or MLA (latent_dim,) once."""

    kind: str  # "gqa" or "mla"
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0  # kv_lora_rank + qk_rope_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * self.num_kv_heads * self.head_dim if self.kind == "gqa" else self.latent_dim
        return per_layer * self.num_layers * size


KV_FP8 = torch.float8_e4m3fn
"""The dtype of an FP8 KV cache (`kv_cache.dtype: fp8`; ModelOpt's `kv_cache_quant_algo: FP8`)."""
FP8_MAX = 448.0  # the largest finite e4m3 value: quantized K/V saturate there


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """`x` / `scale` as e4m3, saturated at +-448: what an FP8 pool stores for K or V of a layer whose scale is
    `scale` (ModelOpt's k_scale / v_scale: the calibrated amax / 448). Multiplied by the float32 reciprocal, as
    the Triton write kernel does (`kv_write_kernel`), so both store the same bits (the suite checks it on a GPU)."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(KV_FP8)


def store_quantized(rows: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """rows[slots[t]] = quantize_kv(x[t], scale) for an e4m3 pool view `rows` [S, ...] (its bytes copied:
    index_copy_ has no float8 kernel on the CPU)."""
    rows.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, scale).view(torch.uint8))


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of K or V rows read from a pool: e4m3 times the layer's scale (other dtypes as stored)."""
    return x.float() * scale if x.dtype == KV_FP8 else x.float()
