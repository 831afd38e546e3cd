"""The CUDA decode GEMM of the `cuda` fp4_gemm backend (w4a16, M <= 16 per launch): the kernel source,
`SOURCE` (cuda_decode.py launches it). The device helpers it builds on (loads, decode, mma, epilogue
roundings) are in cuda_device.py; the weight layout ("r16c64") and its repack in r16c64.py; compiling
is backends/nvrtc.py's.

The Triton decode tiles reached 26-66% of the copy rate at M = 1 on the H200 (docs/benchmarks.md). This
kernel does the same arithmetic (e2m1 codes decoded to bf16 with integer ops, multiplied by the block
scale, bf16 mma.sync with the weights as the A operand) on a layout made for it:

- One CTA owns 16 weight rows and all of K; its W warps split K into contiguous runs of 64-element
  chunks, and a shared-memory sum of the warps' accumulators ends it (no split-K across CTAs, no
  counters, nothing to zero). The epilogue stores y, or silu(gate) * up, or the roped q/k/v columns.
- A lane reads one 16-byte vector of codes per chunk (rows g and g + 8, elements 16t .. 16t + 15: one
  NVFP4 block per row), so it converts two block scales per chunk (one 2-byte load) for its 32
  weights. The MMA's K order is permuted to match: mma j of a chunk, k slots (2t, 2t + 1, 2t + 8,
  2t + 9), are elements 16t + 4j + (0, 1, 2, 3), for the weights and x alike, so x needs no
  reordering (each lane reads 32 contiguous bytes of its token's row). The scale conversion and its
  2^112 / 2^-14 bias are triton_k32.py's.
- Every lane keeps D chunks of codes, scales and x in flight in registers (a ring, no shared memory;
  a cp.async version with shared-memory stages was slower: docs/benchmarks.md).
- Up to 8 tokens per mma (the B operand's 8 columns); 9..16 tokens run two n-tiles on the same decoded
  A registers. Lanes of tokens >= M read another token's row; those columns are never stored. With two
  n-tiles x stays out of the ring (loaded just before its chunk's mmas, from L1 / L2), and where the
  grid would not stay resident at the registers ptxas picks, the kernel is compiled with a cap of 64
  (`__launch_bounds__` with 32 / W CTAs per SM; `decode_gemm` asks the driver's occupancy calculator).

The kernel's MoE modes (MOE 1: grouped over expert-sorted blocks of pairs; MOE 2: one token's down GEMM
and top-k combine) are launched by backends/moe/cuda_kernels.py. Each template instance is compiled on
its first launch.

Template argument L 1 reads the Triton backend's k32 weights instead (k32.py: 64-row x 128-element
tiles; the `fp4_gemm.triton` backend runs its M <= 16 calls this way, `cuda_decode_max_m`): a chunk is one
tile's 128 elements of K, and lane (g, t) reads group t of rows g and g + 8 (two 16-byte vectors, two
scale pairs: blocks t and t + 4 of the tile) and the matching 32 elements of x. Slot j of a k32 unit u of
group t is element 16t + 64 (j >> 1) + 8 (j & 1) + u (`k32.element_of`), so slot j of a lane's code word
p is elements 16t + 64 (j >> 1) + 8 (j & 1) + 2p, + 1: mma (j, h) takes words 2h and 2h + 1 against x
elements 16t + 64 (j >> 1) + 8 (j & 1) + 4h .. + 3 (x[i][j], one 16-byte load; a quad's four loads for a
slot lie in one 128-byte line of x, as r16c64's do), the same instructions per weight as r16c64 (70.5 SASS
per 64 elements against 73.5). x is loaded just before its chunk (63 registers; a ring of it took 91, a
per-slot prefetch 70, both slower where they left fewer warps resident: docs/benchmarks.md). The groups
hold blocks t and t + 4 for this reading: with 32 consecutive elements per group a quad's x pieces lie 64
bytes apart (two lines per token and load) and M = 8 takes 1.16-1.26x the r16c64 kernel's time (L1 74% busy
against 53%, Nsight Compute); with blocks t and t + 4 it takes about the same. Two token tiles
take 82 registers: `cuda_launch.plan` counts 24 warps per SM for them (`K32_TWO_TILE_WARPS_PER_SM`).

The MoE modes take L 1 too (`moe.triton`'s decode steps, `cuda_moe_max_t`): an expert is 16 gridDim.x rows of
k32 tiles, and the gate/up GEMM (HALVES) reads the Triton MoE's layout, gate rows [0, Ip) and up rows
[Ip, 2Ip): CTA b's rows g are gate rows 8b + g and its rows g + 8 the up rows Ip + 8b + g, Ip / 64 row blocks
further on, so the SwiGLU epilogue pairs rows j and j + 8 (r16c64: 2j and 2j + 1). 72 registers:
`moe.cuda_kernels.resident_cap_moe` caps it at 64 where that keeps more CTAs resident.
"""

from __future__ import annotations

from pieceworks.backends.fp4_gemm.cuda_device import DEVICE_HELPERS


def instance(warps: int, depth: int, nt: int, epi: int, norm: int, moe: int, minb: int = 0, layout: int = 0) -> str:
    """The name NVRTC compiles for template arguments (W, D, NT, EPI, NORM, MOE, MINB, L), the defaulted
    trailing ones left out where zero (so each instance has one name, and one disk-cache entry)."""
    args = [warps, depth, nt, epi, norm, moe] + ([minb] if minb or layout else []) + ([layout] if layout else [])
    return f"nvfp4_decode_gemm<{', '.join(str(a) for a in args)}>"


SOURCE = DEVICE_HELPERS + r"""
// A chunk in flight: L 0 (r16c64): 64 elements of K, one code vector and one scale pair per lane; L 1 (k32): 128
// elements, rows g and g + 8 one code vector and one scale pair each.
template <int NT, int L> struct Chunk { U4 w[L + 1]; u32 s[L + 1]; U4 x[NT][2 * (L + 1)]; };

// mma j = J of a chunk for every n-tile: slot J of the four code words, scaled (row g: sg, row g + 8: sh),
// against x elements 16t + 4J .. 16t + 4J + 3 (B registers); accumulator chain J % 2.
template <int J, int NT>
__device__ __forceinline__ void slot_mmas(float (&acc)[NT][2][4], const Chunk<NT, 0>& k, u32 sg, u32 sh) {
    const u32 a0 = bmul(slot<J>(k.w[0].x), sg), a1 = bmul(slot<J>(k.w[0].z), sh),
              a2 = bmul(slot<J>(k.w[0].y), sg), a3 = bmul(slot<J>(k.w[0].w), sh);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const U4& xv = k.x[i][J >> 1];
        mma(acc[i][J & 1], a0, a1, a2, a3, (J & 1) ? xv.z : xv.x, (J & 1) ? xv.w : xv.y);
    }
}

// k32 (L 1): slot J of the words of rows g (w[0]) and g + 8 (w[1]) of group t, scaled (sg, sh: the slot's block),
// as two mmas: words 0 / 1 (elements e + 0..3, e = 16t + 64 (J >> 1) + 8 (J & 1)) and words 2 / 3 (e + 4..7),
// against x elements e .. e + 7 (x[i][J]); accumulator chains 0 and 1.
template <int J, int NT>
__device__ __forceinline__ void slot_mmas_k32(float (&acc)[NT][2][4], const Chunk<NT, 1>& k, u32 sg, u32 sh) {
    const U4 &wg = k.w[0], &wh = k.w[1];
    const u32 a0 = bmul(slot<J>(wg.x), sg), a1 = bmul(slot<J>(wh.x), sh),
              a2 = bmul(slot<J>(wg.y), sg), a3 = bmul(slot<J>(wh.y), sh);
    const u32 b0 = bmul(slot<J>(wg.z), sg), b1 = bmul(slot<J>(wh.z), sh),
              b2 = bmul(slot<J>(wg.w), sg), b3 = bmul(slot<J>(wh.w), sh);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        const U4& xv = k.x[i][J];
        mma(acc[i][0], a0, a1, a2, a3, xv.x, xv.y);
        mma(acc[i][1], b0, b1, b2, b3, xv.z, xv.w);
    }
}

// EPI 0: out[token, n] = y; EPI 3: out[token, n] = s = y + res[token, n] (rounded as the residual add: y to
// bf16 first); EPI 4: EPI 3 and the next RMSNorm's inputs: tout[token, n] = s * nw[n] (bf16) and, per token,
// the sum of s^2 over the CTA's 16 columns in pout[token, blockIdx.x] (float; a fixed order); EPI 1
// (SwiGLU, rows 2j / 2j + 1 = gate / up of column j, interleave_gate_up):
// out[token, n / 2] = silu(gate) * up. EPI 2 (q/k/v rope, rows in the interleave_rope_rows order: rows 2j and
// 2j + 1 are dims d and d + half of a q or k head, columns below rope_cols; v rows in order): the pair
// rotated by cos / sin [M, half] (float32, row strides ldc / lds) and stored in checkpoint column order.
// NORM 1: the GEMM's input is RMSNorm(s) with s the residual stream: x is an EPI 4 kernel's s * norm weight,
// pin [M, nparts] its partial sums of s^2; y = (W @ x) / rms(s), rms(s) = sqrt(sum / kdim + eps), the
// 1 / rms applied in float32 in the epilogue (the unfused path rounds s / rms(s) to bf16 before the weight).
// MINB (0: none): __launch_bounds__' minimum CTAs per SM, which caps the registers (two token tiles: 32 / W, 64
// registers, so that the grid stays resident; decode_gemm asks for it only where it must).
// L 0: the r16c64 layout (r16c64.py), chunks of 64 elements, nchunks per row group; L 1: the k32
// layout (k32.py: 64-row x 128-element tiles, 4 KB of codes and 512 bytes of scales each, in (row block, K
// block) order), chunks of 128 elements = one tile's K, nchunks = Kp / 128; CTA b's rows are rows 16 (b & 3) ..
// + 15 of row block b >> 2; lane (g, t) reads group t (16 bytes of codes, a 2-byte scale pair: blocks t, t + 4)
// of rows g and g + 8, and x elements 16t + 0..15 and 64 + 16t + 0..15 of the chunk, loaded just before the
// chunk's mmas (a ring of x took 91 registers against 63; slower where it left fewer warps resident).
template <int W, int D, int NT, int EPI, int NORM, int MOE, int MINB = 0, int L = 0>
__global__ void __launch_bounds__(W * 32, MINB) nvfp4_decode_gemm(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ out, const float* __restrict__ gscale,
    int M, int N, int nchunks, int ldx, int ldo,
    const float* __restrict__ cosp, const float* __restrict__ sinp, int ldc, int lds, int rope_cols, int half,
    const float* __restrict__ pin, int nparts, float eps, int kdim, const u16* __restrict__ res, int ldr,
    const u16* __restrict__ nw, u16* __restrict__ tout, int ldt, float* __restrict__ pout,
    const int* __restrict__ sids, const int* __restrict__ eids, const int* __restrict__ npost,
    const float* __restrict__ tw, int a_div, int gs_stride)
{
    constexpr int K32 = L;
    // k32 MoE gate/up (the Triton MoE's layout, moe/triton.py): gate rows [0, Ip), up rows [Ip, 2Ip) of each
    // expert; CTA b reads gate rows 8b .. 8b + 7 as its rows g and up rows Ip + 8b .. as its rows g + 8
    constexpr bool HALVES = K32 && MOE == 1 && EPI == 1;
    constexpr bool XRING = NT == 1 && L == 0;  // x rides in the ring (k32: loaded just before its chunk)
    constexpr int CK = K32 ? 128 : 64;  // elements of K per chunk
    constexpr int CS = K32 ? 256 : 32;  // U4 of codes (and u16 of scales) from one chunk to the next
    __shared__ float red[W * NT * 128];
    __shared__ float ssq[NORM ? W * 16 : 1];
    __shared__ float sq[EPI == 4 ? 256 : 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    // MOE: the CTA serves block blockIdx.y of the expert-sorted pairs (`moe_align`: 8 NT flat pair ids of one
    // expert, padded with ids >= M, M = the number of pairs); codes, scales, gscale are that expert's. MOE
    // takes the expert ids' stride in ldc (no rope there; a new parameter changed the other kernels' SASS)
    // MOE 2 (one token's down GEMM and top-k combine in one): the CTA's warps split the token's M pairs, W / M
    // warps over each pair's expert, x row p = pair p's SwiGLU output; each warp scales its sums by its pair's
    // routing weight and expert's global scale, so the CTA's sum over warps is the combined output (row 0)
    const int wps = MOE == 2 ? W / M : W;  // warps per K range
    const int wk = MOE == 2 ? warp % wps : warp;  // this warp's place in its range
    const int seg = MOE == 2 ? warp / wps : 0;  // MOE 2: its pair
    float pair_scale = 1.f;
    const int* bids = sids + (size_t)blockIdx.y * NT * 8;
    if (MOE) {
        PDL_WAIT();  // which expert comes from the kernels before
        if (MOE == 1 && (int)blockIdx.y * NT * 8 >= *npost) return;
        // MOE passes the ids' stride as ldc (2: int64 ids)
        const size_t e = eids[(size_t)(MOE == 2 ? seg : blockIdx.y) * ldc];
        codes += e * gridDim.x * nchunks * 32 * (K32 + 1);  // an expert: 16 gridDim.x rows x all of K
        scales += e * gridDim.x * nchunks * 32 * (K32 + 1);
        gscale += e * gs_stride;
        if (MOE == 2) pair_scale = tw[seg] * *gscale * 16384.0f;
    }
    auto ok = [&](int token) { return MOE == 1 ? bids[token] < M : token < (MOE == 2 ? 1 : M); };  // to store
    auto orow = [&](int token) { return (size_t)(MOE == 1 ? bids[token] : token); };  // its output row
    const int c_begin = MOE == 2 ? (nchunks * wk) / wps : (nchunks * warp) / W;
    const int nc = (MOE == 2 ? (nchunks * (wk + 1)) / wps : (nchunks * (warp + 1)) / W) - c_begin;
    const size_t chunk0 = HALVES ? ((size_t)(blockIdx.x >> 3) * nchunks + c_begin) * 256 + (8 * (blockIdx.x & 7) + g) * 4 + t
                        : K32 ? ((size_t)(blockIdx.x >> 2) * nchunks + c_begin) * 256 + (16 * (blockIdx.x & 3) + g) * 4 + t
                            : ((size_t)blockIdx.x * nchunks + c_begin) * 32 + lane;
    // from a lane's row g to its row g + 8 (U4 of codes, u16 of scales): 8 tile rows; HALVES: Ip / 64 row blocks
    const size_t roff = HALVES ? (size_t)(gridDim.x >> 3) * nchunks * 256 : 32;
    const U4* cp = codes + chunk0;
    const u16* sp = scales + chunk0;
    // n-tile i serves tokens 8 i + g; tokens >= M read token M - 1's row (their results are not stored);
    // MOE: x row id / a_div of the token's pair id, padding rows the block's first pair's
    const u16* xp[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
        int row = MOE == 2 ? seg : min(8 * i + g, M - 1);
        if (MOE == 1) {
            const int id = bids[8 * i + g];
            row = (id < M ? id : bids[0]) / a_div;
        }
        xp[i] = x + (size_t)row * ldx + c_begin * CK + 16 * t;  // L 1: group t's blocks t and t + 4
    }

    Chunk<NT, K32> buf[D];
    float acc[NT][2][4];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][0][e] = acc[i][1][e] = 0.f;
#define LOAD_W(B, C, P) do { \
        _Pragma("unroll") for (int r = 0; r <= K32; ++r) { \
            ld_stream(buf[B].w[r], cp + (C) * CS + roff * r, P); \
            ld_scale(buf[B].s[r], sp + (C) * CS + roff * r, P); \
        } \
    } while (0)
#define LOAD_X(B, C, P) do { \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) \
            _Pragma("unroll") for (int q = 0; q < 2 * (K32 + 1); ++q) \
                ld_x(buf[B].x[i][q], (const U4*)(xp[i] + (C) * CK + (K32 ? 64 * (q >> 1) : 0) + 8 * (q & 1)), P); \
    } while (0)
#define COMPUTE(B) do { \
        if constexpr (K32 == 0) { \
            const u32 h = scale_pair(buf[B].s[0]); \
            const u32 sg = prmt(h, 0x1010u), sh = prmt(h, 0x3232u); \
            slot_mmas<0>(acc, buf[B], sg, sh); \
            slot_mmas<1>(acc, buf[B], sg, sh); \
            slot_mmas<2>(acc, buf[B], sg, sh); \
            slot_mmas<3>(acc, buf[B], sg, sh); \
        } else { /* a scale pair per row: blocks 2t (slots 0, 1) and 2t + 1 (slots 2, 3) */ \
            const u32 hg = scale_pair(buf[B].s[0]), hh = scale_pair(buf[B].s[1]); \
            const u32 g0 = prmt(hg, 0x1010u), h0 = prmt(hh, 0x1010u); \
            slot_mmas_k32<0>(acc, buf[B], g0, h0); \
            slot_mmas_k32<1>(acc, buf[B], g0, h0); \
            const u32 g1 = prmt(hg, 0x3232u), h1 = prmt(hh, 0x3232u); \
            slot_mmas_k32<2>(acc, buf[B], g1, h1); \
            slot_mmas_k32<3>(acc, buf[B], g1, h1); \
        } \
    } while (0)
    // The epilogue's elements of this thread (plain epilogues): index idx = threadIdx.x + j W 32 of the
    // `red` order -> (token, column n). Their norm weights (EPI 4) load before the PDL wait, their residual
    // values after it, both long before the epilogue needs them.
    constexpr int EPI_ITERS = (NT * 128 + W * 32 - 1) / (W * 32);
    u16 res_pf[EPI_ITERS], nw_pf[EPI_ITERS];
#pragma unroll
    for (int j = 0; j < EPI_ITERS; ++j) {
        res_pf[j] = nw_pf[j] = 0;
        const int idx = threadIdx.x + j * W * 32, r = idx & 127, l = r >> 2, e = r & 3;
        const int token = 8 * (idx >> 7) + 2 * (l & 3) + (e & 1), n = blockIdx.x * 16 + (l >> 2) + 8 * (e >> 1);
        if (EPI == 4 && idx < NT * 128 && token < M && n < N) nw_pf[j] = nw[n];
    }
    // The weights are never written by an earlier kernel: their first loads go before the PDL wait (MOE:
    // after it, the expert comes from the kernels before). One token tile: x rides in the ring with the
    // weights; two: x is loaded just before its chunk's mmas (it is in L1 or L2, and a ring of it takes 32
    // registers more: 91 against 68, fewer resident CTAs, slower on every shape).
#pragma unroll
    for (int b = 0; b < D - 1; ++b) LOAD_W(b, b, b < nc);
    PDL_WAIT();
    if constexpr (XRING) {
#pragma unroll
        for (int b = 0; b < D - 1; ++b) LOAD_X(b, b, b < nc);
    }
    if (EPI >= 3) {
#pragma unroll
        for (int j = 0; j < EPI_ITERS; ++j) {
            const int idx = threadIdx.x + j * W * 32, r = idx & 127, l = r >> 2, e = r & 3;
            const int token = 8 * (idx >> 7) + 2 * (l & 3) + (e & 1), n = blockIdx.x * 16 + (l >> 2) + 8 * (e >> 1);
            if (idx < NT * 128 && token < M && n < N) res_pf[j] = res[(size_t)token * ldr + n];
        }
    }
    if (NORM) {  // each token's sum of squares from the partials, while the first chunks load: per warp
        // (every token's loads in flight together, the butterflies interleaved: no per-token latency chain)
        float v[NT * 8];
#pragma unroll
        for (int i = 0; i < NT * 8; ++i) v[i] = 0.f;
        for (int p = threadIdx.x; p < nparts; p += W * 32) {
#pragma unroll
            for (int i = 0; i < NT * 8; ++i) v[i] += i < M ? pin[(size_t)i * nparts + p] : 0.f;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int i = 0; i < NT * 8; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
        }
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < NT * 8; ++i) ssq[warp * 16 + i] = v[i];
        }
    }
    int c = 0;
    for (; c + D <= nc; c += D) {
#pragma unroll
        for (int b = 0; b < D; ++b) {
            LOAD_W((b + D - 1) % D, b + D - 1, c + b + D - 1 < nc);
            if constexpr (XRING) LOAD_X((b + D - 1) % D, b + D - 1, c + b + D - 1 < nc);
            else LOAD_X(b, b, true);
            COMPUTE(b);
        }
        cp += D * CS;
        sp += D * CS;
#pragma unroll
        for (int i = 0; i < NT; ++i) xp[i] += D * CK;
    }
    // the last nc % D chunks are in buffers 0 .. nc % D - 1 already
#pragma unroll
    for (int b = 0; b < D - 1; ++b) {
        if (c + b < nc) {
            if constexpr (!XRING) LOAD_X(b, b, true);
            COMPUTE(b);
        }
    }
#undef LOAD_W
#undef LOAD_X
#undef COMPUTE
    if (MOE == 2) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][0][e] *= pair_scale, acc[0][1][e] *= pair_scale;
    }
    PDL_TRIGGER();
    // acc[i]: (row g, token 8i + 2t), (row g, 8i + 2t + 1), (row g + 8, 8i + 2t), (row g + 8, 8i + 2t + 1)
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[(warp * NT + i) * 128 + lane * 4 + e] = acc[i][0][e] + acc[i][1][e];
    __syncthreads();
    const float gs0 = MOE == 2 ? 1.f : *gscale * 16384.0f;  // MOE 2: scaled per warp above
    const float gs_up = MOE == 1 && EPI == 1 ? gscale[1] * 16384.0f : gs0;  // MOE SwiGLU: up's global scale
    // 1 / rms of a token's s (NORM), from the warps' sums of the partials
    auto scale_of = [&](int token) {
        if (!NORM) return gs0;
        float ss = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) ss += ssq[w * 16 + token];
        return gs0 * rsqrtf(ss * __frcp_rn((float)kdim) + eps);
    };
    if (EPI == 0 || EPI == 3 || EPI == 4) {
#pragma unroll
        for (int j = 0; j < EPI_ITERS; ++j) {
            const int idx = threadIdx.x + j * W * 32;
            if (idx >= NT * 128) break;
            const int i = idx >> 7, r = idx & 127;
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < W; ++w) v += red[(w * NT + i) * 128 + r];
            const int l = r >> 2, e = r & 3;
            const int row = (l >> 2) + 8 * (e >> 1), token = 8 * i + 2 * (l & 3) + (e & 1);
            const int n = blockIdx.x * 16 + row;
            float sumsq = 0.f;
            if (ok(token) && n < N) {
                float y = v * scale_of(token);
                if (MOE == 1) y *= tw[bids[token]];  // the pair's routing weight (the down GEMM)
                if (EPI >= 3) y = bf16_round(y) + __uint_as_float((u32)res_pf[j] << 16);
                const u16 o = to_bf16(y);
                out[orow(token) * ldo + n] = o;
                if (EPI == 4) {
                    const float sv = __uint_as_float((u32)o << 16);
                    tout[(size_t)token * ldt + n] = to_bf16(sv * __uint_as_float((u32)nw_pf[j] << 16));
                    sumsq = sv * sv;
                }
            }
            if (EPI == 4) sq[token * 16 + row] = sumsq;
        }
        if (EPI == 4) {
            __syncthreads();
            if (threadIdx.x < M) {
                float a = 0.f;
#pragma unroll
                for (int r = 0; r < 16; ++r) a += sq[threadIdx.x * 16 + r];
                pout[(size_t)threadIdx.x * gridDim.x + blockIdx.x] = a;
            }
        }
    } else {
        for (int idx = threadIdx.x; idx < NT * 64; idx += W * 32) {
            const int token = idx >> 3, j = idx & 7;  // output column blockIdx.x * 8 + j
            const int i = token >> 3, tk = token & 7;
            // rows 2j (gate) and 2j + 1 (up) of the CTA, token tk of n-tile i, in the `red` order
            const int rg = HALVES ? j : 2 * j, ru = HALVES ? j + 8 : 2 * j + 1;
            const int ig = (4 * (rg & 7) + (tk >> 1)) * 4 + 2 * (rg >> 3) + (tk & 1);
            const int iu = (4 * (ru & 7) + (tk >> 1)) * 4 + 2 * (ru >> 3) + (tk & 1);
            float vg = 0.f, vu = 0.f;
#pragma unroll
            for (int w = 0; w < W; ++w) {
                vg += red[(w * NT + i) * 128 + ig];
                vu += red[(w * NT + i) * 128 + iu];
            }
            const int n = blockIdx.x * 8 + j;
            if (!ok(token) || 2 * n >= N) continue;
            const float gs = scale_of(token);
            if (EPI == 1) {
                out[orow(token) * ldo + n] = swiglu(vg * gs, vu * (MOE == 1 ? gs_up : gs));
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
"""
