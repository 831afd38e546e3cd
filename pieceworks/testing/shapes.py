"""The op shapes of the attention and mla contract runs (`contract.PoolRun`): each makes a step's random
inputs, calls the backend's forward, reads and writes its cache rows in a pool, and computes the float64
dense reference (`GqaShape` for attention, `MlaShape` for mla)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pieceworks.backends.base import ModelFacts
from pieceworks.core.kv import quantize_kv
from pieceworks.executor.kv_cache import KVLayout, KVPool
from pieceworks.testing.scenarios import reference_attention


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@dataclass(frozen=True)
class GqaShape:
    """Paged GQA/MHA attention: Hq query heads over Hkv KV heads of size D."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    op = "attention"

    def __str__(self) -> str:
        return f"Hq={self.num_heads} Hkv={self.num_kv_heads} D={self.head_dim}"

    def facts(self, dtype: torch.dtype, page_size: int) -> ModelFacts:
        return ModelFacts(dtype=dtype, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                          head_dim=self.head_dim, page_size=page_size)

    def layout(self, num_layers: int) -> KVLayout:
        return KVLayout("gqa", num_layers, self.num_kv_heads, self.head_dim)

    def default_scale(self) -> float:
        return self.head_dim**-0.5

    def inputs(self, n: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
        """Random q/k/v of n tokens (in `dtype`) and their cache entries [n, 2 Hkv D]."""
        q = torch.randn(n, self.num_heads, self.head_dim, generator=gen).to(dtype)
        k = torch.randn(n, self.num_kv_heads, self.head_dim, generator=gen).to(dtype)
        v = torch.randn(n, self.num_kv_heads, self.head_dim, generator=gen).to(dtype)
        return {"q": q, "k": k, "v": v}, torch.cat([k.flatten(1), v.flatten(1)], 1)

    def out_shape(self, n: int) -> tuple[int, ...]:
        return (n, self.num_heads, self.head_dim)

    def width(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def pool_rows(self, pool: KVPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), 2 Hkv D]: the cache entries of one layer at `slots`, on the host."""
        kc, vc = pool.k_cache(layer), pool.v_cache(layer)
        k = kc.reshape(-1, kc.shape[2] * kc.shape[3])[slots]
        return torch.cat([k, vc.reshape(-1, vc.shape[2] * vc.shape[3])[slots]], 1).cpu()

    def write(self, pool: KVPool, layer: int, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """Entries [n, 2 Hkv D] at `slots` of one layer (an FP8 pool's quantized with the layer's scales)."""
        width = self.num_kv_heads * self.head_dim
        kc, vc = pool.k_cache(layer), pool.v_cache(layer)
        k, v = entries[:, :width], entries[:, width:]
        if pool.fp8:
            k, v = quantize_kv(k, pool.k_scale(layer)), quantize_kv(v, pool.v_scale(layer))
        kc.view(-1, width)[slots] = k.to(pool.device)
        vc.view(-1, width)[slots] = v.to(pool.device)

    def call(self, impl, x: dict, out: torch.Tensor, layer: int, scale: float, pool: KVPool) -> None:
        impl.forward(x["q"], x["k"], x["v"], out, layer, scale, pool)

    def reference(self, x: dict, rows: slice, entries: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
        """float64 causal attention of the new tokens `rows` over `entries` [prefix + n, 2 Hkv D]."""
        s, hkv, d = entries.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        keys = entries[:, : hkv * d].view(s, hkv, d).repeat_interleave(group, 1)
        vals = entries[:, hkv * d :].view(s, hkv, d).repeat_interleave(group, 1)
        return reference_attention(x["q"][rows].double(), keys, vals, prefix, scale)


@dataclass(frozen=True)
class MlaShape:
    """Absorbed MLA: H heads over a latent of L (kv_lora_rank) plus a rope key of R."""

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    op = "mla"

    def __str__(self) -> str:
        return f"H={self.num_heads} L={self.kv_lora_rank} R={self.rope_dim}"

    def facts(self, dtype: torch.dtype, page_size: int) -> ModelFacts:
        return ModelFacts(arch="deepseek_v3", dtype=dtype, num_heads=self.num_heads, num_kv_heads=1,
                          kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.rope_dim, page_size=page_size)

    def layout(self, num_layers: int) -> KVLayout:
        return KVLayout("mla", num_layers, latent_dim=self.kv_lora_rank + self.rope_dim)

    def default_scale(self) -> float:
        return (self.kv_lora_rank // 4 + self.rope_dim) ** -0.5

    def inputs(self, n: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
        r = lambda *s: (torch.randn(*s, generator=gen) * 0.5).to(dtype)  # noqa: E731
        h, l, rd = self.num_heads, self.kv_lora_rank, self.rope_dim
        x = {"q_nope": r(n, h, l), "q_pe": r(n, h, rd), "c_kv": r(n, l), "k_pe": r(n, rd)}
        return x, torch.cat([x["c_kv"], x["k_pe"]], 1)

    def out_shape(self, n: int) -> tuple[int, ...]:
        return (n, self.num_heads, self.kv_lora_rank)

    def width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def pool_rows(self, pool: KVPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
        c = pool.latent_cache(layer)
        return c.reshape(-1, c.shape[-1])[slots].cpu()

    def write(self, pool: KVPool, layer: int, slots: torch.Tensor, entries: torch.Tensor) -> None:
        c = pool.latent_cache(layer)
        c.view(-1, c.shape[-1])[slots] = entries.to(pool.device)

    def call(self, impl, x: dict, out: torch.Tensor, layer: int, scale: float, pool: KVPool) -> None:
        impl.forward(x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], out, layer, scale, pool)

    def reference(self, x: dict, rows: slice, entries: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
        q = torch.cat([x["q_nope"][rows], x["q_pe"][rows]], -1).double()
        ent = entries[:, None].expand(-1, self.num_heads, -1)  # one latent per token, shared by every head
        return reference_attention(q, ent, ent[..., : self.kv_lora_rank], prefix, scale)
