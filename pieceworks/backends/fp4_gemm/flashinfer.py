"""FlashInfer `mm_fp4` (NVFP4 activations x NVFP4 weights, w4a4) as three fp4_gemm backends: `cutlass`,
`cudnn` and `trtllm`, with the compute capabilities FlashInfer declares for each (`mm_fp4`'s
`_cutlass/_cudnn/_trtllm_gemm_fp4_requirement`: sm_100/103/107/110/120/121, and sm_100/103/107 for
trtllm). None runs on Hopper.

`prepare` converts a checkpoint linear once: block scales into the 128x4 tiled layout
(`nvfp4.swizzle_128x4`; for trtllm after FlashInfer's row shuffle, applied to the weight rows too), and
the two scalars into what the kernel consumes, kept in the Fp4Weight slots:
weight_scale_2 <- alpha = input_scale * weight_scale_2 (the output dequant scale), and
input_scale <- 1 / input_scale (FlashInfer's activation global scale).

Activations are quantized per call with `flashinfer.fp4_quantize`, only through
`fp4_quantize_activation`: on sm_90 that kernel returns uninitialised memory without an error, so the
guard refuses any GPU below sm_100 before flashinfer is touched.

Written against FlashInfer 0.7.2's documented API; no Blackwell GPU was available to run it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pieceworks.backends.attention.flashinfer import GPU_INSTALL_HINT
from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.fp4_gemm.base import Fp4GemmBackend, Fp4Weight
from pieceworks.quant import nvfp4

FP4_QUANTIZE_MIN_CAPABILITY = (10, 0)
TRTLLM_EPILOGUE_TILE_M = 128  # the tile FlashInfer's mm_fp4 trtllm weights are shuffled for


def require_fp4_quantize(capability: tuple[int, int] | None) -> None:
    """Raise unless `flashinfer.fp4_quantize` produces data on a GPU of this capability."""
    if capability is None or tuple(capability) < FP4_QUANTIZE_MIN_CAPABILITY:
        cap = "no GPU" if capability is None else ".".join(map(str, capability))
        raise RuntimeError(
            f"flashinfer.fp4_quantize needs compute capability >= 10.0 (this device: {cap}); below "
            "sm_100 it returns uninitialised memory without an error, so pieceworks never calls it there"
        )


def fp4_quantize_activation(x: torch.Tensor, global_scale: torch.Tensor, *, swizzled: bool = True,
                            capability: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4-quantize activations with `flashinfer.fp4_quantize`, refusing GPUs where it is unsafe.

    Every call of `flashinfer.fp4_quantize` in pieceworks goes through here.

    Args:
        x: [M, K] bf16/fp16 activations on a CUDA device.
        global_scale: [1] float32, 1 / input_scale.
        swizzled: block scales in the 128x4 tiled layout (mm_fp4, cutlass MoE) or linear (trtllm MoE).
        capability: the device's compute capability; read from x's device when None (tests pass one).

    Returns:
        (codes uint8 [M, K/2], block scales float8_e4m3fn: [Mp, Kp/16] tiled, or [M, K/16] linear)
    """
    if capability is None:
        capability = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    require_fp4_quantize(capability)
    import flashinfer

    codes, scales = flashinfer.fp4_quantize(x, global_scale, 16, False, is_sf_swizzled_layout=swizzled)
    return codes.view(torch.uint8), scales.view(torch.float8_e4m3fn)


def mm_fp4_alpha(input_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """[1] float32 output dequant scale of mm_fp4: the activations are quantized with 1 / input_scale
    and the weight codes carry 1 / weight_scale_2, so alpha = input_scale * weight_scale_2."""
    return (input_scale.float() * weight_scale_2.float()).reshape(1)


def mm_fp4_layout(w: Fp4Weight, row_perm: torch.Tensor | None = None) -> Fp4Weight:
    """Checkpoint tensors -> what `mm_fp4` reads (see the module docstring); `row_perm` reorders the
    output rows of weight and scales first (the trtllm shuffle)."""
    weight, scale = w.weight, w.weight_scale
    if row_perm is not None:
        perm = row_perm.to(weight.device)
        weight, scale = weight[perm], scale[perm]
    alpha = mm_fp4_alpha(w.input_scale, w.weight_scale_2)
    return Fp4Weight(weight.contiguous(), nvfp4.swizzle_128x4(scale), alpha, (1.0 / w.input_scale.float()).reshape(1))


def trtllm_row_permutation(rows: int) -> torch.Tensor:
    """[rows] int64: the output-row order of FlashInfer's trtllm FP4 weights (`shuffle_matrix_a` with a
    128-row epilogue tile; `shuffle_matrix_sf_a` moves the scale rows the same way)."""
    from flashinfer import shuffle_matrix_a

    return shuffle_matrix_a(torch.arange(rows).unsqueeze(1), TRTLLM_EPILOGUE_TILE_M)[:, 0]


class _MmFp4Backend(Fp4GemmBackend):
    """One `mm_fp4` kernel family; subclasses name it."""

    kernel: ClassVar[str]
    out_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16)
    numerics = ("w4a4",)
    weight_layout = "mm_fp4_128x4"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        if spec.model.dtype not in cls.out_dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in cls.out_dtypes)
            reasons.append(f"mm_fp4 {cls.kernel} writes {names} (model dtype: {spec.model.dtype})")
        return reasons

    def prepare(self, w: Fp4Weight) -> Fp4Weight:
        return mm_fp4_layout(w)

    def forward(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features):
        import flashinfer

        codes, scales = fp4_quantize_activation(x, input_scale)
        return flashinfer.mm_fp4(codes, weight.T, scales, weight_scale.T, weight_scale_2, x.dtype,
                                 backend=self.kernel)


class FlashInferCutlassFp4GemmBackend(_MmFp4Backend):
    name = "cutlass"
    kernel = "cutlass"
    priority = 80
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), capability_majors=(10, 11, 12), modules=("flashinfer",),
                            install_hint=GPU_INSTALL_HINT)
    description = "FlashInfer mm_fp4, CUTLASS kernels (w4a4, Blackwell)"


class FlashInferCudnnFp4GemmBackend(_MmFp4Backend):
    name = "cudnn"
    kernel = "cudnn"
    priority = 70
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), capability_majors=(10, 11, 12), modules=("flashinfer", "cudnn"),
                            install_hint="pip install flashinfer-python nvidia-cudnn-frontend")
    description = "FlashInfer mm_fp4, cuDNN graphs (w4a4, Blackwell)"


class FlashInferTrtllmFp4GemmBackend(_MmFp4Backend):
    name = "trtllm"
    kernel = "trtllm"
    priority = 75
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), capability_majors=(10,), modules=("flashinfer",),
                            install_hint=GPU_INSTALL_HINT)
    out_dtypes = (torch.bfloat16,)
    weight_layout = "mm_fp4_trtllm_shuffled"
    description = "FlashInfer mm_fp4, TRT-LLM kernels on shuffled weights (w4a4, sm_100/103)"

    def prepare(self, w: Fp4Weight) -> Fp4Weight:
        rows = w.weight.shape[0]
        if rows % TRTLLM_EPILOGUE_TILE_M:
            raise ValueError(f"mm_fp4 trtllm shuffles output rows in tiles of {TRTLLM_EPILOGUE_TILE_M}; this "
                             f"linear has {rows}: use backends.fp4_gemm=cutlass or cudnn")
        return mm_fp4_layout(w, trtllm_row_permutation(rows))
