"""The CUDA decode GEMM of the `cuda` fp4_gemm backend (w4a16, M <= 16 per launch): kernel source, the
load-time repack into its layout, and the NVRTC / driver glue that compiles and launches it.

The Triton decode tiles reached 26-66% of the copy rate at M = 1 on the H200 (docs/benchmarks.md). This
kernel does the same arithmetic (e2m1 codes decoded to bf16 with integer ops, multiplied by the block
scale, bf16 mma.sync with the weights as the A operand) in a layout made for it ("r16c64"):

- One CTA owns 16 weight rows and all of K; its W warps split K into contiguous runs of 64-element
  chunks, and a shared-memory sum of the warps' accumulators ends it (no split-K across CTAs, no
  counters, nothing to zero). The epilogue stores y, or silu(gate) * up, or the roped q/k/v columns.
- Chunk layout: lane L = 4g + t of a warp reads one 16-byte vector per chunk, the codes of rows g
  and g + 8 for elements 16t .. 16t + 15 of the chunk: one NVFP4 block per row, so a lane needs two
  block scales per chunk (one 2-byte load) and converts them once for its 32 weights. The MMA's K
  order is permuted to match: mma j of a chunk, k slots (2t, 2t + 1, 2t + 8, 2t + 9), are elements
  16t + 4j + (0, 1, 2, 3) of the chunk, for the weights and x alike, so x needs no reordering (each
  lane reads 32 contiguous bytes of its token's row).
- Inside the vector, 32-bit word (h, p) (h = row g / g + 8, p = 0, 1) holds two k32 units (the bit
  layout of triton_k32.py, SLOT_BITS): its low unit the codes of elements 16t + 4j + 2p, its high unit
  those of 16t + 4j + 2p + 1, slot j = 0..3; slot j of the word decodes to one bf16x2 A register of
  mma j. The scale conversion and its 2^112 / 2^-14 bias are triton_k32.py's.
- Every lane keeps D chunks of codes, scales and x in flight in registers (a ring, no shared memory;
  a cp.async version with shared-memory stages was slower: docs/benchmarks.md).
- Up to 8 tokens per mma (the B operand's 8 columns); 9..16 tokens run two n-tiles on the same decoded
  A registers. Lanes of tokens >= M read another token's row; those columns are never stored.

This module imports torch only. NVRTC (the nvidia-cuda-nvrtc library torch's CUDA wheels bring)
compiles each template instance on first use for the device's sm (the source includes no headers, so
no CUDA toolkit is needed); the driver API loads and launches it (`cuLaunchKernelEx`, with the PDL
launch attribute when asked).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from pieceworks.backends.fp4_gemm.k32 import SLOT_BITS
from pieceworks.quant import nvfp4

CHUNK = 64  # elements of K per chunk
ROWS = 16  # weight rows per CTA

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
// Programmatic dependent launch: wait for the kernel before / let the next one start early (returns at
// once when not launched with PDL). Like mul.bf16x2, needs sm_90.
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
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

__device__ __forceinline__ float bf16_round(float v) {  // v rounded to bf16, as float
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return __uint_as_float((u32)h << 16);
}
__device__ __forceinline__ u16 to_bf16(float v) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
// silu(g) * u rounded as the unfused path rounds (Triton's `_swiglu`: div.full, libdevice exp).
__device__ __forceinline__ u16 swiglu(float g, float u) {
    g = bf16_round(g);
    u = bf16_round(u);
    float d;
    asm("div.full.f32 %0, %1, %2;" : "=f"(d) : "f"(g), "f"(1.0f + expf(-g)));
    return to_bf16(bf16_round(d) * u);
}

// The rope of one q/k pair as the rope kernel rounds (Triton's `_rope_pair`): values, cos and sin rounded
// to bf16, every product (no FMA contraction) and sum rounded.
__device__ __forceinline__ void rope_pair(float y1, float y2, float c, float s, u16& o1, u16& o2) {
    const float x1 = bf16_round(y1), x2 = bf16_round(y2);
    c = bf16_round(c);
    s = bf16_round(s);
    o1 = to_bf16(bf16_round(__fmul_rn(x1, c)) - bf16_round(__fmul_rn(x2, s)));
    o2 = to_bf16(bf16_round(__fmul_rn(x2, c)) + bf16_round(__fmul_rn(x1, s)));
}

template <int NT> struct Chunk { U4 w; u32 s; U4 x[NT][2]; };

// EPI 0: out[token, n] = y; EPI 1 (SwiGLU, rows 2j / 2j + 1 = gate / up of column j, interleave_gate_up):
// out[token, n / 2] = silu(gate) * up. EPI 2 (q/k/v rope, rows in the interleave_rope_rows order: rows 2j and
// 2j + 1 are dims d and d + half of a q or k head, columns below rope_cols; v rows in order): the pair
// rotated by cos / sin [M, half] (float32, row strides ldc / lds) and stored in checkpoint column order.
template <int W, int D, int NT, int EPI>
__global__ void __launch_bounds__(W * 32) nvfp4_decode_gemm(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ out, const float* __restrict__ gscale,
    int M, int N, int nchunks, int ldx, int ldo,
    const float* __restrict__ cosp, const float* __restrict__ sinp, int ldc, int lds, int rope_cols, int half)
{
    __shared__ float red[W * NT * 128];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int c_begin = (nchunks * warp) / W;
    const int nc = (nchunks * (warp + 1)) / W - c_begin;
    const size_t chunk0 = (size_t)blockIdx.x * nchunks + c_begin;
    const U4* cp = codes + chunk0 * 32 + lane;
    const u16* sp = scales + chunk0 * 32 + lane;
    // n-tile i serves tokens 8 i + g; tokens >= M read token M - 1's row (their results are not stored)
    const u16* xp[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) xp[i] = x + (size_t)min(8 * i + g, M - 1) * ldx + c_begin * 64 + 16 * t;

    Chunk<NT> buf[D];
    float acc[NT][2][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][0][e] = acc[i][1][e] = 0.f;
#define LOAD_W(B, C, P) do { \
        ld_stream(buf[B].w, cp + (C) * 32, P); \
        ld_scale(buf[B].s, sp + (C) * 32, P); \
    } while (0)
#define LOAD_X(B, C, P) do { \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) { \
            ld_x(buf[B].x[i][0], (const U4*)(xp[i] + (C) * 64), P); \
            ld_x(buf[B].x[i][1], (const U4*)(xp[i] + (C) * 64 + 8), P); \
        } \
    } while (0)
#define COMPUTE(B) do { \
        const Chunk<NT>& k = buf[B]; \
        const u32 h = scale_pair(k.s); \
        const u32 sg = prmt(h, 0x1010u), sh = prmt(h, 0x3232u); \
        const u32 a00 = bmul(slot<0>(k.w.x), sg), a01 = bmul(slot<0>(k.w.z), sh), \
                  a02 = bmul(slot<0>(k.w.y), sg), a03 = bmul(slot<0>(k.w.w), sh); \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) \
            mma(acc[i][0], a00, a01, a02, a03, k.x[i][0].x, k.x[i][0].y); \
        const u32 a10 = bmul(slot<1>(k.w.x), sg), a11 = bmul(slot<1>(k.w.z), sh), \
                  a12 = bmul(slot<1>(k.w.y), sg), a13 = bmul(slot<1>(k.w.w), sh); \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) \
            mma(acc[i][1], a10, a11, a12, a13, k.x[i][0].z, k.x[i][0].w); \
        const u32 a20 = bmul(slot<2>(k.w.x), sg), a21 = bmul(slot<2>(k.w.z), sh), \
                  a22 = bmul(slot<2>(k.w.y), sg), a23 = bmul(slot<2>(k.w.w), sh); \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) \
            mma(acc[i][0], a20, a21, a22, a23, k.x[i][1].x, k.x[i][1].y); \
        const u32 a30 = bmul(slot<3>(k.w.x), sg), a31 = bmul(slot<3>(k.w.z), sh), \
                  a32 = bmul(slot<3>(k.w.y), sg), a33 = bmul(slot<3>(k.w.w), sh); \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) \
            mma(acc[i][1], a30, a31, a32, a33, k.x[i][1].z, k.x[i][1].w); \
    } while (0)
    // The weights are never written by an earlier kernel: their first loads go before the PDL wait.
#pragma unroll
    for (int b = 0; b < D - 1; ++b) LOAD_W(b, b, b < nc);
    PDL_WAIT();
#pragma unroll
    for (int b = 0; b < D - 1; ++b) LOAD_X(b, b, b < nc);
    int c = 0;
    for (; c + D <= nc; c += D) {
#pragma unroll
        for (int b = 0; b < D; ++b) {
            LOAD_W((b + D - 1) % D, b + D - 1, c + b + D - 1 < nc);
            LOAD_X((b + D - 1) % D, b + D - 1, c + b + D - 1 < nc);
            COMPUTE(b);
        }
        cp += D * 32;
        sp += D * 32;
#pragma unroll
        for (int i = 0; i < NT; ++i) xp[i] += D * 64;
    }
    // the last nc % D chunks are in buffers 0 .. nc % D - 1 already
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        if (c + b < nc) COMPUTE(b);
    }
#undef LOAD_W
#undef LOAD_X
#undef COMPUTE
    PDL_TRIGGER();
    // acc[i]: (row g, token 8i + 2t), (row g, 8i + 2t + 1), (row g + 8, 8i + 2t), (row g + 8, 8i + 2t + 1)
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(warp * NT + i) * 128 + lane * 4 + e] = acc[i][0][e] + acc[i][1][e];
    __syncthreads();
    const float gs = *gscale * 16384.0f;
    if (EPI == 0) {
        for (int idx = threadIdx.x; idx < NT * 128; idx += W * 32) {
            const int i = idx >> 7, r = idx & 127;
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < W; ++w) v += red[(w * NT + i) * 128 + r];
            const int l = r >> 2, e = r & 3;
            const int row = (l >> 2) + 8 * (e >> 1), token = 8 * i + 2 * (l & 3) + (e & 1);
            const int n = blockIdx.x * 16 + row;
            if (token < M && n < N) out[(size_t)token * ldo + n] = to_bf16(v * gs);
        }
    } else {
        for (int idx = threadIdx.x; idx < NT * 64; idx += W * 32) {
            const int token = idx >> 3, j = idx & 7;  // output column blockIdx.x * 8 + j
            const int i = token >> 3, tk = token & 7;
            // rows 2j (gate) and 2j + 1 (up) of the CTA, token tk of n-tile i, in the `red` order
            const int rg = 2 * j, ru = 2 * j + 1;
            const int ig = (4 * (rg & 7) + (tk >> 1)) * 4 + 2 * (rg >> 3) + (tk & 1);
            const int iu = (4 * (ru & 7) + (tk >> 1)) * 4 + 2 * (ru >> 3) + (tk & 1);
            float vg = 0.f, vu = 0.f;
#pragma unroll
            for (int w = 0; w < W; ++w) {
                vg += red[(w * NT + i) * 128 + ig];
                vu += red[(w * NT + i) * 128 + iu];
            }
            const int n = blockIdx.x * 8 + j;
            if (token >= M || 2 * n >= N) continue;
            if (EPI == 1) {
                out[(size_t)token * ldo + n] = swiglu(vg * gs, vu * gs);
            } else if (2 * n < rope_cols) {
                const int head = n / half, d = n % half;
                u16 o1, o2;
                rope_pair(vg * gs, vu * gs, cosp[(size_t)token * ldc + d], sinp[(size_t)token * lds + d], o1, o2);
                out[(size_t)token * ldo + head * 2 * half + d] = o1;
                out[(size_t)token * ldo + head * 2 * half + half + d] = o2;
            } else {
                out[(size_t)token * ldo + 2 * n] = to_bf16(vg * gs);
                out[(size_t)token * ldo + 2 * n + 1] = to_bf16(vu * gs);
            }
        }
    }
}

// Dequantize to bf16 [N, K] (row stride ldo; EPI 1: row 2j -> j, 2j + 1 -> N / 2 + j, the checkpoint
// order of an interleaved gate/up weight): bf16(e2m1 * scale * weight_scale_2), as the torch reference.
template <int EPI>
__global__ void __launch_bounds__(256) nvfp4_decode_dequant(
    const U4* __restrict__ codes, const u16* __restrict__ scales, u16* __restrict__ out,
    const float* __restrict__ gscale, int N, int K, int nchunks, int ldo)
{
    PDL_WAIT();  // `out` may be memory an earlier kernel reads
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int chunk = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (chunk >= nchunks) return;
    const size_t ci = (size_t)blockIdx.x * nchunks + chunk;
    U4 w = ((const U4*)codes)[ci * 32 + lane];
    const u32 h = scale_pair(scales[ci * 32 + lane]);
    const u32 sg = prmt(h, 0x1010u), sh = prmt(h, 0x3232u);
    const float gs = *gscale * 16384.0f;
    const int k = chunk * 64 + 16 * t;
    if (k >= K) return;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = blockIdx.x * 16 + g + 8 * hh;
        if (r >= N) continue;
        const int dst = EPI ? (r & 1) * (N / 2) + (r >> 1) : r;
        const u32 w0 = hh ? w.z : w.x, w1 = hh ? w.w : w.y, s = hh ? sh : sg;
        u32 v[8];  // element pairs 16t + 2q, q = 0..7: slot j, word p -> pair 2j + p
        v[0] = bmul(slot<0>(w0), s); v[1] = bmul(slot<0>(w1), s);
        v[2] = bmul(slot<1>(w0), s); v[3] = bmul(slot<1>(w1), s);
        v[4] = bmul(slot<2>(w0), s); v[5] = bmul(slot<2>(w1), s);
        v[6] = bmul(slot<3>(w0), s); v[7] = bmul(slot<3>(w1), s);
        u32 o[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const float lo = __uint_as_float(v[q] << 16), hi = __uint_as_float(v[q] & 0xFFFF0000u);
            o[q] = (u32)to_bf16(lo * gs) | ((u32)to_bf16(hi * gs) << 16);
        }
        U4* dp = (U4*)(out + (size_t)dst * ldo + k);
        dp[0] = U4{o[0], o[1], o[2], o[3]};
        dp[1] = U4{o[4], o[5], o[6], o[7]};
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


def unpack_decode(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int):
    """The inverse of `repack_decode` (for tests): (e2m1 codes uint8 [n, k], e4m3 scales [n, k / 16])."""
    rg, ch, _ = codes.shape
    b = codes.view(rg, ch, 8, 4, 2, 2, 2, 2).to(torch.int32)  # r c g t h p u byte
    units = b[..., 0] | (b[..., 1] << 8)
    out = torch.zeros(rg, 2, 8, ch, 4, 4, 2, 2, dtype=torch.int32, device=codes.device)  # r h g c t j p u
    for j, bits in enumerate(SLOT_BITS):
        code = torch.zeros_like(units)
        for bit, pos in zip((3, 2, 1, 0), bits):
            code |= ((units >> pos) & 1) << bit
        out[:, :, :, :, :, j] = code.permute(0, 4, 2, 1, 3, 5, 6)
    out = out.view(rg * ROWS, ch * CHUNK)[:n, :k].to(torch.uint8)
    s = scales.view(rg, ch, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(rg * ROWS, ch * 4)
    return out, s[:n, : k // nvfp4.BLOCK].contiguous().view(torch.float8_e4m3fn)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def nvrtc_library() -> ctypes.CDLL:
    """NVRTC of torch's CUDA major version (the nvidia-cuda-nvrtc wheel torch depends on, or the system's)."""
    major = int((torch.version.cuda or "0").split(".")[0])
    try:
        from torch.cuda._utils import _get_gpu_rtc_library  # finds the wheel's copy; private, hence the fallback

        return _get_gpu_rtc_library()
    except (ImportError, OSError, AttributeError):
        pass
    for name in (f"libnvrtc.so.{major}", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"libnvrtc.so.{major} not found: install the nvidia-cuda-nvrtc wheel matching torch's CUDA {major}")


def _check(lib, err: int, what: str) -> None:
    if err:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {err} ({(msg.value or b'?').decode()})")


def compile_cubin(name: str, arch: str) -> tuple[bytes, str]:
    """SOURCE compiled by NVRTC for `arch` (e.g. "sm_90"): (cubin, the lowered name of `name`, a template
    instance). The source includes no headers, so no CUDA toolkit is needed."""
    lib = nvrtc_library()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()

    def check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"NVRTC {what} of {name}: {lib.nvrtcGetErrorString(err).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"cuda_decode.cu", 0, None, None), "create")
    try:
        check(lib.nvrtcAddNameExpression(prog, name.encode()), "name")
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        err = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if err:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = ctypes.c_char_p()
        check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), "lowered name")
        return cubin.raw, lowered.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class Kernel:
    """One compiled kernel of SOURCE for one device, launched on the current stream with or without
    programmatic dependent launch (the kernels wait with griddepcontrol before reading anything an
    earlier kernel writes; without PDL the wait returns at once)."""

    def __init__(self, name: str, device: int) -> None:
        major, minor = torch.cuda.get_device_capability(device)
        cubin, lowered = compile_cubin(name, f"sm_{major}{minor}")
        self.name = name
        self.device = device
        self._libcuda = lib = ctypes.CDLL("libcuda.so.1")
        with torch.cuda.device(device):
            torch.cuda.current_stream()  # torch's context for the device (its primary one) is current here
            self._module = ctypes.c_void_p()
            _check(lib, lib.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData")
            self._func = ctypes.c_void_p()
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(self._func), self._module, lowered.encode()),
                   "cuModuleGetFunction")
        attr = _LaunchAttribute()
        attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value = (1).to_bytes(4, "little") + bytes(60)
        self._pdl_attr = attr

    def __call__(self, grid, block, args, pdl: bool) -> None:
        if torch.cuda.current_device() != self.device:  # launch in the device's context, on its stream
            with torch.cuda.device(self.device):
                return self(grid, block, args, pdl)
        params = []
        for a in args:
            if isinstance(a, torch.Tensor):
                params.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, int):
                params.append(ctypes.c_int(a))
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
        ptrs = (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in params])
        cfg = _LaunchConfig()
        cfg.grid[:] = grid
        cfg.block[:] = block
        cfg.shared = 0
        cfg.stream = torch.cuda.current_stream().cuda_stream
        if pdl:
            cfg.attrs = ctypes.pointer(self._pdl_attr)
            cfg.num_attrs = 1
        _check(self._libcuda, self._libcuda.cuLaunchKernelEx(ctypes.byref(cfg), self._func, ptrs, None),
               f"cuLaunchKernelEx({self.name})")


@lru_cache(maxsize=None)
def _kernel(name: str, device: int) -> Kernel:
    return Kernel(name, device)


def kernel(name: str, device: torch.device) -> Kernel:
    """The kernel `name` (a template instance of SOURCE) for `device`, compiled on first use (about a
    second)."""
    return _kernel(name, device.index if device.index is not None else torch.cuda.current_device())


def decode_gemm(x, codes, scales, gscale, n: int, warps: int = 8, depth: int = 2, swiglu: bool = False,
                pdl: bool = False, out=None, rope=None):
    """y = x @ dequant(W).T for M <= 16 (bf16 x with unit stride in K, 16-byte aligned rows); with
    swiglu (rows interleaved gate / up) y = silu(gate) * up [M, n / 2]; with rope = (cos, sin,
    rope_cols, head_dim) (rows in the interleave_rope_rows order) the q/k columns below rope_cols
    rotated, every column in checkpoint order."""
    m, k = x.shape
    if m > 16:
        raise ValueError(f"decode_gemm serves M <= 16, got {m}")
    if k % CHUNK:  # the kernel reads x in whole chunks
        x = torch.nn.functional.pad(x, (0, CHUNK - k % CHUNK))
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
    rg, ch, _ = codes.shape
    if out is None:
        out = torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16, device=x.device)
    if m == 0:  # nothing to compute (the kernel would read row M - 1 = -1)
        return out
    nt = 1 if m <= 8 else 2
    if rope is None:
        epi, rope_args = int(swiglu), [gscale, gscale, 0, 0, 0, 1]
    else:
        cos, sin, rope_cols, head_dim = rope
        cos, sin = cos.float(), sin.float()
        if cos.stride(-1) != 1 or sin.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        epi, rope_args = 2, [cos, sin, cos.stride(0), sin.stride(0), rope_cols, head_dim // 2]
    kernel(f"nvfp4_decode_gemm<{warps}, {depth}, {nt}, {epi}>", x.device)(
        (rg, 1, 1), (warps * 32, 1, 1),
        [codes, scales, x, out, gscale, m, n, ch, x.stride(0), out.stride(0), *rope_args], pdl)
    return out


def dequant(codes, scales, gscale, n: int, k: int, swiglu: bool = False, pdl: bool = False):
    """bf16 [n, k] = e2m1 * scale * weight_scale_2 (swiglu: the interleaved gate/up rows put back in
    checkpoint order [gate; up])."""
    rg, ch, _ = codes.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=codes.device)
    kernel(f"nvfp4_decode_dequant<{int(swiglu)}>", codes.device)(
        (rg, -(-ch // 8), 1), (256, 1, 1), [codes, scales, out, gscale, n, k, ch, out.stride(0)], pdl)
    return out
