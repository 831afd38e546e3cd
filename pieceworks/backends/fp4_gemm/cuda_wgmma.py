"""The `cuda` fp4_gemm backend's GEMM for 17..64 rows of x on Hopper (sm_90a): the decode GEMM's r16c64
decode feeding warpgroup MMAs (wgmma), so that x is read from shared memory once per 64 weight rows
instead of once per warp. Imports torch only; each template instance is compiled on its first launch.

Why (docs/benchmarks.md, twentieth session, benchmarks/wgmma_probe.py): with mma.sync every warp loads its
own B fragments of x, 4 M / 16 bytes of x per byte of weights, so the decode kernel runs 17..64 rows as
16-row slices that read the weights again (batch 32: 23% behind the Triton backend). wgmma.m64nNk16 takes
A from the registers of a warpgroup's four warps, each warp's 16 rows in mma.sync's A fragment layout
(the r16c64 decode as it is), and B (x, N = 8 NT tokens) from shared memory.

The kernel: a CTA is one warpgroup, 4 row groups (64 weight rows); S CTAs (blockIdx.y) split K into
contiguous runs of 64-element chunks. Per lane a register ring of D chunks of
codes and scales (as the decode kernel's); each chunk's x (N tokens x 64 elements, in the A fragments' K
order: k16 step j of a chunk takes elements 16 t + 4 j + 0..3) is loaded one 16-byte piece per thread D - 1
chunks ahead and stored into a two-stage shared-memory ring of wgmma core matrices (no swizzle: 8 tokens x
16 bytes each; the leading byte offset steps K, the stride byte offset steps 8 tokens); per chunk a CTA
barrier, the decode, four wgmmas, commit, wait. Each CTA then writes its float32 partials to a workspace
and counts itself in at its row block's counter; the last of the S to arrive sums the partials in split
order (deterministic: the same bits whatever the timing) and stores the 64 rows with the plain, SwiGLU or
rope epilogue (rounded as the decode kernel's: cuda_device.py), then zeroes the counter. (A thread-block
cluster summing through distributed shared memory instead was correct and slower: its CTAs wait for each
other; docs/benchmarks.md.)
"""

from __future__ import annotations

from functools import lru_cache

import torch

from pieceworks.backends.fp4_gemm.cuda_device import DEVICE_HELPERS
from pieceworks.backends.fp4_gemm.r16c64 import CHUNK
from pieceworks.backends.nvrtc import kernel

MAX_M = 64  # 8 token tiles: wgmma m64n64k16
COUNTERS = 1024  # row blocks of 64 rows a counter tensor serves (N up to 65536)

SOURCE = DEVICE_HELPERS + r"""
typedef unsigned long long u64;

// B descriptor of a no-swizzle K-major operand in shared memory: start address, leading byte offset (between
// core matrices adjacent in K), stride byte offset (adjacent in N), each >> 4.
__device__ __forceinline__ u64 bdesc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// D (64 rows x 8 NT tokens, float) += A (registers: this warp's 16 rows, the mma.sync A fragment) * B (16 x 8 NT)
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

// y = x @ dequant(W).T for M <= 8 NT rows of x. CTA (blockIdx.x, blockIdx.y): row groups 4 blockIdx.x .. + 3
// (warp w the (4 blockIdx.x + w)-th, clamped to the last: read, never stored) over chunk run blockIdx.y of
// S = gridDim.y; its partial sums go to part[blockIdx.x][blockIdx.y] ([64 rows][8 NT tokens] float32) and the
// last CTA of a row block to arrive at counters[blockIdx.x] (zero before the call, zero again after it) sums
// them in split order and stores the rows. EPI 0: out[token, n] = y; EPI 1 (rows 2j / 2j + 1 gate / up,
// interleave_gate_up): out[token, n / 2] = silu(gate) * up; EPI 2 (q/k/v rope, rows in the interleave_rope_rows
// order): the q/k pairs below rope_cols rotated by cos / sin [M, half] (float32, row strides ldc / lds), every
// column stored in checkpoint order.
template <int NT, int D, int EPI>
__global__ void __launch_bounds__(128) nvfp4_wgmma_gemm(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ out, const float* __restrict__ gscale, int M, int N, int nchunks, int ldx, int ldo, int nrg,
    const float* __restrict__ cosp, const float* __restrict__ sinp, int ldc, int lds, int rope_cols, int half,
    float* __restrict__ part, int* __restrict__ counters)
{
    constexpr int STAGE = 4 * 2 * NT * 128;  // a chunk's x: [k16 step j][core matrix kc][token block][8 x 16 B]
    constexpr int PX = (64 * NT + 127) / 128;  // 16-byte pieces of a chunk's x per thread
    constexpr int T = 8 * NT;  // tokens
    __shared__ __align__(128) unsigned char xs[2 * STAGE];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int S = gridDim.y;
    const int c_begin = (nchunks * (int)blockIdx.y) / S, nc = (nchunks * ((int)blockIdx.y + 1)) / S - c_begin;
    const int rg = min((int)blockIdx.x * 4 + warp, nrg - 1);
    const U4* cp = codes + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    const u16* sp = scales + ((size_t)rg * nchunks + c_begin) * 32 + lane;
    // piece p of a chunk's x: token n = p >> 3, elements 8 q .. 8 q + 7 (q = p & 7); tokens >= M stay zero
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
    // the weights are never written by an earlier kernel: their first loads go before the PDL wait
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
    // COMPUTE(B, C): chunk C from ring slot B. Its x into stage C & 1: the 16-byte piece q of token n holds
    // elements 16 t + 8 h + 0..7 (t = q >> 1, h = q & 1); its 4-byte piece e (elements 16 t + 8 h + 2 e, + 1) is
    // k16 step j = 2 h + (e >> 1), core matrix kc = e & 1, bytes 4 t of token n's row. (Stage C & 1 was last read
    // by chunk C - 2's wgmmas, which every warp waited for before the barrier of chunk C - 1.)
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
            wgmma<NT>(acc, a[j], bdesc(xs0 + ((C) & 1) * STAGE + j * 2 * NT * 128, NT * 128, 128)); \
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
    // the last nc % D chunks are in ring slots 0 .. nc % D - 1 already
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        if (c + b < nc) COMPUTE(b, c + b);
    }
#undef COMPUTE
    PDL_TRIGGER();
    // acc[4 i + e]: row 16 warp + g + 8 (e >> 1) of the CTA's 64, token 8 i + 2 t + (e & 1)
    float* mine = part + ((size_t)blockIdx.x * S + blockIdx.y) * 64 * T;
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[(warp * 16 + g + 8 * (e >> 1)) * T + 8 * i + 2 * t + (e & 1)] = acc[4 * i + e];
    // publish the partials, count this CTA; the last of the row block's S reads them all (from L2) in order
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == S - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* ps = part + (size_t)blockIdx.x * S * 64 * T;
    const float gs = *gscale * 16384.0f;
    if (EPI == 0) {
        for (int idx = threadIdx.x; idx < 64 * T; idx += 128) {
            const int r = idx / T, token = idx % T, n = (int)blockIdx.x * 64 + r;
            float v = 0.f;
            for (int q = 0; q < S; ++q) v += __ldcg(ps + (size_t)q * 64 * T + idx);
            if (token < M && n < N) out[(size_t)token * ldo + n] = to_bf16(v * gs);
        }
    } else {
        for (int idx = threadIdx.x; idx < 32 * T; idx += 128) {
            const int r = 2 * (idx / T), token = idx % T;  // rows r (gate, or rope dim d) and r + 1
            float vg = 0.f, vu = 0.f;
            for (int q = 0; q < S; ++q) {
                vg += __ldcg(ps + (size_t)q * 64 * T + r * T + token);
                vu += __ldcg(ps + (size_t)q * 64 * T + (r + 1) * T + token);
            }
            const int n = (int)blockIdx.x * 32 + r / 2;  // the pair's output column
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
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // for the next call
}
"""


def splits(nchunks: int, row_blocks: int) -> int:
    """The K split S (a power of two up to 8): doubled while every CTA
    keeps at least 8 chunks of K and the grid holds fewer than 1024 CTAs. On the H200 this picks each
    Llama-3.1-8B and DeepSeek-V3 expert shape's fastest split in wgmma_probe.py's sweep at M = 32 (8 for
    q/k/v, o, down and the expert gate/up, 4 for gate/up and the expert down)."""
    s = 1
    while s < 8 and 2 * s * 8 <= nchunks and row_blocks * s < 1024:
        s *= 2
    return s


@lru_cache(maxsize=None)
def supported(device: torch.device) -> bool:
    """wgmma needs sm_90a: the kernel runs on compute capability 9.0 only (not on Blackwell's 10.x)."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def wgmma_gemm(x, codes, scales, gscale, n: int, counters, swiglu: bool = False, pdl: bool = False, out=None,
               rope=None, depth: int = 2, split: int | None = None):
    """y = x @ dequant(W).T for M <= 64 (the arguments and epilogues of `cuda_decode.decode_gemm`, without its
    fused norm and residual). counters: int32 zeros, at least one per 64 weight rows, that the call leaves
    zero again (calls sharing them must run in order on one stream: under PDL a kernel touches them only
    after its wait). split: the K split S (1, 2, 4 or 8; None: `splits`)."""
    m, k = x.shape
    if m > MAX_M:
        raise ValueError(f"wgmma_gemm serves M <= {MAX_M}, got {m}")
    if k % CHUNK:  # the kernel reads x in whole chunks
        x = torch.nn.functional.pad(x, (0, CHUNK - k % CHUNK))
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned copy
    rg, ch, _ = codes.shape
    if out is None:
        out = torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out
    nt = 1 if m <= 8 else 2 if m <= 16 else 4 if m <= 32 else 8
    if rope is None:
        epi, rope_args = int(swiglu), [gscale, gscale, 0, 0, 0, 1]
    else:
        cos, sin, rope_cols, head_dim = rope
        cos, sin = cos.float(), sin.float()
        if cos.stride(-1) != 1 or sin.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        epi, rope_args = 2, [cos, sin, cos.stride(0), sin.stride(0), rope_cols, head_dim // 2]
    row_blocks = -(-rg // 4)
    s = splits(ch, row_blocks) if split is None else split
    if s not in (1, 2, 4, 8):
        raise ValueError(f"wgmma_gemm: split={s}: use 1, 2, 4 or 8")
    if counters.dtype != torch.int32 or counters.numel() < row_blocks:
        raise ValueError(f"wgmma_gemm: counters must be int32 zeros, at least {row_blocks}")
    part = torch.empty(row_blocks * s * 64 * 8 * nt, dtype=torch.float32, device=x.device)
    run = kernel(SOURCE, f"nvfp4_wgmma_gemm<{nt}, {depth}, {epi}>", x.device, suffix="a")
    run((row_blocks, s, 1), (128, 1, 1),
        [codes, scales, x, out, gscale, m, n, ch, x.stride(0), out.stride(0), rg, *rope_args, part, counters], pdl)
    return out
