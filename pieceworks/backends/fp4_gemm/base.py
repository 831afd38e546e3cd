"""The `fp4_gemm` op contract: y = x @ dequant(W).T for an NVFP4 weight.

A backend may keep weights in its own layout: `prepare` converts the checkpoint tensors once at load
(e.g. 128x4-swizzled scales); `forward` receives what `prepare` returned. All fp4_gemm backends of one
executor must share a `weight_layout` (the registry enforces it), so one copy of the weights serves
every forward mode.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

from pieceworks.backends.base import Backend, contract, not_implemented


class Fp4Weight(NamedTuple):
    """One NVFP4 linear's tensors.

    Checkpoint (linear) layout: weight uint8 [N, K/2]; weight_scale float8_e4m3fn [N, K/16];
    weight_scale_2 float32 scalar; input_scale float32 scalar (used by w4a4 numerics).
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor


class Fp4GemmBackend(Backend):
    op = "fp4_gemm"
    weight_layout: ClassVar[str] = "linear"
    """Name of the layout `prepare` produces; "linear" = as stored in the checkpoint."""

    def prepare(self, w: Fp4Weight) -> Fp4Weight:
        """Convert checkpoint tensors into this backend's layout, once at load (default: as stored)."""
        return w

    def _prepare_rows(self, w: Fp4Weight, rows: torch.Tensor) -> Fp4Weight:
        """`prepare` of the weight with its rows (and their scales) taken in the order `rows`."""
        rows = rows.to(w.weight.device)
        return self.prepare(Fp4Weight(w.weight[rows], w.weight_scale[rows], w.weight_scale_2, w.input_scale))

    def prepare_gate_up(self, w: Fp4Weight) -> Fp4Weight:
        """`prepare` for a SwiGLU MLP's fused gate/up weight (rows [gate; up], one global scale),
        which `forward_swiglu` then serves. Default: `prepare` (rows in checkpoint order)."""
        return self.prepare(w)

    fuses_qkv_rope: ClassVar[bool] = False
    """Whether `forward_qkv_rope` fuses the rope into the GEMM (models then call it instead of the
    GEMM followed by the rope op, with the weight from `prepare_qkv_rope`), for the head shapes
    `qkv_rope_supported` accepts."""

    def qkv_rope_supported(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether `forward_qkv_rope` serves these heads (default: any)."""
        return True

    def prepare_qkv_rope(self, w: Fp4Weight, num_heads: int, num_kv_heads: int, head_dim: int) -> Fp4Weight:
        """`prepare` for an attention's fused q/k/v weight (rows [q; k; v], heads of `head_dim`),
        which `forward_qkv_rope` then serves. Default: `prepare` (rows in checkpoint order)."""
        return self.prepare(w)

    def forward_qkv_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        """x @ [q; k; v].T -> [M, (num_heads + 2 * num_kv_heads) * head_dim] in x.dtype with the q
        and k columns rotated by the rotate-half rope (cos/sin [M, head_dim / 2] of each row's
        position), for a weight from `prepare_qkv_rope`. Default: `forward`, then the `rope_qk` op on
        the q and k columns; a backend that fuses it must round as that does."""
        y = self.forward(x, weight, weight_scale, weight_scale_2, input_scale,
                         (num_heads + 2 * num_kv_heads) * head_dim)
        return rope_qk_columns(y, cos, sin, num_heads, num_kv_heads, head_dim)

    fuses_norm: ClassVar[bool] = False
    """Whether the backend fuses a decoder block's RMSNorms and residual adds into its GEMMs. Models then
    run the block on the residual stream s with `forward_add_norm` (the GEMM before a norm: s + y, and the
    norm's inputs t = s * weight and partial sums of s^2, see `norm_inputs`), `forward_norm_qkv_rope` /
    `forward_norm_swiglu` (the GEMM after it, of RMSNorm(s)) and `forward_add`, where the unfused block
    launches an add+RMSNorm kernel between them. The defaults below run the unfused ops (the same results
    as the unfused block), so a backend of the same layout that does not fuse serves these ops too."""

    def forward_add(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        out_features: int,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """residual + x @ dequant(W).T -> [M, out_features] (the GEMM output rounded to x.dtype, then the
        add, as the residual add of the unfused block rounds); residual [M, out_features]."""
        return residual + self.forward(x, weight, weight_scale, weight_scale_2, input_scale, out_features)

    def forward_add_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        out_features: int,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward_add`'s s and the next RMSNorm's inputs (t, partials) = `norm_inputs(s, norm_weight)`."""
        s = self.forward_add(x, weight, weight_scale, weight_scale_2, input_scale, out_features, residual)
        return (s, *norm_inputs(s, norm_weight))

    def forward_norm_swiglu(
        self,
        s: torch.Tensor,
        t: torch.Tensor,
        partials: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        intermediate: int,
    ) -> torch.Tensor:
        """`forward_swiglu` of RMSNorm(s) (the `rms_norm` op's definition: weight norm_weight [K], eps), with
        (t, partials) = `norm_inputs(s, norm_weight)` from `forward_add_norm`. Default: the rms_norm op, then
        `forward_swiglu` (t and partials unused); a fused version may compute (W @ t) / rms(s) instead,
        within the GEMM's tolerance of it."""
        from pieceworks.backends import fused

        return self.forward_swiglu(fused.rms_norm(s, norm_weight, eps), weight, weight_scale, weight_scale_2,
                                   input_scale, intermediate)

    def forward_norm_qkv_rope(
        self,
        s: torch.Tensor,
        t: torch.Tensor,
        partials: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> torch.Tensor:
        """`forward_qkv_rope` of RMSNorm(s), as `forward_norm_swiglu` (same default and tolerance)."""
        from pieceworks.backends import fused

        return self.forward_qkv_rope(fused.rms_norm(s, norm_weight, eps), weight, weight_scale, weight_scale_2,
                                     input_scale, cos, sin, num_heads, num_kv_heads, head_dim)

    def forward_swiglu(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        intermediate: int,
    ) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) -> [M, intermediate] in x.dtype, for a weight from
        `prepare_gate_up` (2 * intermediate rows). Default: `forward`, then the `silu_mul` op on
        the two halves; a backend that fuses it must round as that does."""
        from pieceworks.backends import fused

        y = self.forward(x, weight, weight_scale, weight_scale_2, input_scale, 2 * intermediate)
        return fused.silu_mul(y[:, :intermediate], y[:, intermediate:])

    @contract
    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        weight_scale_2: torch.Tensor,
        input_scale: torch.Tensor,
        out_features: int,
    ) -> torch.Tensor:
        """Compute x @ dequant(W).T.

        Args:
            x: [M, K] activations (bf16, fp16 or fp32).
            weight, weight_scale, weight_scale_2, input_scale: as `prepare` returned them.
            out_features: N.

        Returns:
            [M, N] in x.dtype.
        """
        raise not_implemented(self, "forward")


def rope_qk_columns(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> torch.Tensor:
    """y [M, (num_heads + 2 * num_kv_heads) * head_dim] (q, k, v columns in checkpoint order) with its q
    and k columns rotated in place by the rope_qk op; returns y."""
    from pieceworks.backends import fused

    q_cols, k_cols = num_heads * head_dim, num_kv_heads * head_dim
    q, k = fused.rope_qk(y[:, :q_cols].view(-1, num_heads, head_dim),
                         y[:, q_cols : q_cols + k_cols].view(-1, num_kv_heads, head_dim), cos, sin, False)
    y[:, :q_cols] = q.view(-1, q_cols)
    y[:, q_cols : q_cols + k_cols] = k.view(-1, k_cols)
    return y


def norm_parts(n: int) -> int:
    """Partial sums of squares per row for a hidden size n: one per 16 columns."""
    return -(-n // 16)


def norm_inputs(s: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a fused RMSNorm after a GEMM takes: t = s * norm_weight (rounded to s.dtype) [M, n] and the
    sums of s^2 over each 16 columns, float32 [M, norm_parts(n)] (their sum: the row's sum of squares)."""
    m, n = s.shape
    t = (s.float() * norm_weight.float()).to(s.dtype)
    sq = torch.nn.functional.pad(s.float().square(), (0, 16 * norm_parts(n) - n))
    return t, sq.view(m, norm_parts(n), 16).sum(-1)

