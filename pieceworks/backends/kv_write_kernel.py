"""The Triton kernel behind `pieceworks.backends.kv_write` (imports triton at the top)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.backends import pdl, pdl_kernels


@triton.jit
def quantize_e4m3(x, inv_scale, dtype: tl.constexpr):
    """core.kv.quantize_kv in a kernel: x times the float32 reciprocal of the scale, saturated at the e4m3 range."""
    return tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0).to(dtype)


@triton.jit
def _write_rows_kernel(
    dst_a, src_a, dst_b, src_b, slots,
    stride_da, stride_sa, stride_db, stride_sb,
    inv_a, inv_b,
    WIDTH_A: tl.constexpr, WIDTH_B: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
    QUANT: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_kernels.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    ca = tl.arange(0, BLOCK_A)
    a = tl.load(src_a + t * stride_sa + ca, mask=ca < WIDTH_A)
    if QUANT:
        a = quantize_e4m3(a, inv_a, dst_a.dtype.element_ty)
    tl.store(dst_a + slot * stride_da + ca, a, mask=ca < WIDTH_A)
    cb = tl.arange(0, BLOCK_B)
    b = tl.load(src_b + t * stride_sb + cb, mask=cb < WIDTH_B)
    if QUANT:
        b = quantize_e4m3(b, inv_b, dst_b.dtype.element_ty)
    tl.store(dst_b + slot * stride_db + cb, b, mask=cb < WIDTH_B)


def launch(dst_a: torch.Tensor, src_a: torch.Tensor, dst_b: torch.Tensor, src_b: torch.Tensor,
           slots: torch.Tensor, scales: tuple[float, float] | None = None) -> None:
    """See `kv_write.write_rows`: all four tensors 2-D with unit inner stride, one dtype; or float8_e4m3fn
    destinations with `scales` (the rows quantized as they are written)."""
    wa, wb = src_a.shape[1], src_b.shape[1]
    assert dst_a.shape[1] == wa and dst_b.shape[1] == wb, (dst_a.shape, src_a.shape, dst_b.shape, src_b.shape)
    block_a, block_b = triton.next_power_of_2(wa), triton.next_power_of_2(wb)
    warps = max(1, min(8, max(block_a, block_b) * src_a.element_size() // 512))  # 16 B per thread
    quant = scales is not None
    inv_a, inv_b = (1.0 / scales[0], 1.0 / scales[1]) if quant else (1.0, 1.0)
    use_pdl, launch = pdl.launch_options(dst_a.device)
    _write_rows_kernel[(slots.shape[0],)](
        dst_a, src_a, dst_b, src_b, slots,
        dst_a.stride(0), src_a.stride(0), dst_b.stride(0), src_b.stride(0), inv_a, inv_b,
        WIDTH_A=wa, WIDTH_B=wb, BLOCK_A=block_a, BLOCK_B=block_b, QUANT=quant, PDL=use_pdl, num_warps=warps,
        **launch,
    )
