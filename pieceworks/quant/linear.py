"""Fp4Linear: an NVFP4 linear layer whose forward is the `pieceworks::fp4_gemm` custom op (called without
the dispatcher in eager code, as the models' other ops: core/direct.py).

It holds the packed weight, block scales, global scale and input scale as buffers. After loading,
`prepare(backend)` converts them once into the layout of the fp4_gemm backend the kernel table chose
(most backends keep the checkpoint layout).
"""

from __future__ import annotations

import torch
from torch import nn

from pieceworks.backends.fp4_gemm.base import Fp4GemmBackend, Fp4Weight
from pieceworks.core.direct import backend_method, direct
from pieceworks.quant import nvfp4


def _fp4_op(name: str, method: str):
    """`torch.ops.pieceworks.<name>` under Dynamo; in eager code the fp4_gemm backend's `method`, which is
    what the op (registered in backends/ops.py) runs, called without the dispatcher (core/direct.py)."""
    return direct(lambda *args: getattr(torch.ops.pieceworks, name)(*args), backend_method("fp4_gemm", method))


_GEMM = _fp4_op("fp4_gemm", "forward")
_GEMM_SWIGLU = _fp4_op("fp4_gemm_swiglu", "forward_swiglu")
_GEMM_QKV_ROPE = _fp4_op("fp4_gemm_qkv_rope", "forward_qkv_rope")
_GEMM_ADD = _fp4_op("fp4_gemm_add", "forward_add")
_GEMM_ADD_NORM = _fp4_op("fp4_gemm_add_norm", "forward_add_norm")
_GEMM_NORM_SWIGLU = _fp4_op("fp4_gemm_norm_swiglu", "forward_norm_swiglu")
_GEMM_NORM_QKV_ROPE = _fp4_op("fp4_gemm_norm_qkv_rope", "forward_norm_qkv_rope")


class Fp4Linear(nn.Module):
    """y = x @ dequant(W).T for an NVFP4 weight W [out_features, in_features] (no bias).

    Buffers (checkpoint layout until `prepare`): weight uint8 [N, K/2]; weight_scale float8_e4m3fn
    [N, K/16]; weight_scale_2 float32 []; input_scale float32 [].

    `gate_up`: the layer is a SwiGLU MLP's fused gate/up projection (rows [gate; up]), set by its
    `GatedMLP` before `prepare`; it is then prepared with the backend's `prepare_gate_up` and run with
    `forward_swiglu` (the `pieceworks::fp4_gemm_swiglu` op), whose backend may fuse the SiLU-and-multiply.

    `qkv_heads`: (num_heads, num_kv_heads, head_dim) of an attention's fused q/k/v projection (rows
    [q; k; v]), set by its attention module before `prepare`. Where the backend fuses the rope into the
    GEMM for these heads (`fuses_qkv_rope`, `qkv_rope_supported`), `prepare` takes its `prepare_qkv_rope`
    and sets `rope_fused`: the layer then runs as `forward_qkv_rope` (the `pieceworks::fp4_gemm_qkv_rope`
    op) only.

    `fuses_norm`: the backend it was prepared for fuses RMSNorms and residual adds into its GEMMs
    (`Fp4GemmBackend.fuses_norm`); a decoder block whose projections all have it runs them as
    `forward_norm_qkv_rope`, `forward_add_norm` / `forward_add` and `forward_norm_swiglu` on the residual
    stream.
    """

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        if in_features % nvfp4.BLOCK:
            raise ValueError(
                f"Fp4Linear: in_features={in_features} is not a multiple of {nvfp4.BLOCK}; NVFP4 "
                "quantizes blocks of 16 along K (exclude this layer from quantization)"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.layout = "linear"
        self.gate_up = False
        self.qkv_heads: tuple[int, int, int] | None = None
        self.rope_fused = False
        self.fuses_norm = False
        self.prepared = False
        blocks = in_features // nvfp4.BLOCK
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, blocks, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))

    def load(self, w: Fp4Weight) -> None:
        """Take checkpoint tensors (validated by the reader) for this layer."""
        expect = {
            "weight": (torch.uint8, (self.out_features, self.in_features // 2)),
            "weight_scale": (torch.float8_e4m3fn, (self.out_features, self.in_features // nvfp4.BLOCK)),
            "weight_scale_2": (torch.float32, ()),
            "input_scale": (torch.float32, ()),
        }
        for name, (dtype, shape) in expect.items():
            t = getattr(w, name)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(
                    f"Fp4Linear.{name}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}"
                )
            getattr(self, name).data = t.to(getattr(self, name).device)
        self.layout, self.prepared, self.rope_fused = "linear", False, False  # checkpoint layout again
        self.fuses_norm = False

    @classmethod
    def from_float(cls, weight: torch.Tensor, input_amax: float | None = None) -> "Fp4Linear":
        """Quantize a float weight [N, K] as ModelOpt does (input_scale from `input_amax`, or 1/(6*448)
        of the weight's own amax when None: only meaningful for w4a16)."""
        layer = cls(weight.shape[1], weight.shape[0], device=weight.device)
        packed, scale, scale_2 = nvfp4.quantize_weight(weight)
        amax = float(weight.abs().amax()) if input_amax is None else input_amax
        in_scale = torch.tensor(amax / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX), dtype=torch.float32)
        layer.load(Fp4Weight(packed, scale, scale_2.float(), in_scale.to(weight.device)))
        return layer

    def fp4_weight(self) -> Fp4Weight:
        return Fp4Weight(self.weight, self.weight_scale, self.weight_scale_2, self.input_scale)

    def prepare(self, backend: Fp4GemmBackend) -> None:
        """Convert the buffers into `backend`'s weight layout (once, after loading)."""
        if self.prepared:
            if self.layout != backend.weight_layout:
                raise RuntimeError(f"Fp4Linear already prepared for layout {self.layout!r}")
            return
        w = self.fp4_weight()
        rope = (self.qkv_heads is not None and backend.fuses_qkv_rope
                and backend.qkv_rope_supported(*self.qkv_heads))
        if self.gate_up:
            w = backend.prepare_gate_up(w)
        elif rope:
            if self.out_features != (self.qkv_heads[0] + 2 * self.qkv_heads[1]) * self.qkv_heads[2]:
                raise ValueError(f"Fp4Linear: qkv_heads {self.qkv_heads} do not give {self.out_features} rows")
            w = backend.prepare_qkv_rope(w, *self.qkv_heads)
        else:
            w = backend.prepare(w)
        for name, t in zip(Fp4Weight._fields, w):
            self._buffers[name] = t
        self.layout = backend.weight_layout
        self.prepared, self.rope_fused = True, rope
        self.fuses_norm = bool(backend.fuses_norm)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] float weight (checkpoint layout only)."""
        if self.layout != "linear":
            raise RuntimeError("dequantized() needs the checkpoint layout (call before prepare)")
        return nvfp4.dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up and self.prepared:
            raise RuntimeError("Fp4Linear: this gate/up projection was prepared for the fused SwiGLU "
                               "(its backend may reorder the rows); call forward_swiglu")
        if self.rope_fused:
            raise RuntimeError("Fp4Linear: this q/k/v projection was prepared for the fused rope (its "
                               "backend reorders the rows); call forward_qkv_rope")
        lead = x.shape[:-1]
        y = _GEMM(
            x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.weight_scale_2,
            self.input_scale, self.out_features,
        )
        return y.reshape(*lead, self.out_features)

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x) [..., out_features / 2] for a `gate_up` layer."""
        if not self.gate_up:
            raise RuntimeError("Fp4Linear.forward_swiglu needs a gate/up projection (gate_up=True)")
        lead = x.shape[:-1]
        y = _GEMM_SWIGLU(
            x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.weight_scale_2,
            self.input_scale, self.out_features // 2,
        )
        return y.reshape(*lead, self.out_features // 2)

    def forward_qkv_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, (Hq + 2 Hkv) * D] = x @ [q; k; v].T with q and k roped, for a `rope_fused` layer; x [T, K],
        cos/sin [T, D/2]."""
        if not self.rope_fused:
            raise RuntimeError("Fp4Linear.forward_qkv_rope needs a q/k/v projection prepared with "
                               "qkv_heads set by a backend that fuses the rope (rope_fused)")
        return _GEMM_QKV_ROPE(
            x, self.weight, self.weight_scale, self.weight_scale_2, self.input_scale, cos, sin, *self.qkv_heads)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x) [T, out_features] (the `pieceworks::fp4_gemm_add` op); x [T, K]."""
        if self.gate_up or self.rope_fused:
            raise RuntimeError("Fp4Linear.forward_add needs a plain projection (not a gate/up or roped q/k/v one)")
        return _GEMM_ADD(
            x, self.weight, self.weight_scale, self.weight_scale_2, self.input_scale, self.out_features, residual)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                         norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(s = residual + self(x), t, partials): s and the inputs of the RMSNorm with `norm_weight` after it
        (the `pieceworks::fp4_gemm_add_norm` op; `fp4_gemm.base.norm_inputs`)."""
        if self.gate_up or self.rope_fused:
            raise RuntimeError("Fp4Linear.forward_add_norm needs a plain projection (not a gate/up or roped q/k/v "
                               "one)")
        return _GEMM_ADD_NORM(
            x, self.weight, self.weight_scale, self.weight_scale_2, self.input_scale, self.out_features, residual,
            norm_weight)

    def forward_norm_swiglu(self, s: torch.Tensor, t: torch.Tensor, partials: torch.Tensor,
                            norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`forward_swiglu` of rms_norm(s, norm_weight, eps), given `forward_add_norm`'s t and partials (the
        `pieceworks::fp4_gemm_norm_swiglu` op)."""
        if not self.gate_up:
            raise RuntimeError("Fp4Linear.forward_norm_swiglu needs a gate/up projection (gate_up=True)")
        return _GEMM_NORM_SWIGLU(
            s, t, partials, norm_weight, eps, self.weight, self.weight_scale, self.weight_scale_2, self.input_scale,
            self.out_features // 2)

    def forward_norm_qkv_rope(self, s: torch.Tensor, t: torch.Tensor, partials: torch.Tensor,
                              norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                              sin: torch.Tensor) -> torch.Tensor:
        """`forward_qkv_rope` of rms_norm(s, norm_weight, eps), as `forward_norm_swiglu` (the
        `pieceworks::fp4_gemm_norm_qkv_rope` op)."""
        if not self.rope_fused:
            raise RuntimeError("Fp4Linear.forward_norm_qkv_rope needs a q/k/v projection prepared with "
                               "qkv_heads set by a backend that fuses the rope (rope_fused)")
        return _GEMM_NORM_QKV_ROPE(
            s, t, partials, norm_weight, eps, self.weight, self.weight_scale, self.weight_scale_2, self.input_scale,
            cos, sin, *self.qkv_heads)

    def extra_repr(self) -> str:
        gate_up = ", gate_up" if self.gate_up else ""
        rope = ", rope_fused" if self.rope_fused else ""
        norm = ", fuses_norm" if self.fuses_norm else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, layout={self.layout}"
                f"{gate_up}{rope}{norm}")
