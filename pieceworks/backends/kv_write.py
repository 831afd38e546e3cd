"""Write a step's new K/V rows into the paged pool: one fused launch on CUDA, `index_copy_` elsewhere.

Every attention/MLA backend stores two row blocks per new token (K and V, or c_kv and k_pe) at the
token's slot. Two `index_copy_` calls cost two kernels of PyTorch's generic indexing path per layer; on
the H200 they make most of the gap between an extend call that uses them and a bare FlashInfer kernel. One
kernel writes both blocks of a token in one program, with 16-byte vector accesses: on sm_90+ with NVRTC
the CUDA kernel of `kv_write_cuda` (launched through the driver without Triton's per-launch argument
handling: piecewise steps 0.02-0.09 ms faster on the H200, docs/benchmarks.md), elsewhere the Triton
kernel of `kv_write_kernel`. Into an FP8 pool the rows are quantized on the way (`scales`, `core.kv.quantize_kv`):
in the Triton kernel on CUDA, by `quantize_kv` and a byte copy elsewhere.

triton is imported on first CUDA use only, so `import pieceworks` never loads it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from pieceworks.backends import kv_write_cuda
from pieceworks.core.kv import KV_FP8, store_quantized


def write_rows(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor,
               slots: torch.Tensor, scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """dst_a[slots[t]] = src_a[t] and dst_b[slots[t]] = src_b[t] for every t < len(slots).

    Args:
        dst_a, dst_b: [S, Wa] / [S, Wb] pool views, one row per slot (may be column slices of a wider row).
        src_a, src_b: [T, Wa] / [T, Wb] the step's new rows, T == len(slots).
        slots: [T] int64 slot of every token (distinct except padded tokens, which all use slot 0).
        scales: (a, b): into float8_e4m3fn views the rows are stored as `quantize_kv(src_a, a)` and
            `quantize_kv(src_b, b)` (the layer's k_scale and v_scale); ignored for other dtypes.
    """
    bind_rows(dst_a, src_a, dst_b, src_b, slots, scales)(slots)


def bind_rows(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor,
              slots: torch.Tensor, scales: tuple[float, float] = (1.0, 1.0)) -> Callable[[torch.Tensor], None]:
    """`write_rows` of these four tensors as a function of the slots (`slots` here stands for every later
    one: same dtype, device and length T), for a caller that writes the same rows on every step with new
    slots (a layer between piecewise graph replays): on sm_90+ with NVRTC the CUDA kernel's launch is
    packed once (`kv_write_cuda`), else the Triton kernel, else `index_copy_`. The function raises
    ValueError for slots of another length."""
    rows = src_a.shape[0]
    if rows == 0:
        return _check_len(rows, lambda s: None)
    if dst_a.dtype == KV_FP8 and src_a.dtype != KV_FP8:
        return _check_len(rows, _quantizing(dst_a, src_a, dst_b, src_b, scales))
    if (dst_a.is_cuda and slots.dtype == torch.int64 and slots.is_contiguous()
            and kv_write_cuda.unsupported(dst_a, src_a, dst_b, src_b) is None):
        return _check_len(rows, kv_write_cuda.bind(dst_a, src_a, dst_b, src_b, slots))
    tensors = (dst_a, src_a, dst_b, src_b)
    if (dst_a.is_cuda and all(t.stride(-1) == 1 for t in tensors)
            and src_a.dtype == dst_a.dtype == dst_b.dtype == src_b.dtype and _kernel() is not None):
        return _check_len(rows, functools.partial(_kernel().launch, dst_a, src_a, dst_b, src_b))

    def index_copy(s: torch.Tensor) -> None:
        dst_a.index_copy_(0, s, src_a.to(dst_a.dtype))
        dst_b.index_copy_(0, s, src_b.to(dst_b.dtype))

    return _check_len(rows, index_copy)


def _quantizing(dst_a, src_a, dst_b, src_b, scales: tuple[float, float]) -> Callable[[torch.Tensor], None]:
    """`bind_rows` into an FP8 pool: the Triton kernel quantizes as it writes (CUDA sm_89+, where Triton has e4m3),
    else `core.kv.store_quantized`."""
    tensors = (dst_a, src_a, dst_b, src_b)
    if (dst_a.is_cuda and all(t.stride(-1) == 1 for t in tensors) and dst_b.dtype == KV_FP8
            and torch.cuda.get_device_capability(dst_a.device) >= (8, 9) and _kernel() is not None):
        return functools.partial(_kernel().launch, dst_a, src_a, dst_b, src_b, scales=scales)

    def quantize_copy(s: torch.Tensor) -> None:
        store_quantized(dst_a, s, src_a, scales[0])
        store_quantized(dst_b, s, src_b, scales[1])

    return quantize_copy


def _check_len(rows: int, write: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    def checked(slots: torch.Tensor) -> None:
        if slots.shape[0] != rows:
            raise ValueError(f"{slots.shape[0]} slots for {rows} new K/V rows")
        write(slots)

    return checked


@functools.cache
def _kernel():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from pieceworks.backends import kv_write_kernel

    return kv_write_kernel
