"""Write a step's new K/V rows into the paged pool: one fused launch on CUDA, `index_copy_` elsewhere.

Every attention/MLA backend stores two row blocks per new token (K and V, or c_kv and k_pe) at the
token's slot. Two `index_copy_` calls cost two kernels of PyTorch's generic indexing path per layer; on
the H200 they make most of the gap between an extend call that uses them and a bare FlashInfer kernel. The
Triton kernel here writes both blocks of a token in one program, with 16-byte vector accesses.

triton is imported on first CUDA use only, so `import pieceworks` never loads it.
"""

from __future__ import annotations

import functools

import torch


def write_rows(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor,
               slots: torch.Tensor) -> None:
    """dst_a[slots[t]] = src_a[t] and dst_b[slots[t]] = src_b[t] for every t < len(slots).

    Args:
        dst_a, dst_b: [S, Wa] / [S, Wb] pool views, one row per slot (may be column slices of a wider row).
        src_a, src_b: [T, Wa] / [T, Wb] the step's new rows, T == len(slots).
        slots: [T] int64 slot of every token (distinct except padded tokens, which all use slot 0).
    """
    tensors = (dst_a, src_a, dst_b, src_b)
    if (dst_a.is_cuda and slots.numel() and all(t.stride(-1) == 1 for t in tensors)
            and src_a.dtype == dst_a.dtype == dst_b.dtype == src_b.dtype and _kernel() is not None):
        _kernel().launch(dst_a, src_a, dst_b, src_b, slots)
    else:
        dst_a.index_copy_(0, slots, src_a.to(dst_a.dtype))
        dst_b.index_copy_(0, slots, src_b.to(dst_b.dtype))


@functools.cache
def _kernel():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from pieceworks.backends import kv_write_kernel

    return kv_write_kernel
