"""Rotary position embeddings as transformers computes them: default, linear, llama3, yarn (with DeepSeek's
mscale / mscale_all_dim) and longrope (Phi-3's: its short factors, for sequences within the original context,
which caps the model's: `hf_config.context_cap`), in the rotate-half (Llama) and interleaved (DeepSeek) layouts.

cos/sin are precomputed for every position a sequence can reach (max_position_embeddings, or the
executor's model.max_context where it is set: `RotaryEmbedding.limit`) and gathered by position in
forward, so a step does no trigonometry and the graph has only an index op. Only those positions are
ever allocated, so a checkpoint may declare any number of them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pieceworks.backends import fused


def rope_parameters(hf: dict) -> dict:
    """The rope settings of a config.json, in transformers 5's `rope_parameters` form.

    Accepts transformers 5 (`rope_parameters` holding rope_theta) and older configs (`rope_scaling`
    plus a top-level `rope_theta`; `type` as an alias of `rope_type`).
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # agreeing: hf_config checks
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        top = hf.get("original_max_position_embeddings")
        if top is not None:  # the top-level field wins, as in transformers' standardize_rope_params (Phi-3 writes it)
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(params: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] float32 and the cos/sin scaling, as transformers computes them.

    Supports rope_type default, linear, llama3, yarn (with mscale / mscale_all_dim) and longrope (short factors).
    """
    kind, base = params["rope_type"], float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old_len = params["original_max_position_embeddings"]
        factor = params.get("factor") or max_positions / old_len
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention_factor = _yarn_mscale(factor)
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv_freq, float(attention_factor)
    if kind == "longrope":  # the short factors: what transformers applies while a sequence fits the original context
        old_len = params["original_max_position_embeddings"]
        factor = params.get("factor") or max_positions / old_len
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
        inv_freq = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32)
                          * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, float(attention_factor)
    raise ValueError(
        f"rope_type {kind!r} is not supported; pieceworks implements default, linear, llama3, yarn and longrope"
    )


def yarn_softmax_scale(params: dict, head_dim: int) -> float:
    """head_dim**-0.5, times mscale**2 for yarn with mscale_all_dim (DeepSeek-V3's attention scale)."""
    scale = head_dim**-0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables [positions, dim/2] (float32), gathered by position: no per-step compute.

    `max_positions` is the model's max_position_embeddings (yarn without a factor derives its scale
    from it); the tables cover `positions` positions: all of them, or fewer after `limit`. They are
    non-persistent buffers. Built on the meta device they hold no rows (a checkpoint may declare more
    positions than a tensor can index); `init_buffers()` allocates and computes them after the model
    was materialized.
    """

    def __init__(self, params: dict, dim: int, max_positions: int) -> None:
        super().__init__()
        self.params, self.dim, self.max_positions = params, dim, max_positions
        self.positions = max_positions
        self._tables(0)
        if self.cos.device.type != "meta":
            self.init_buffers()

    def _tables(self, positions: int) -> None:
        dev = self.cos.device if hasattr(self, "cos") else None
        self.register_buffer("cos", torch.empty(positions, self.dim // 2, dtype=torch.float32, device=dev),
                             persistent=False)
        self.register_buffer("sin", torch.empty(positions, self.dim // 2, dtype=torch.float32, device=dev),
                             persistent=False)

    @property
    def table_bytes(self) -> int:
        """Bytes of the cos and sin tables for `positions` positions (allocated or not yet)."""
        return 2 * self.positions * (self.dim // 2) * 4

    def limit(self, positions: int) -> None:
        """Cover only the first `positions` positions (the longest sequence the executor accepts): a
        checkpoint may declare far more than a pool can hold. The values stay those of the full table."""
        if 0 < positions < self.positions:
            self.positions = positions
            if self.cos.device.type != "meta":
                self.init_buffers()

    def init_buffers(self) -> None:
        """Allocate the tables for `positions` positions on the buffers' device and compute them."""
        self._tables(self.positions)
        inv_freq, attention_factor = rope_frequencies(self.params, self.dim, self.max_positions)
        inv_freq = inv_freq.to(self.cos.device)
        freqs = torch.arange(self.positions, device=self.cos.device).float()[:, None] * inv_freq
        self.cos.copy_(freqs.cos() * attention_factor)
        self.sin.copy_(freqs.sin() * attention_factor)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, dim/2] float32."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (Llama): x [T, heads, D], cos/sin [T, D/2] -> [T, heads, D] in x.dtype."""
    return fused.rope(x, cos, sin, False)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` (or with `interleaved`, `apply_rope_interleaved`) of queries [T, Hq, D] and keys
    [T, Hk, D] at the same positions (one launch on CUDA)."""
    return fused.rope_qk(q, k, cos, sin, interleaved)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope (pairs (x0, x1), (x2, x3), ...), written out de-interleaved like
    transformers' `apply_rotary_pos_emb_interleave` (q and k agree, so dot products are unchanged).
    x [T, heads, D], cos/sin [T, D/2] -> [T, heads, D]."""
    return fused.rope(x, cos, sin, True)
