"""Triton kernels behind the CUDA implementations of `pieceworks.backends.fused` (imports triton).

Every kernel computes in float32 and rounds to the output dtype exactly where the torch reference
rounds, so the two agree to the bit up to reduction order (RMSNorm) and exp (SiLU). They are compiled
with `enable_fp_fusion=False`: with fusion on, the compiler turned rope's bf16 `a*c - b*s` into one
bf16 FMA, dropping a rounding the reference does (1-ulp differences, seen on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.backends import pdl, pdl_kernels

try:  # the accurate exp, as torch's SiLU uses, rather than the ex2.approx of tl.exp
    from triton.language.extra import libdevice

    _exp = libdevice.exp
except ImportError:  # pragma: no cover - older triton
    _exp = tl.exp

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rows_ok(*ts: torch.Tensor) -> bool:
    return all(t.dim() == 2 and t.stride(1) == 1 and t.dtype in _FLOATS and t.is_cuda for t in ts)


# --- RMSNorm ------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, H, eps, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    # the norm weight is no earlier kernel's output: loaded before the PDL wait
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_kernels.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * r).to(x.dtype).to(tl.float32)  # the reference rounds to x.dtype before the weight
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_rows_ok(x) and weight.dim() == 1 and weight.is_contiguous() and weight.dtype in _FLOATS
            and weight.shape[0] == x.shape[1] and x.shape[1] <= 65536)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        use_pdl, launch = pdl.launch_options(x.device)
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps,
                                        BLOCK=block, PDL=use_pdl, num_warps=min(16, max(1, block // 512)),
                                        enable_fp_fusion=False, **launch)
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, H, eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    # the norm weight is no earlier kernel's output: loaded before the PDL wait
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_kernels.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = (r + x).to(sum_ptr.dtype.element_ty)  # the plain add: float32 sum, one rounding
    tl.store(sum_ptr + row * stride_s + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rs = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)
    y = (sf * rs).to(s.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_supported(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    return (rms_norm_supported(x, weight) and _rows_ok(residual) and residual.shape == x.shape
            and residual.dtype == x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        use_pdl, launch = pdl.launch_options(x.device)
        _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, s, x.stride(0), residual.stride(0),
                                            out.stride(0), s.stride(0), x.shape[1], eps, BLOCK=block, PDL=use_pdl,
                                            num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False,
                                            **launch)
    return out, s


# --- rope ---------------------------------------------------------------------------------------------
@triton.jit
def _rope_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, t, stride_xt, stride_xh, stride_ct, stride_st, stride_ot,
               stride_oh, H, HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
               IN_PLACE: tl.constexpr = False):
    """Rope of token t's H heads of x into out (unit stride over the head dim); IN_PLACE: out is x, and
    every load of the program precedes its stores."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    hm = (h < H)[:, None]
    src = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    if INTERLEAVED:  # one contiguous load, split into the pairs' halves (two stride-2 loads were slower)
        x = tl.load(src + tl.arange(0, 2 * HALF)[None, :], mask=hm, other=0.0)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, HALF, 2)))
    else:
        x1 = tl.load(src + j[None, :], mask=hm, other=0.0)
        x2 = tl.load(src + (HALF + j)[None, :], mask=hm, other=0.0)
    dt = out_ptr.dtype.element_ty
    # cos/sin are rounded to x's dtype first, then every product and sum rounds, as in bf16 torch.
    c = tl.load(cos_ptr + t * stride_ct + j).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + j).to(dt).to(tl.float32)[None, :]
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    dst = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh
    if IN_PLACE:
        tl.debug_barrier()  # every thread's loads before any store (interleaved pairs move)
    tl.store(dst + j[None, :], o1, mask=hm)
    tl.store(dst + (HALF + j)[None, :], o2, mask=hm)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_st, H,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
    pdl_kernels.enter(PDL)
    _rope_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, tl.program_id(0).to(tl.int64), stride_xt, stride_xh,
               stride_ct, stride_st, H * (2 * HALF), 2 * HALF, H, HALF, BLOCK_H, INTERLEAVED)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                    stride_ct, stride_st, stride_qot, stride_qoh, stride_kot, stride_koh, HQ, HK,
                    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                    BLOCK_HK: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False,
                    IN_PLACE: tl.constexpr = False):
    """Program (t, 0) ropes token t's query heads, (t, 1) its key heads (IN_PLACE: into q and k)."""
    pdl_kernels.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rope_rows(q_ptr, cos_ptr, sin_ptr, qo_ptr, t, stride_qt, stride_qh, stride_ct, stride_st, stride_qot,
                   stride_qoh, HQ, HALF, BLOCK_HQ, INTERLEAVED, IN_PLACE)
    else:
        _rope_rows(k_ptr, cos_ptr, sin_ptr, ko_ptr, t, stride_kt, stride_kh, stride_ct, stride_st, stride_kot,
                   stride_koh, HK, HALF, BLOCK_HK, INTERLEAVED, IN_PLACE)


def rope_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    half = x.shape[-1] // 2 if x.dim() == 3 else 0
    return (x.dim() == 3 and x.is_cuda and x.stride(2) == 1 and x.dtype in _FLOATS and half >= 1
            and half & (half - 1) == 0 and x.shape[-1] == 2 * half and _rows_ok(cos, sin)
            and cos.shape == sin.shape == (x.shape[0], half))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] and x.shape[1]:
        block_h = triton.next_power_of_2(x.shape[1])
        use_pdl, launch = pdl.launch_options(x.device)
        _rope_kernel[(x.shape[0],)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                    x.shape[1], HALF=x.shape[2] // 2, BLOCK_H=block_h, INTERLEAVED=interleaved,
                                    PDL=use_pdl, num_warps=4, enable_fp_fusion=False, **launch)
    return out


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            interleaved: bool, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` of q and k (both `rope_supported`, one dtype) in one launch; with `in_place` into q and k
    themselves (same values; with `interleaved` the pairs are written de-interleaved, as `rope` does)."""
    q_out = q if in_place else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if in_place else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0] and (q.shape[1] or k.shape[1]):
        use_pdl, launch = pdl.launch_options(q.device)
        _rope_qk_kernel[(q.shape[0], 2)](
            q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            sin.stride(0), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), q.shape[1],
            k.shape[1], HALF=q.shape[2] // 2,
            BLOCK_HQ=triton.next_power_of_2(max(1, q.shape[1])), BLOCK_HK=triton.next_power_of_2(max(1, k.shape[1])),
            INTERLEAVED=interleaved, PDL=use_pdl, IN_PLACE=in_place, num_warps=4, enable_fp_fusion=False, **launch)
    return q_out, k_out


# --- SiLU and multiply --------------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_o, N, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_kernels.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + t * stride_g + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + _exp(-gf))).to(g.dtype).to(tl.float32)  # F.silu's output, in gate's dtype
    u = tl.load(u_ptr + t * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_supported(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return _rows_ok(gate, up) and gate.shape == up.shape


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if gate.numel():
        block = 1024
        use_pdl, launch = pdl.launch_options(gate.device)
        _silu_mul_kernel[(gate.shape[0], triton.cdiv(gate.shape[1], block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), gate.shape[1], BLOCK=block, PDL=use_pdl,
            num_warps=4, enable_fp_fusion=False, **launch)
    return out
