"""Where the CUDA decode kernel runs and how its grid is shaped, for every caller of `cuda_decode.decode_gemm`
and of the MoE launches (fp4_gemm.cuda, fp4_gemm.triton's decode path, moe.cuda, moe.triton's decode path):
the SM count, why NVRTC or the device can't run the kernel, and `plan`, the warps per CTA that keep the grid
resident. Imports torch only.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pieceworks.backends.nvrtc import unavailable_reason as nvrtc_unavailable_reason


@lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The SM count of a CUDA device (132 elsewhere: the H200 the tables were tuned on)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_reasons(reasons: list[str], used: bool, dtype: torch.dtype) -> list[str]:
    """A CUDA-kernel backend's `check`: `reasons` (the base checks), plus bf16 activations where the model
    uses the backend's op (`used`), plus NVRTC's reason when nothing else stands in the way."""
    if used and dtype != torch.bfloat16:
        reasons.append(f"takes bf16 activations (model dtype: {dtype})")
    if not reasons:
        reason = nvrtc_unavailable_reason()
        if reason:
            reasons.append(reason)
    return reasons


def cuda_decode_reason(x: torch.Tensor) -> str | None:
    """Why the CUDA decode kernel can't take x (the Triton backends' `cuda_decode_max_m` and `cuda_moe_max_t`
    paths), or None."""
    if x.dtype != torch.bfloat16:
        return f"the CUDA decode kernel takes bf16 x, not {x.dtype}"
    return _cuda_decode_device_reason(x.device)


@lru_cache(maxsize=None)
def _cuda_decode_device_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"the CUDA decode kernel runs on CUDA devices, not {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"the CUDA decode kernel needs compute capability >= 9.0 (mul.bf16x2), this GPU has {cap[0]}.{cap[1]}"
    return nvrtc_unavailable_reason()


def plan(n_rows: int, sms: int, warps_per_sm: int = 32) -> tuple[int, int]:
    """(warps per CTA, chunks in flight per lane) for a decode GEMM with n_rows weight rows: the most warps
    per CTA (a power of two, 2 to 16) that keep every CTA of the grid resident at once, counting
    `warps_per_sm` warps per SM (32 for the r16c64 kernel: one token tile fits them at 54-60 registers; two
    are compiled with a register cap where they would not: `cuda_decode.resident_cap`). Measured on the
    H200 (docs/benchmarks.md): this picks the fastest or within 10% of it on the Llama-3.1-8B and
    DeepSeek-V3 expert shapes. The k32 reading's two token tiles count 24 (`K32_TWO_TILE_WARPS_PER_SM`)."""
    ctas = -(-n_rows // 16)
    warps = 16
    while warps > 2 and ctas * warps > sms * warps_per_sm:
        warps //= 2
    return warps, 2


# The k32 reading with two token tiles (M 9..16) compiles to about 82 registers (offline NVRTC 13.0), so an
# SM holds about 23 of its warps without a cap, and a cap of 64 (what 32 warps per SM would need) spills. At
# 24 warps per SM `plan` picks the fastest of 2 / 4 / 8 / 16 warps at M = 16 on all six Llama-3.1-8B and
# DeepSeek-V3 expert shapes on the H200 (docs/benchmarks.md), where 32 picks 16 warps for o, down and the
# expert gate_up and 8 for the expert down, 1.5-1.6x slower.
K32_TWO_TILE_WARPS_PER_SM = 24
