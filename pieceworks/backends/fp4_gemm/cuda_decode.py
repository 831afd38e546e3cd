"""A hand-written CUDA decode GEMM for NVFP4 weights (w4a16, M <= 8), compiled at run time with NVRTC.

Experiment (issue 7): the Triton decode tiles reach 26-66% of the copy rate at M = 1. This kernel
does the same arithmetic (e2m1 codes decoded to bf16 with integer ops, multiplied by the block scale,
bf16 mma.sync with the weights as the A operand) with a layout made for it:

- One CTA owns 16 weight rows and all of K; its W warps split K into contiguous runs of 64-element
  chunks, and a shared-memory sum of the warps' accumulators ends it (no split-K across CTAs, no
  counters, nothing to zero).
- Chunk layout: lane L = 4g + t of a warp reads one 16-byte vector per chunk, the codes of rows g
  and g + 8 for elements 16t .. 16t + 15 of the chunk: one NVFP4 block per row, so a lane needs two
  block scales per chunk (one 2-byte load) and converts them once for its 32 weights. The MMA's K
  order is permuted to match: mma j of a chunk, k slots (2t, 2t + 1, 2t + 8, 2t + 9), are elements
  16t + 4j + (0, 1, 2, 3) of the chunk, for the weights and x alike, so x needs no reordering (each
  lane reads 32 contiguous bytes of its token's row).
- Inside the vector, 32-bit word (h, p) (h = row g / g + 8, p = 0, 1) holds two k32 units (the bit
  layout of triton_k32.py, SLOT_BITS): its low unit the codes of elements 16t + 4j + 2p, its high unit
  those of 16t + 4j + 2p + 1, slot j = 0..3; slot j of the word decodes to one bf16x2 A register of
  mma j.
- Every lane keeps D chunks of codes, scales and x in flight in registers (a ring, no shared memory).

This module imports torch only; the kernel is compiled on first use through torch's NVRTC wrapper.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pieceworks.backends.fp4_gemm.k32 import SLOT_BITS
from pieceworks.quant import nvfp4

CHUNK = 64  # elements of K per chunk
ROWS = 16  # weight rows per CTA

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ void ld_stream(U4& r, const U4* p, bool pred) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
                 : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w) : "l"(p), "r"((int)pred));
}
__device__ __forceinline__ void ld_x(U4& r, const U4* p, bool pred) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
                 " @q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
                 : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w) : "l"(p), "r"((int)pred));
}
__device__ __forceinline__ void ld_scale(u32& r, const u16* p, bool pred) {
    u16 v = (u16)r;
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.u16 %0, [%1];\n}" : "+h"(v) : "l"(p), "r"((int)pred));
    r = v;
}
// Two e4m3 scales (low byte row g, high byte row g + 8) -> bf16x2 (scale * 2^112) each (triton_k32.py).
__device__ __forceinline__ u32 scale_pair(u32 s) {
    u32 h;
    asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(h) : "r"(s));
    return (h >> 3) | 0x70007000u;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(r) : "r"(a), "r"(sel));
    return r;
}
__device__ __forceinline__ u32 bmul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
template <int J> __device__ __forceinline__ u32 slot(u32 w) {
    const u32 m = 0x81C081C0u;
    if (J == 0) return w & m;
    if (J == 1) return (w << 3) & m;
    if (J == 2) return (w << 6) & m;
    return (((w & 0x6C006C00u) >> 7) * 2081u) & m;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <int J> __device__ __forceinline__ void mma_slot(float* c, const U4& w, u32 sg, u32 sh, u32 b0, u32 b1) {
    mma(c, bmul(slot<J>(w.x), sg), bmul(slot<J>(w.z), sh), bmul(slot<J>(w.y), sg), bmul(slot<J>(w.w), sh), b0, b1);
}

struct Chunk { U4 w; U4 x0, x1; u32 s; };

template <int W, int D>
__global__ void __launch_bounds__(W * 32) nvfp4_decode_gemm(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ out, const float* __restrict__ gscale,
    int M, int N, int nchunks, int ldx, int ldo)
{
    __shared__ float red[W * 128];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int c_begin = (nchunks * warp) / W;
    const int nc = (nchunks * (warp + 1)) / W - c_begin;
    const size_t chunk0 = (size_t)blockIdx.x * nchunks + c_begin;
    const U4* cp = codes + chunk0 * 32 + lane;
    const u16* sp = scales + chunk0 * 32 + lane;
    // tokens g >= M read token M - 1's row (their results are not stored); K is a multiple of 64
    const u16* xp = x + (size_t)min(g, M - 1) * ldx + c_begin * 64 + 16 * t;

    Chunk buf[D];
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    // Chunk C (0-based in this warp's run) of the ring, loaded if P; addresses from the running pointers.
#define LOAD(B, C, P) do { \
        ld_stream(buf[B].w, cp + (C) * 32, P); \
        ld_scale(buf[B].s, sp + (C) * 32, P); \
        ld_x(buf[B].x0, (const U4*)(xp + (C) * 64), P); \
        ld_x(buf[B].x1, (const U4*)(xp + (C) * 64 + 8), P); \
    } while (0)
#define COMPUTE(B) do { \
        const Chunk& k = buf[B]; \
        const u32 h = scale_pair(k.s); \
        const u32 sg = prmt(h, 0x1010u), sh = prmt(h, 0x3232u); \
        mma_slot<0>(acc0, k.w, sg, sh, k.x0.x, k.x0.y); \
        mma_slot<1>(acc1, k.w, sg, sh, k.x0.z, k.x0.w); \
        mma_slot<2>(acc0, k.w, sg, sh, k.x1.x, k.x1.y); \
        mma_slot<3>(acc1, k.w, sg, sh, k.x1.z, k.x1.w); \
    } while (0)
#pragma unroll
    for (int b = 0; b < D - 1; ++b) LOAD(b, b, b < nc);
    int c = 0;
    for (; c + D <= nc; c += D) {
#pragma unroll
        for (int b = 0; b < D; ++b) {
            LOAD((b + D - 1) % D, b + D - 1, c + b + D - 1 < nc);
            COMPUTE(b);
        }
        cp += D * 32;
        sp += D * 32;
        xp += D * 64;
    }
    // the last nc % D chunks are in buffers 0 .. nc % D - 1 already
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        if (c + b < nc) COMPUTE(b);
    }
#undef COMPUTE
#undef LOAD
    // acc: (row g, token 2t), (row g, 2t + 1), (row g + 8, 2t), (row g + 8, 2t + 1)
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp * 128 + lane * 4 + e] = acc0[e] + acc1[e];
    __syncthreads();
    const float gs = *gscale * 16384.0f;
    for (int i = threadIdx.x; i < 128; i += W * 32) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) v += red[w * 128 + i];
        const int l = i >> 2, e = i & 3;
        const int row = (l >> 2) + 8 * (e >> 1), token = 2 * (l & 3) + (e & 1);
        const int n = blockIdx.x * 16 + row;
        if (token < M && n < N) {
            u16 o;
            asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(o) : "f"(v * gs));
            out[(size_t)token * ldo + n] = o;
        }
    }
}
"""


def repack_decode(weight: torch.Tensor, weight_scale: torch.Tensor):
    """Checkpoint NVFP4 [N, K/2] uint8 + [N, K/16] e4m3 -> this kernel's layout (module docstring).

    Returns (codes uint8 [R, C, 512], scales uint8 [R, C, 64]) with R = ceil(N / 16) row groups and
    C = ceil(K / 64) chunks; padding is zero codes and zero scales. Codes of zero-scale blocks are
    zeroed and negative scales' signs moved into their codes, as `k32.repack_k32` does.
    """
    n, half_k = weight.shape
    k = half_k * 2
    if k % nvfp4.BLOCK:
        raise ValueError(f"NVFP4 K must be a multiple of {nvfp4.BLOCK}, got {k}")
    scale_bits = weight_scale.reshape(n, k // nvfp4.BLOCK).view(torch.uint8)
    magnitude = scale_bits & 0x7F
    if bool((magnitude == 0x7F).any()):
        raise ValueError("NVFP4 block scales contain NaN: the checkpoint is corrupt: re-export it")
    zero_block = magnitude == 0
    flip = ((scale_bits & 0x80) != 0) & ~zero_block
    codes = nvfp4.unpack(weight).to(torch.int32)
    codes.masked_fill_(zero_block.repeat_interleave(nvfp4.BLOCK, dim=1), 0)
    codes ^= flip.repeat_interleave(nvfp4.BLOCK, dim=1).to(torch.int32) << 3
    rg, ch = -(-n // ROWS), -(-k // CHUNK)
    codes = torch.nn.functional.pad(codes, (0, ch * CHUNK - k, 0, rg * ROWS - n))
    mag = torch.nn.functional.pad(magnitude, (0, ch * 4 - k // nvfp4.BLOCK, 0, rg * ROWS - n))
    # codes[row, k]: row = 16 r + 8 h + g, k = 64 c + 16 t + 4 j + 2 p + u (u: low / high unit of a word)
    c = codes.view(rg, 2, 8, ch, 4, 4, 2, 2)  # r h g c t j p u
    units = torch.zeros(rg, 2, 8, ch, 4, 2, 2, dtype=torch.int32, device=weight.device)
    for j, bits in enumerate(SLOT_BITS):
        cj = c[:, :, :, :, :, j]
        for bit, pos in zip((3, 2, 1, 0), bits):
            units |= ((cj >> bit) & 1) << pos
    units = units.permute(0, 3, 2, 4, 1, 5, 6)  # r c g t h p u
    out = torch.stack([units & 0xFF, units >> 8], dim=-1).to(torch.uint8)
    out = out.contiguous().view(rg, ch, 512)
    # scales[r, c, lane = 4 g + t, h] = scale of row 16 r + 8 h + g, block 4 c + t
    s = mag.view(rg, 2, 8, ch, 4).permute(0, 3, 2, 4, 1).contiguous().view(rg, ch, 64)
    return out, s


@lru_cache(maxsize=None)
def kernel(warps: int, depth: int):
    """The compiled kernel for W = warps, D = depth (NVRTC, sm of the current device)."""
    return torch.cuda._compile_kernel(SOURCE, f"nvfp4_decode_gemm<{warps}, {depth}>")


def decode_gemm(x, codes, scales, gscale, n: int, warps: int = 8, depth: int = 4, out=None):
    """y[M, N] = x @ dequant(W).T for M <= 8 (bf16 x with unit stride in K, 16-byte aligned rows)."""
    m, k = x.shape
    if k % CHUNK:  # the kernel reads x in whole chunks
        x = torch.nn.functional.pad(x, (0, CHUNK - k % CHUNK))
    if m > 8:
        raise ValueError(f"decode_gemm serves M <= 8, got {m}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("decode_gemm needs x with unit stride in K and 16-byte aligned rows")
    rg, ch, _ = codes.shape
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    kernel(warps, depth)(
        grid=(rg, 1, 1), block=(warps * 32, 1, 1),
        args=[codes, scales, x, out, gscale, m, n, ch, x.stride(0), out.stride(0)],
    )
    return out
