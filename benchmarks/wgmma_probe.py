"""Probe: the CUDA decode GEMM's weight decode feeding Hopper's warpgroup MMA (wgmma) instead of mma.sync, so
that x is read from shared memory once per 64 weight rows by the tensor cores (plain epilogue only).

    python benchmarks/wgmma_probe.py [--ms 1,8,16,32,64] [--variants 4x2,8x2,16x2,8x2w,8x2o] [--shapes ...]
    python benchmarks/wgmma_probe.py --sass LIBNVRTC      # offline: registers and loop length, no GPU

Why: with mma.sync every warp loads its own B fragments of x, 4 M / 16 bytes of x per byte of FP4 weights
(16 rows per warp): at M = 16 the x reads through L1 are 4x the weight bytes, and M = 9..16 lose 19-36% to
M = 8 (docs/benchmarks.md, nineteenth session). wgmma.m64nNk16 takes A (the decoded weights) from the
registers of a warpgroup's four warps, each warp's 16 rows in the mma.sync A fragment layout (so the
r16c64 decode is reused as it is), and B (x, N = 8..64 tokens) from shared memory: x is read once per 64
rows.

The probe's kernel: one warpgroup (4 warps, 4 row groups = 64 rows) per CTA, CTAs split K S ways
(blockIdx.y), a ring of D chunks of weights per lane as in the shipped kernel; each chunk's x (N tokens x 64
elements, in the K order of the A fragments: mma j of a chunk takes elements 16t + 4j + 0..3) is loaded one
16-byte piece per thread D - 1 chunks ahead and stored into a 2-stage shared-memory ring of wgmma core
matrices (no swizzle); per chunk: decode, wgmma.fence, four m64nNk16, commit, wait. The K splits add their
float32 partials with atomicAdd into a zeroed float32 output (not deterministic: a probe, not a backend;
the timing leaves out the zeroing). Variants SxD (K splits x ring depth); SxDw stages all of a CTA's x once
before a barrier-free loop (`wgmma_probe_whole`), SxDo overlaps the next chunk's decode with the wgmmas
over three x stages (`wgmma_probe_ov`); both measured slower (docs/benchmarks.md, twentieth session).
Checked against dequantize + bf16 matmul, timed like rows_per_warp.py (CUDA-graph replays over >= 400 MB of
weights, median of 7, PDL on) next to the shipped kernel (cuda.plan's configuration; 16-row slices above 16
rows) and the Triton backend. The first (shape, M) also tries both readings of the descriptor's two
offsets and keeps the first that is right; with one 8-token block (M <= 8) both give the same result, so the
M >= 9 variants' own checks (with the K-step reading, as the PTX ISA words it) are what confirm it.
Its three kernels repeat their decode, x store and epilogue on purpose: sharing them changed the compiled
code and the one-token-tile timings (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pieceworks.backends import nvrtc  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda_device import DEVICE_HELPERS  # noqa: E402

SOURCE = DEVICE_HELPERS + r"""
typedef unsigned long long u64;

// B descriptor of a no-swizzle K-major operand (wgmma matrix descriptor): start address, leading byte
// offset (between core matrices adjacent in K), stride byte offset (adjacent in N), all >> 4.
__device__ __forceinline__ u64 bdesc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// D += A (registers: this warp's 16 rows, the mma.sync A fragment) * B (shared memory, 16 x 8 NT)
template <int NT> __device__ __forceinline__ void wgmma(float* d, const u32* a, u64 b);
template <> __device__ __forceinline__ void wgmma<1>(float* d, const u32* a, u64 b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <> __device__ __forceinline__ void wgmma<2>(float* d, const u32* a, u64 b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <> __device__ __forceinline__ void wgmma<4>(float* d, const u32* a, u64 b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <> __device__ __forceinline__ void wgmma<8>(float* d, const u32* a, u64 b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// y[M, N] += x[M, K] @ dequant(W).T over this CTA's K split; M <= 8 NT. CTA blockIdx.x: row groups 4 b .. 4 b + 3
// (warp w the (4 b + w)-th, clamped to the last: read, never stored); blockIdx.y: a contiguous run of chunks.
// LBO_K: 1 = the leading byte offset is the K step between core matrices (the PTX ISA's wording), 0 = swapped.
template <int NT, int D, int LBO_K>
__global__ void __launch_bounds__(128) wgmma_probe(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    float* __restrict__ out, const float* __restrict__ gscale, int M, int N, int nchunks, int ldx, int ldo, int nrg)
{
    constexpr int STAGE = 4 * 2 * NT * 128;  // a chunk's x: [step j][core matrix kc][token block][8 x 16 B]
    constexpr int PX = (64 * NT + 127) / 128;  // 16-byte pieces of a chunk's x per thread
    __shared__ __align__(128) unsigned char xs[2 * STAGE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int split = blockIdx.y, S = gridDim.y;
    const int c_begin = (nchunks * split) / S, nc = (nchunks * (split + 1)) / S - c_begin;
    const int rg = min((int)blockIdx.x * 4 + warp, nrg - 1);
    const U4* cp = codes + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    const u16* sp = scales + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    // piece p of a chunk: token n = p >> 3, elements 8 q .. 8 q + 7 (q = p & 7) of the chunk
    const u16* xp[PX];
    bool xon[PX];
#pragma unroll
    for (int i = 0; i < PX; ++i) {
        const int p = threadIdx.x + 128 * i, n = p >> 3;
        xon[i] = p < 64 * NT && n < M;
        xp[i] = x + (size_t)min(n, M - 1) * ldx + (size_t)c_begin * 64 + 8 * (p & 7);
    }
    U4 w[D], xr[D][PX];
    u32 s[D];
    float acc[4 * NT];
#pragma unroll
    for (int e = 0; e < 4 * NT; ++e) acc[e] = 0.f;
#pragma unroll
    for (int b = 0; b < D; ++b)
#pragma unroll
        for (int i = 0; i < PX; ++i) xr[b][i] = U4{0, 0, 0, 0};
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        ld_stream(w[b], cp + b * 32, b < nc);
        ld_scale(s[b], sp + b * 32, b < nc);
    }
    PDL_WAIT();
#pragma unroll
    for (int b = 0; b < D - 1; ++b)
#pragma unroll
        for (int i = 0; i < PX; ++i) ld_x(xr[b][i], (const U4*)(xp[i] + b * 64), xon[i] && b < nc);
    const u32 xs0 = (u32)__cvta_generic_to_shared(xs);
    const u32 lbo = LBO_K ? NT * 128 : 128, sbo = LBO_K ? 128 : NT * 128;
    // COMPUTE(B, C): chunk C (ring slot B): its x into stage C & 1, then decode and four wgmmas
#define COMPUTE(B, C) do { \
        _Pragma("unroll") for (int i = 0; i < PX; ++i) { \
            const int p = threadIdx.x + 128 * i; \
            if (p < 64 * NT) { \
                const int n = p >> 3, q = p & 7, tt = q >> 1, h = q & 1; \
                const u32 v[4] = {xr[B][i].x, xr[B][i].y, xr[B][i].z, xr[B][i].w}; \
                _Pragma("unroll") for (int e = 0; e < 4; ++e) { \
                    const int j = 2 * h + (e >> 1), kc = e & 1; \
                    *(u32*)(xs + ((C) & 1) * STAGE + ((j * 2 + kc) * NT + (n >> 3)) * 128 + (n & 7) * 16 + 4 * tt) \
                        = v[e]; \
                } \
            } \
        } \
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); \
        __syncthreads(); \
        const u32 hh = scale_pair(s[B]); \
        const u32 sg = prmt(hh, 0x1010u), sh = prmt(hh, 0x3232u); \
        u32 a[4][4]; \
        a[0][0] = bmul(slot<0>(w[B].x), sg); a[0][1] = bmul(slot<0>(w[B].z), sh); \
        a[0][2] = bmul(slot<0>(w[B].y), sg); a[0][3] = bmul(slot<0>(w[B].w), sh); \
        a[1][0] = bmul(slot<1>(w[B].x), sg); a[1][1] = bmul(slot<1>(w[B].z), sh); \
        a[1][2] = bmul(slot<1>(w[B].y), sg); a[1][3] = bmul(slot<1>(w[B].w), sh); \
        a[2][0] = bmul(slot<2>(w[B].x), sg); a[2][1] = bmul(slot<2>(w[B].z), sh); \
        a[2][2] = bmul(slot<2>(w[B].y), sg); a[2][3] = bmul(slot<2>(w[B].w), sh); \
        a[3][0] = bmul(slot<3>(w[B].x), sg); a[3][1] = bmul(slot<3>(w[B].z), sh); \
        a[3][2] = bmul(slot<3>(w[B].y), sg); a[3][3] = bmul(slot<3>(w[B].w), sh); \
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); \
        _Pragma("unroll") for (int j = 0; j < 4; ++j) \
            wgmma<NT>(acc, a[j], bdesc(xs0 + ((C) & 1) * STAGE + j * 2 * NT * 128, lbo, sbo)); \
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); \
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); \
    } while (0)
    int c = 0;
    for (; c + D <= nc; c += D) {
#pragma unroll
        for (int b = 0; b < D; ++b) {
            const int nb = (b + D - 1) % D;
            ld_stream(w[nb], cp + (b + D - 1) * 32, c + b + D - 1 < nc);
            ld_scale(s[nb], sp + (b + D - 1) * 32, c + b + D - 1 < nc);
#pragma unroll
            for (int i = 0; i < PX; ++i)
                ld_x(xr[nb][i], (const U4*)(xp[i] + (b + D - 1) * 64), xon[i] && c + b + D - 1 < nc);
            COMPUTE(b, c + b);
        }
        cp += D * 32;
        sp += D * 32;
#pragma unroll
        for (int i = 0; i < PX; ++i) xp[i] += D * 64;
    }
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        if (c + b < nc) COMPUTE(b, c + b);
    }
#undef COMPUTE
    PDL_TRIGGER();
    // acc[4 i + e]: row 16 warp + g + 8 (e >> 1) of the CTA's 64, token 8 i + 2 t + (e & 1)
    const float gs = *gscale * 16384.0f;
    const bool mine = (int)blockIdx.x * 4 + warp < nrg;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int token = 8 * i + 2 * t + (e & 1), n = (int)blockIdx.x * 64 + warp * 16 + g + 8 * (e >> 1);
            if (mine && token < M && n < N) atomicAdd(out + (size_t)token * ldo + n, acc[4 * i + e] * gs);
        }
}

// The same with all of this CTA's x staged in shared memory once (dynamic, nc chunks of STAGE bytes) before
// the main loop, which then has no barrier: per chunk, the wgmmas of chunk c are issued, chunk c + 1 is
// decoded while they run (its registers are not those of chunk c: c's A fragments are kept live until the
// wait), then the wait; the ring keeps chunks c + 1 .. c + D in flight. D even.
template <int NT, int D>
__global__ void __launch_bounds__(128) wgmma_probe_whole(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    float* __restrict__ out, const float* __restrict__ gscale, int M, int N, int nchunks, int ldx, int ldo, int nrg)
{
    static_assert(D % 2 == 0, "the A fragments alternate between two register sets");
    constexpr int STAGE = 4 * 2 * NT * 128;
    extern __shared__ __align__(128) unsigned char xs[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int split = blockIdx.y, S = gridDim.y;
    const int c_begin = (nchunks * split) / S, nc = (nchunks * (split + 1)) / S - c_begin;
    const int rg = min((int)blockIdx.x * 4 + warp, nrg - 1);
    const U4* cp = codes + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    const u16* sp = scales + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    U4 w[D];
    u32 s[D];
    float acc[4 * NT];
#pragma unroll
    for (int e = 0; e < 4 * NT; ++e) acc[e] = 0.f;
#pragma unroll
    for (int b = 0; b < D; ++b) {
        ld_stream(w[b], cp + b * 32, b < nc);
        ld_scale(s[b], sp + b * 32, b < nc);
    }
    PDL_WAIT();
    // x: piece p = (chunk, token n, 16-byte piece q), eight loads in flight per thread, then their stores
    const int total = nc * 64 * NT;
    for (int base = threadIdx.x; base < total; base += 128 * 8) {
        U4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int p = base + 128 * u, r = p % (64 * NT), n = r >> 3;
            v[u] = U4{0, 0, 0, 0};
            ld_x(v[u], (const U4*)(x + (size_t)min(n, M - 1) * ldx + (size_t)(c_begin + p / (64 * NT)) * 64
                                   + 8 * (r & 7)), p < total && n < M);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int p = base + 128 * u, c = p / (64 * NT), r = p % (64 * NT), n = r >> 3, q = r & 7;
            if (p < total) {
                const u32 vv[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = 2 * (q & 1) + (e >> 1), kc = e & 1;
                    *(u32*)(xs + c * STAGE + ((j * 2 + kc) * NT + (n >> 3)) * 128 + (n & 7) * 16 + 4 * (q >> 1))
                        = vv[e];
                }
            }
        }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const u32 xs0 = (u32)__cvta_generic_to_shared(xs);
    u32 a[2][4][4];
#define DECODE(B, A) do { \
        const u32 hh = scale_pair(s[B]); \
        const u32 sg = prmt(hh, 0x1010u), sh = prmt(hh, 0x3232u); \
        a[A][0][0] = bmul(slot<0>(w[B].x), sg); a[A][0][1] = bmul(slot<0>(w[B].z), sh); \
        a[A][0][2] = bmul(slot<0>(w[B].y), sg); a[A][0][3] = bmul(slot<0>(w[B].w), sh); \
        a[A][1][0] = bmul(slot<1>(w[B].x), sg); a[A][1][1] = bmul(slot<1>(w[B].z), sh); \
        a[A][1][2] = bmul(slot<1>(w[B].y), sg); a[A][1][3] = bmul(slot<1>(w[B].w), sh); \
        a[A][2][0] = bmul(slot<2>(w[B].x), sg); a[A][2][1] = bmul(slot<2>(w[B].z), sh); \
        a[A][2][2] = bmul(slot<2>(w[B].y), sg); a[A][2][3] = bmul(slot<2>(w[B].w), sh); \
        a[A][3][0] = bmul(slot<3>(w[B].x), sg); a[A][3][1] = bmul(slot<3>(w[B].z), sh); \
        a[A][3][2] = bmul(slot<3>(w[B].y), sg); a[A][3][3] = bmul(slot<3>(w[B].w), sh); \
    } while (0)
    // STEP(B, C, LOAD): chunk C (ring slot B, A set B & 1): its wgmmas, chunk C + D's loads into slot B (decoded
    // already), chunk C + 1 decoded, then the wait; C's A fragments stay live up to it
#define STEP(B, C, LOAD) do { \
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); \
        _Pragma("unroll") for (int j = 0; j < 4; ++j) \
            wgmma<NT>(acc, a[(B) & 1][j], bdesc(xs0 + (C) * STAGE + j * 2 * NT * 128, NT * 128, 128)); \
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); \
        if (LOAD) { \
            ld_stream(w[B], cp + ((B) + D) * 32, (C) + D < nc); \
            ld_scale(s[B], sp + ((B) + D) * 32, (C) + D < nc); \
        } \
        if ((C) + 1 < nc) DECODE(((B) + 1) % D, ((B) + 1) & 1); \
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); \
        _Pragma("unroll") for (int j = 0; j < 4; ++j) \
            asm volatile("" :: "r"(a[(B) & 1][j][0]), "r"(a[(B) & 1][j][1]), "r"(a[(B) & 1][j][2]), \
                         "r"(a[(B) & 1][j][3])); \
    } while (0)
    if (nc > 0) DECODE(0, 0);
    int c = 0;
    for (; c + D <= nc; c += D) {
#pragma unroll
        for (int b = 0; b < D; ++b) STEP(b, c + b, true);
        cp += D * 32;
        sp += D * 32;
    }
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        if (c + b < nc) STEP(b, c + b, false);
    }
#undef STEP
#undef DECODE
    PDL_TRIGGER();
    const float gs = *gscale * 16384.0f;
    const bool mine = (int)blockIdx.x * 4 + warp < nrg;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int token = 8 * i + 2 * t + (e & 1), n = (int)blockIdx.x * 64 + warp * 16 + g + 8 * (e >> 1);
            if (mine && token < M && n < N) atomicAdd(out + (size_t)token * ldo + n, acc[4 * i + e] * gs);
        }
}

// The 2-stage ring's kernel with the decode of chunk c + 1 overlapping chunk c's wgmmas: 3 x stages (stage
// (c + 1) % 3 is written in step c, after every warp's wait for chunk c - 2, which read it, and the barrier of
// step c - 1). Step c: x of chunk c + 1 into its stage, fence, barrier; chunk c's wgmmas (x stored in step
// c - 1); chunk c + 1 decoded; wait (c's A fragments live up to it); chunk c + D's weights and x loads.
template <int NT, int D>
__global__ void __launch_bounds__(128) wgmma_probe_ov(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    float* __restrict__ out, const float* __restrict__ gscale, int M, int N, int nchunks, int ldx, int ldo, int nrg)
{
    static_assert(D % 2 == 0, "the A fragments alternate between two register sets");
    constexpr int STAGE = 4 * 2 * NT * 128;
    constexpr int PX = (64 * NT + 127) / 128;
    __shared__ __align__(128) unsigned char xs[3 * STAGE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int split = blockIdx.y, S = gridDim.y;
    const int c_begin = (nchunks * split) / S, nc = (nchunks * (split + 1)) / S - c_begin;
    const int rg = min((int)blockIdx.x * 4 + warp, nrg - 1);
    const U4* cp = codes + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    const u16* sp = scales + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    const u16* xp[PX];
    bool xon[PX];
#pragma unroll
    for (int i = 0; i < PX; ++i) {
        const int p = threadIdx.x + 128 * i, n = p >> 3;
        xon[i] = p < 64 * NT && n < M;
        xp[i] = x + (size_t)min(n, M - 1) * ldx + (size_t)c_begin * 64 + 8 * (p & 7);
    }
    U4 w[D], xr[D][PX];
    u32 s[D];
    float acc[4 * NT];
#pragma unroll
    for (int e = 0; e < 4 * NT; ++e) acc[e] = 0.f;
#pragma unroll
    for (int b = 0; b < D; ++b) {
#pragma unroll
        for (int i = 0; i < PX; ++i) xr[b][i] = U4{0, 0, 0, 0};
        ld_stream(w[b], cp + b * 32, b < nc);
        ld_scale(s[b], sp + b * 32, b < nc);
    }
    PDL_WAIT();
#pragma unroll
    for (int b = 0; b < D; ++b)
#pragma unroll
        for (int i = 0; i < PX; ++i) ld_x(xr[b][i], (const U4*)(xp[i] + b * 64), xon[i] && b < nc);
    const u32 xs0 = (u32)__cvta_generic_to_shared(xs);
    u32 a[2][4][4];
#define STORE_X(B, C) do { \
        _Pragma("unroll") for (int i = 0; i < PX; ++i) { \
            const int p = threadIdx.x + 128 * i; \
            if (p < 64 * NT) { \
                const int n = p >> 3, q = p & 7; \
                const u32 v[4] = {xr[B][i].x, xr[B][i].y, xr[B][i].z, xr[B][i].w}; \
                _Pragma("unroll") for (int e = 0; e < 4; ++e) { \
                    const int j = 2 * (q & 1) + (e >> 1), kc = e & 1; \
                    *(u32*)(xs + ((C) % 3) * STAGE + ((j * 2 + kc) * NT + (n >> 3)) * 128 + (n & 7) * 16 \
                            + 4 * (q >> 1)) = v[e]; \
                } \
            } \
        } \
    } while (0)
#define DECODE(B, A) do { \
        const u32 hh = scale_pair(s[B]); \
        const u32 sg = prmt(hh, 0x1010u), sh = prmt(hh, 0x3232u); \
        a[A][0][0] = bmul(slot<0>(w[B].x), sg); a[A][0][1] = bmul(slot<0>(w[B].z), sh); \
        a[A][0][2] = bmul(slot<0>(w[B].y), sg); a[A][0][3] = bmul(slot<0>(w[B].w), sh); \
        a[A][1][0] = bmul(slot<1>(w[B].x), sg); a[A][1][1] = bmul(slot<1>(w[B].z), sh); \
        a[A][1][2] = bmul(slot<1>(w[B].y), sg); a[A][1][3] = bmul(slot<1>(w[B].w), sh); \
        a[A][2][0] = bmul(slot<2>(w[B].x), sg); a[A][2][1] = bmul(slot<2>(w[B].z), sh); \
        a[A][2][2] = bmul(slot<2>(w[B].y), sg); a[A][2][3] = bmul(slot<2>(w[B].w), sh); \
        a[A][3][0] = bmul(slot<3>(w[B].x), sg); a[A][3][1] = bmul(slot<3>(w[B].z), sh); \
        a[A][3][2] = bmul(slot<3>(w[B].y), sg); a[A][3][3] = bmul(slot<3>(w[B].w), sh); \
    } while (0)
#define STEP(B, C, LOAD) do { \
        if ((C) + 1 < nc) STORE_X(((B) + 1) % D, (C) + 1); \
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); \
        __syncthreads(); \
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); \
        _Pragma("unroll") for (int j = 0; j < 4; ++j) \
            wgmma<NT>(acc, a[(B) & 1][j], bdesc(xs0 + ((C) % 3) * STAGE + j * 2 * NT * 128, NT * 128, 128)); \
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); \
        if ((C) + 1 < nc) DECODE(((B) + 1) % D, ((B) + 1) & 1); \
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); \
        _Pragma("unroll") for (int j = 0; j < 4; ++j) \
            asm volatile("" :: "r"(a[(B) & 1][j][0]), "r"(a[(B) & 1][j][1]), "r"(a[(B) & 1][j][2]), \
                         "r"(a[(B) & 1][j][3])); \
        if (LOAD) { \
            ld_stream(w[B], cp + ((B) + D) * 32, (C) + D < nc); \
            ld_scale(s[B], sp + ((B) + D) * 32, (C) + D < nc); \
            _Pragma("unroll") for (int i = 0; i < PX; ++i) \
                ld_x(xr[B][i], (const U4*)(xp[i] + ((B) + D) * 64), xon[i] && (C) + D < nc); \
        } \
    } while (0)
    if (nc > 0) {
        STORE_X(0, 0);
        DECODE(0, 0);
    }
    int c = 0;
    for (; c + D <= nc; c += D) {
#pragma unroll
        for (int b = 0; b < D; ++b) STEP(b, c + b, true);
        cp += D * 32;
        sp += D * 32;
#pragma unroll
        for (int i = 0; i < PX; ++i) xp[i] += D * 64;
    }
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        if (c + b < nc) STEP(b, c + b, false);
    }
#undef STEP
#undef DECODE
#undef STORE_X
    PDL_TRIGGER();
    const float gs = *gscale * 16384.0f;
    const bool mine = (int)blockIdx.x * 4 + warp < nrg;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int token = 8 * i + 2 * t + (e & 1), n = (int)blockIdx.x * 64 + warp * 16 + g + 8 * (e >> 1);
            if (mine && token < M && n < N) atomicAdd(out + (size_t)token * ldo + n, acc[4 * i + e] * gs);
        }
}
"""


def probe_gemm(x, codes, scales, gscale, n: int, splits: int, depth: int, out=None, lbo_k: int = 1,
               pdl: bool = True, whole: bool = False, overlap: bool = False):
    """out (float32 [M, n], zeroed by the caller for a correct result) += the probe's GEMM (whole: x staged
    once, `wgmma_probe_whole`; overlap: `wgmma_probe_ov`)."""
    m, k = x.shape
    nrg, nch, _ = codes.shape
    nt = max(1, 1 << (-(-m // 8) - 1).bit_length())  # 1, 2, 4, 8 token tiles
    if out is None:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    args = [codes, scales, x, out, gscale, m, n, nch, x.stride(0), out.stride(0), nrg]
    if whole:
        shared = -(-nch // splits) * 8 * nt * 128
        if shared > 200 * 1024:
            raise ValueError(f"{shared} bytes of x per CTA: more splits")
        run = nvrtc.kernel(SOURCE, f"wgmma_probe_whole<{nt}, {depth}>", x.device, suffix="a")
        run((-(-nrg // 4), splits, 1), (128, 1, 1), args, pdl, shared=shared)
    elif overlap:
        run = nvrtc.kernel(SOURCE, f"wgmma_probe_ov<{nt}, {depth}>", x.device, suffix="a")
        run((-(-nrg // 4), splits, 1), (128, 1, 1), args, pdl)
    else:
        run = nvrtc.kernel(SOURCE, f"wgmma_probe<{nt}, {depth}, {lbo_k}>", x.device, suffix="a")
        run((-(-nrg // 4), splits, 1), (128, 1, 1), args, pdl)
    return out


def sass(lib: str) -> None:
    from cuda_sass import compiled, main_loop, use_nvrtc

    use_nvrtc(lib)
    for nt in (1, 2, 4, 8):
        for name in ([f"wgmma_probe<{nt}, {d}, 1>" for d in (2, 4)] + [f"wgmma_probe_whole<{nt}, {d}>" for d in (2, 4)]
                     + [f"wgmma_probe_ov<{nt}, {d}>" for d in (2, 4)]):
            d = int(name.split(", ")[1].rstrip(">"))
            regs, listing = compiled(SOURCE, name, "sm_90a")
            loop = main_loop(listing, "HGMMA")
            wg = sum("HGMMA" in line for line in listing.splitlines())
            print(f"{name}: {regs} registers, main loop {len(loop)} instructions per {d} chunks, {wg} HGMMA in all")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--variants", default="4x2,8x2,16x2,8x4")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--sass", metavar="LIBNVRTC", help="offline: registers and loop lengths, then exit")
    args = ap.parse_args()
    if args.sass:
        return sass(args.sass)
    from fp4_gemm import SHAPES, copies_for, graph_time, random_weights
    from pieceworks.backends.base import BackendSpec
    from pieceworks.backends.fp4_gemm import r16c64
    from pieceworks.backends.fp4_gemm.base import Fp4Weight
    from pieceworks.backends.fp4_gemm.cuda import CudaFp4GemmBackend
    from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend
    from pieceworks.quant import nvfp4

    variants = []
    for v in args.variants.split(","):
        found = re.fullmatch(r"(\d+)x(\d+)([wo]?)", v)
        if not found:
            raise SystemExit(f"variant {v!r}: expected SxD, SxDw or SxDo")
        variants.append((int(found[1]), int(found[2]), found[3]))
    spec = BackendSpec.for_device("cuda", fp4_numerics="w4a16")
    shipped, triton = CudaFp4GemmBackend(spec), TritonFp4GemmBackend(spec)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lbo_k = None
    for name in (args.shapes.split(",") if args.shapes else SHAPES):
        n, k = SHAPES[name]
        copies = copies_for(n * k * 0.5625)
        raw = [Fp4Weight(w, s, gs, torch.ones((), device="cuda")) for w, s, gs in random_weights(n, k, copies, gen)]
        r16 = [(*r16c64.repack_decode(w.weight, w.weight_scale), w.weight_scale_2) for w in raw]
        cu = [shipped.prepare(w) for w in raw]
        tr = [triton.prepare(w) for w in raw]
        wd = nvfp4.dequantize(raw[0].weight, raw[0].weight_scale, raw[0].weight_scale_2, torch.bfloat16)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = (x @ wd.t()).float()
            if lbo_k is None:  # which reading of the descriptor's two offsets is right (the other one is not)
                errs = {lk: float((probe_gemm(x, *r16[0], n, 4, 2, lbo_k=lk) - ref).norm() / ref.norm())
                        for lk in (1, 0)}
                print(f"descriptor check {name} M={m}: relative error with LBO = K step {errs[1]:.3g}, swapped "
                      f"{errs[0]:.3g}", flush=True)
                lbo_k = 1 if errs[1] < 1e-2 else 0 if errs[0] < 1e-2 else None
                if lbo_k is None:
                    raise SystemExit("neither descriptor reading gives the reference")
            cells = ["shipped=%.2f" % (1e6 * graph_time(lambda i: shipped.forward(x, *cu[i % copies], n), copies)),
                     "triton=%.2f" % (1e6 * graph_time(lambda i: triton.forward(x, *tr[i % copies], n), copies))]
            out = torch.zeros(m, n, dtype=torch.float32, device="cuda")
            for sp, d, kind in variants:
                label = f"{sp}x{d}{kind}"
                opts = dict(lbo_k=lbo_k, whole=kind == "w", overlap=kind == "o")
                try:
                    y = probe_gemm(x, *r16[0], n, sp, d, **opts)
                except ValueError as e:
                    cells.append(f"{label}=- ({e})")
                    continue
                err = float((y - ref).norm() / ref.norm())
                if not err < 1e-2:
                    raise SystemExit(f"{name} M={m} {label}: relative error {err:.3g}")
                t = graph_time(lambda i: probe_gemm(x, *r16[i % copies], n, sp, d, out=out, **opts), copies)
                cells.append(f"{label}={t * 1e6:.2f}")
            print(f"{name} M={m}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
