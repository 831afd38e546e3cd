"""The CUDA kernel behind `kv_write` on sm_90+ with NVRTC: the step's K/V (or c_kv / k_pe) rows copied to
their slots in 16-byte units, one CTA per token. Launched through the driver (`nvrtc.BoundLaunch`) rather
than through Triton's per-launch argument handling; a layer of a piecewise step binds its launch once and
passes only the step's slots (`bind`). Imports torch only.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable

import torch

from pieceworks.backends import nvrtc, pdl

SOURCE = r"""
struct __align__(16) U4 { unsigned int x, y, z, w; };
// dst_a[slots[t]] = src_a[t], dst_b[slots[t]] = src_b[t]; widths and row strides in 16-byte units.
// PDL: wait for the kernel before (it writes src), then let the next one launch.
__global__ void pw_write_rows(U4* dst_a, const U4* src_a, U4* dst_b, const U4* src_b, const long long* slots,
                              int sda, int ssa, int sdb, int ssb, int wa, int wb)
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long t = blockIdx.x, slot = slots[t];
    for (int i = threadIdx.x; i < wa; i += blockDim.x) dst_a[slot * sda + i] = src_a[t * ssa + i];
    for (int i = threadIdx.x; i < wb; i += blockDim.x) dst_b[slot * sdb + i] = src_b[t * ssb + i];
}
"""


def unsupported(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor) -> str | None:
    """Why this kernel can't write these rows (the Triton kernel does), or None: it needs sm_90
    (griddepcontrol), NVRTC, one dtype, 2-D rows of 16-byte multiples at 16-byte aligned addresses."""
    reason = _device_reason(dst_a.device)
    if reason is not None:
        return reason
    tensors = (dst_a, src_a, dst_b, src_b)
    if len({t.dtype for t in tensors}) != 1 or any(t.dim() != 2 or t.stride(-1) != 1 for t in tensors):
        return "needs 2-D rows of one dtype with unit inner stride"
    size = dst_a.element_size()
    if any((t.shape[1] * size) % 16 or (t.stride(0) * size) % 16 or t.data_ptr() % 16 for t in tensors):
        return "needs rows of 16-byte multiples at 16-byte aligned addresses"
    return None


@lru_cache(maxsize=None)
def _device_reason(device: torch.device) -> str | None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return "needs an sm_90+ CUDA device"
    return nvrtc.unavailable_reason()


SLOTS_ARG = 4  # the kernel's argument that changes from step to step


def bind(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor,
         slots: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """The write of src_a's / src_b's rows (all of them) for `unsupported(...) is None` tensors, as a
    function of each step's int64 slots, one per row (`kv_write.bind_rows` refuses any other count)."""
    unit = 16 // dst_a.element_size()
    wa, wb = src_a.shape[1] // unit, src_b.shape[1] // unit
    threads = min(256, -(-max(wa, wb) // 32) * 32)
    args = [dst_a, src_a, dst_b, src_b, slots, dst_a.stride(0) // unit, src_a.stride(0) // unit,
            dst_b.stride(0) // unit, src_b.stride(0) // unit, wa, wb]
    kernel = nvrtc.kernel(SOURCE, "pw_write_rows", dst_a.device)
    launch = kernel.bind((src_a.shape[0], 1, 1), (threads, 1, 1), args, pdl.enabled(dst_a.device))
    return partial(launch, SLOTS_ARG)
