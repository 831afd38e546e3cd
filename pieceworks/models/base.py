"""The model contract the executor relies on, and the layers Llama and DeepSeek-V3 share.

A model is a `CausalLM`: `forward(input_ids [T], positions [T]) -> hidden [T, H]` over the flat token
layout of one step (every per-step fact, the KV cache included, comes from the forward context through
the attention ops). Model code calls kernels only through `torch.ops.pieceworks.*`, keeps per-layer
Python state to ints, and has no per-layer branches, so Dynamo traces it with `fullgraph=True` and
identical layers give identical pieces.

Shape legend: T tokens in the step, H hidden size, V vocabulary, D head size.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

import pieceworks.backends.ops  # noqa: F401  (registers the torch.ops.pieceworks.* the models call)
from pieceworks.backends.base import ModelFacts
from pieceworks.executor.kv_cache import KVLayout
from pieceworks.quant.linear import Fp4Linear
from pieceworks.quant.nvfp4 import BLOCK


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalized in float32 (as transformers' Llama/DeepSeek RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def linear(in_features: int, out_features: int, fp4: bool) -> nn.Module:
    """A bias-free projection: `Fp4Linear` (NVFP4 weights, the fp4_gemm op) or `nn.Linear` (also where
    in_features is not a multiple of the NVFP4 block, which no NVFP4 export quantizes)."""
    if fp4 and in_features % BLOCK == 0:
        return Fp4Linear(in_features, out_features)
    return nn.Linear(in_features, out_features, bias=False)


class MergedProj(nn.Module):
    """Several projections of one input computed by one linear: x [T, K] -> parts [T, N_i]."""

    def __init__(self, in_features: int, sizes: list[int], fp4: bool) -> None:
        super().__init__()
        self.sizes = list(sizes)
        self.proj = linear(in_features, sum(sizes), fp4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj(x).split(self.sizes, dim=-1)


class SplitProj(nn.Module):
    """The same contract as MergedProj with one linear per part: used where NVFP4 parts can't be
    fused exactly (different global scales) or are stored in different formats."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p(x) for p in self.parts)


def merged(in_features: int, sizes: list[int], fp4: list[bool]) -> nn.Module:
    """MergedProj when every part has the same format, else SplitProj."""
    if len(set(fp4)) == 1:
        return MergedProj(in_features, sizes, fp4[0])
    return SplitProj([linear(in_features, n, f) for n, f in zip(sizes, fp4)])


class GatedMLP(nn.Module):
    """SwiGLU MLP, gate and up fused: x [T, H] -> down(silu(gate(x)) * up(x)) [T, H]."""

    def __init__(self, hidden: int, intermediate: int, prefix: str, fp4: Callable[[str], bool]) -> None:
        super().__init__()
        self.gate_up_proj = merged(hidden, [intermediate, intermediate],
                                   [fp4(f"{prefix}.gate_proj"), fp4(f"{prefix}.up_proj")])
        self.down_proj = linear(intermediate, hidden, fp4(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)

    def load(self, src: "WeightSource", prefix: str) -> None:
        self.gate_up_proj = src.merged(self.gate_up_proj, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = src.linear(self.down_proj, f"{prefix}.down_proj")


# --- Rotary embeddings ----------------------------------------------------------------------------


def rope_parameters(hf: dict) -> dict:
    """The rope settings of a config.json, in transformers 5's `rope_parameters` form.

    Accepts transformers 5 (`rope_parameters` holding rope_theta) and older configs (`rope_scaling`
    plus a top-level `rope_theta`; `type` as an alias of `rope_type`).
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          hf.get("original_max_position_embeddings", hf["max_position_embeddings"]))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(params: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] float32 and the cos/sin scaling, as transformers computes them.

    Supports rope_type default, linear, llama3 and yarn (with mscale / mscale_all_dim).
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
    raise ValueError(
        f"rope_type {kind!r} is not supported; pieceworks implements default, linear, llama3 and yarn"
    )


def yarn_softmax_scale(params: dict, head_dim: int) -> float:
    """head_dim**-0.5, times mscale**2 for yarn with mscale_all_dim (DeepSeek-V3's attention scale)."""
    scale = head_dim**-0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, dim/2] (float32), gathered by position: no per-step compute.

    The tables are non-persistent buffers; `init_buffers()` (re)computes them after the model was
    materialized from the meta device.
    """

    def __init__(self, params: dict, dim: int, max_positions: int) -> None:
        super().__init__()
        self.params, self.dim, self.max_positions = params, dim, max_positions
        self.register_buffer("cos", torch.empty(max_positions, dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, dim // 2, dtype=torch.float32), persistent=False)
        if self.cos.device.type != "meta":
            self.init_buffers()

    def init_buffers(self) -> None:
        inv_freq, attention_factor = rope_frequencies(self.params, self.dim, self.max_positions)
        inv_freq = inv_freq.to(self.cos.device)
        freqs = torch.arange(self.max_positions, device=self.cos.device).float()[:, None] * inv_freq
        self.cos.copy_(freqs.cos() * attention_factor)
        self.sin.copy_(freqs.sin() * attention_factor)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, dim/2] float32."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope (Llama): x [T, heads, D], cos/sin [T, D/2] -> [T, heads, D] in x.dtype."""
    c, s = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope (pairs (x0, x1), (x2, x3), ...), written out de-interleaved like
    transformers' `apply_rotary_pos_emb_interleave` (q and k agree, so dot products are unchanged).
    x [T, heads, D], cos/sin [T, D/2] -> [T, heads, D]."""
    c, s = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# --- Loading --------------------------------------------------------------------------------------


class WeightSource(Protocol):
    """Where the models' `load` methods get their tensors (a checkpoint, or random weights); names
    are Hugging Face tensor names. Implemented in `pieceworks.models.weights`."""

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A float tensor on the target device, cast to `dtype` (default: the model dtype)."""

    def has(self, name: str) -> bool:
        """Whether the source holds `name` (random sources hold everything)."""

    def dense(self, prefix: str, in_features: int, out_features: int,
              dtype: torch.dtype | None = None) -> torch.Tensor:
        """`{prefix}.weight` [out, in] as a float tensor in `dtype` (default: the model dtype),
        dequantized if the checkpoint stores it as NVFP4."""

    def linear(self, module: nn.Module, prefix: str) -> nn.Module:
        """Fill an nn.Linear or Fp4Linear from `{prefix}.*`; returns it."""

    def merged(self, module: nn.Module, prefixes: list[str]) -> nn.Module:
        """Fill a MergedProj/SplitProj from several linears; returns it, or a SplitProj that replaces
        it where NVFP4 parts can't be fused exactly."""

    def experts(self, module: nn.Module, prefix: str) -> None:
        """Fill an `Experts` module from `{prefix}.{e}.{gate,up,down}_proj.*`."""


class CausalLM(nn.Module):
    """A decoder-only LM over the flat token layout of one step.

    Subclasses build `embed_tokens`, `layers`, `norm`, `lm_head` (nn.Linear, or the embedding when
    tied) and `rotary`; every layer is called as `layer(h, cos, sin)`.

    Attributes:
        vocab_size, max_position_embeddings: from the HF config.
        dtype: activation dtype.
        hf_config: the config.json dict the model was built from.
    """

    arch: str = ""
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    hf_config: dict[str, Any]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H] (final norm applied).

        Runs inside a forward context (the attention ops read the step's metadata and KV pool there).
        """
        cos, sin = self.rotary(positions)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, V] float32. Plain torch: callable outside a forward context."""
        return F.linear(hidden, self.lm_head.weight).float()

    def kv_layout(self) -> KVLayout:
        """Per-token KV shape for the pool: GQA heads or the MLA latent."""
        raise NotImplementedError

    def facts(self, page_size: int) -> ModelFacts:
        """What backends may know about the model (for selection and checks)."""
        raise NotImplementedError

    def required_ops(self) -> set[str]:
        """The `pieceworks` ops forward calls (the kernel table is resolved for these only)."""
        raise NotImplementedError

    def load_plan(self) -> list[tuple[str, nn.Module, Callable[[WeightSource], None]]]:
        """(label, module, fill) in load order: the loader materializes `module` from the meta device,
        then calls `fill(source)`. Together they cover every parameter and buffer."""
        hidden = self.norm.weight.shape[0]

        # Parameters are looked up when filled: to_empty replaces the meta ones.
        def fill(module: nn.Module, name: str, src: WeightSource) -> None:
            module.weight.copy_(src.tensor(name, tuple(module.weight.shape)))

        def head(src: WeightSource) -> None:
            self.lm_head.weight.copy_(src.dense("lm_head", hidden, self.vocab_size))

        plan = [("embed_tokens", self.embed_tokens, partial(fill, self.embed_tokens, "model.embed_tokens.weight"))]
        for i, layer in enumerate(self.layers):
            plan.append((f"layer {i}", layer, partial(layer.load, prefix=f"model.layers.{i}")))
        plan.append(("norm", self.norm, partial(fill, self.norm, "model.norm.weight")))
        if self.lm_head is not self.embed_tokens:
            plan.append(("lm_head", self.lm_head, head))
        plan.append(("rotary", self.rotary, lambda src: self.rotary.init_buffers()))
        return plan

    def has_fp4(self) -> bool:
        return any(isinstance(m, Fp4Linear) for m in self.modules())

    def prepare(self, table: Any) -> None:
        """Convert every Fp4Linear and expert block to the layouts of the backends `table` chose
        (`KernelTable`); once, after loading. The registry guarantees one layout per op."""
        fp4 = table.instances("fp4_gemm")
        moe = table.instances("moe")
        for name, m in self.named_modules():
            if isinstance(m, Fp4Linear):
                if not fp4:
                    raise ValueError(f"{name} is NVFP4 but the kernel table has no fp4_gemm backend")
                m.prepare(fp4[0])
            elif hasattr(m, "prepare_experts"):  # models.moe.Experts (which imports this module)
                if not moe:
                    raise ValueError(f"{name} holds experts but the kernel table has no moe backend")
                m.prepare_experts(moe[0])
