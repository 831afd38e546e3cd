"""The built-in backends, registered through the same hook as third-party plugins.

One plugin per family, so `plugins.disabled: [pieceworks.flashinfer]` removes a whole family. Backend
modules import their kernel libraries lazily, so listing them here keeps `import pieceworks` light.
"""

from __future__ import annotations

from pieceworks.backends.hookspecs import hookimpl


class TorchBackends:
    """Reference backends in plain torch: lowest priority, available everywhere, safe in every graph."""

    @hookimpl
    def pieceworks_register_backends(self):
        from pieceworks.backends.attention.torch import TorchAttentionBackend
        from pieceworks.backends.fp4_gemm.torch import DequantizedFp4GemmBackend, TorchFp4GemmBackend
        from pieceworks.backends.mla.torch import TorchMLABackend
        from pieceworks.backends.moe.torch import TorchMoEBackend

        return [TorchAttentionBackend, TorchMLABackend, TorchFp4GemmBackend, DequantizedFp4GemmBackend,
                TorchMoEBackend]


class FlashInferBackends:
    """FlashInfer paged attention and MLA (fa2/fa3): Ampere and newer, Hopper included."""

    @hookimpl
    def pieceworks_register_backends(self):
        from pieceworks.backends.attention.flashinfer import FlashInferAttentionBackend
        from pieceworks.backends.mla.flashinfer import FlashInferMLABackend

        return [FlashInferAttentionBackend, FlashInferMLABackend]


class TrtllmMLABackends:
    """TRT-LLM MLA through FlashInfer: Blackwell (sm_100/103), eager and full decode graphs."""

    @hookimpl
    def pieceworks_register_backends(self):
        from pieceworks.backends.mla.trtllm import TrtllmMLABackend

        return [TrtllmMLABackend]


class FlashInferFp4Backends:
    """FlashInfer's NVFP4 kernels (w4a4, Blackwell): mm_fp4 cutlass/cudnn/trtllm, fused MoE cutlass/trtllm."""

    @hookimpl
    def pieceworks_register_backends(self):
        from pieceworks.backends.fp4_gemm.flashinfer import (
            FlashInferCudnnFp4GemmBackend,
            FlashInferCutlassFp4GemmBackend,
            FlashInferTrtllmFp4GemmBackend,
        )
        from pieceworks.backends.moe.flashinfer import FlashInferCutlassMoEBackend, FlashInferTrtllmMoEBackend

        return [FlashInferCutlassFp4GemmBackend, FlashInferCudnnFp4GemmBackend, FlashInferTrtllmFp4GemmBackend,
                FlashInferCutlassMoEBackend, FlashInferTrtllmMoEBackend]


class TritonBackends:
    """pieceworks' own Triton kernels: NVFP4 weight-only GEMM and fused MoE for Hopper (and Ampere+),
    split-KV decode attention."""

    @hookimpl
    def pieceworks_register_backends(self):
        from pieceworks.backends.attention.triton import TritonAttentionBackend, TritonDecodeAttentionBackend
        from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend
        from pieceworks.backends.moe.triton import TritonMoEBackend

        return [TritonFp4GemmBackend, TritonMoEBackend, TritonDecodeAttentionBackend, TritonAttentionBackend]


class CudaBackends:
    """pieceworks' own CUDA kernels, compiled at run time by NVRTC: the NVFP4 weight-only decode GEMM and the
    fused MoE built on it."""

    @hookimpl
    def pieceworks_register_backends(self):
        from pieceworks.backends.fp4_gemm.cuda import CudaFp4GemmBackend
        from pieceworks.backends.moe.cuda import CudaMoEBackend

        return [CudaFp4GemmBackend, CudaMoEBackend]


BUILTIN_PLUGINS: dict[str, object] = {
    "pieceworks.torch": TorchBackends(),
    "pieceworks.flashinfer": FlashInferBackends(),
    "pieceworks.trtllm_mla": TrtllmMLABackends(),
    "pieceworks.flashinfer_fp4": FlashInferFp4Backends(),
    "pieceworks.triton": TritonBackends(),
    "pieceworks.cuda": CudaBackends(),
}
