"""Reference NVFP4 GEMM in plain torch: dequantize the weight, then one matmul.

w4a16: y = x @ dequant(W).T with the weight dequantized to x.dtype (global scale applied in float32
first). w4a4: x is first rounded through NVFP4 activation quantization with the layer's input_scale,
exactly as Blackwell kernels quantize (see quant/nvfp4.quantize_activation).
"""

from __future__ import annotations

from pieceworks.backends import cpu_matmul
from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.fp4_gemm.base import Fp4GemmBackend, Fp4Weight
from pieceworks.quant import nvfp4


class TorchFp4GemmBackend(Fp4GemmBackend):
    name = "torch"
    priority = 0
    graph_modes = ALL_GRAPH_MODES
    numerics = ("w4a16", "w4a4")
    description = "reference: dequantize then matmul"

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        self.numerics_used = self.resolved_numerics(spec)

    def forward(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features):
        w = nvfp4.dequantize(weight, weight_scale, weight_scale_2, dtype=x.dtype)
        if self.numerics_used == "w4a4":
            x = nvfp4.fake_quantize_activation(x, input_scale).to(x.dtype)
        return x @ w.t()


class DequantizedFp4GemmBackend(Fp4GemmBackend):
    """w4a16 on a CPU: the weight dequantized once at load, then a plain matmul per step.

    Same numerics as the reference's w4a16 (the weight dequantized to the activation dtype, global
    scale applied in float32 first); it trades NVFP4's memory saving (weights take bf16/fp32 room)
    for CPU speed, since no CPU kernel reads NVFP4. The dense weight keeps the checkpoint's [N, K] and is
    multiplied through `cpu_matmul.linear`, which picks the form the CPU's BLAS reads fastest for the row
    count (docs/backends.md). CPU only: on GPUs the fused kernels win.
    """

    name = "dequant"
    priority = 1
    graph_modes = ALL_GRAPH_MODES
    numerics = ("w4a16",)
    weight_layout = "dequantized"
    description = "CPU: weights dequantized once at load (w4a16 numerics, float memory)"

    requires = Requirements(devices=("cpu",))

    def prepare(self, w: Fp4Weight) -> Fp4Weight:
        dense = nvfp4.dequantize(w.weight, w.weight_scale, w.weight_scale_2, dtype=self.spec.model.dtype)
        empty = w.weight_scale.new_empty(0)
        return Fp4Weight(dense.contiguous(), empty, w.weight_scale_2, w.input_scale)

    def forward(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features):
        return cpu_matmul.linear(x, weight.to(x.dtype))
