"""The CUDA source of the wgmma GEMM, `source(block_m)`: cuda_wgmma.py launches it, plans its launches and
describes its design (the A fragment, the stages, stream-K). Plain CUDA C++ with inline PTX, no headers (NVRTC
compiles it without a CUDA toolkit), for sm_90a; the device helpers it builds on (scale conversion, e2m1 slot
decode, bf16 roundings of the SwiGLU epilogue) are cuda_device.py's.
"""

from __future__ import annotations

from functools import lru_cache

from pieceworks.backends.fp4_gemm.cuda_device import DEVICE_HELPERS


def _wgmma_fn(bm: int) -> str:
    """wgmma m64n{bm}k16 bf16 with A from registers, B by descriptor, D += A B (f32)."""
    n = bm // 2
    outs = ", ".join(f"%{i}" for i in range(n))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(n))
    return (
        f"__device__ __forceinline__ void wgmma_bm(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 b) {{\n"
        f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.bf16.bf16 "\n'
        f'                 "{{{outs}}}, {{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, 1, 1, 1, 0;"\n'
        f'                 : {cons}\n'
        f'                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));\n'
        f"}}\n"
    )


_KERNEL = r"""
typedef unsigned long long u64;

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
__device__ __forceinline__ u32 lds32(u32 a) { u32 v; asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a)); return v; }
__device__ __forceinline__ void lds64(u32 a, u32& x, u32& y) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(x), "=r"(y) : "r"(a));
}
// wgmma matrix descriptor: start address, leading and stride byte offsets, all >> 4 (the layout bits are
// OR-ed in by the caller).
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// The A registers of k16 steps q and 4 + q of a 128-element tile from this lane's unit pairs w0 (row g),
// w1 (row g + 8) of group q and their scale pairs' bf16x2 multipliers (low: block q, high: block q + 4).
__device__ __forceinline__ void decode_q(u32* a, u32 w0, u32 w1, u32 h0, u32 h1) {
    const u32 sa0 = prmt(h0, 0x1010), sb0 = prmt(h0, 0x3232), sa1 = prmt(h1, 0x1010), sb1 = prmt(h1, 0x3232);
    a[0] = bmul(slot<0>(w0), sa0); a[1] = bmul(slot<0>(w1), sa1);
    a[2] = bmul(slot<1>(w0), sa0); a[3] = bmul(slot<1>(w1), sa1);
    a[4] = bmul(slot<2>(w0), sb0); a[5] = bmul(slot<2>(w1), sb1);
    a[6] = bmul(slot<3>(w0), sb0); a[7] = bmul(slot<3>(w1), sb1);
}

struct __align__(64) Tmap { unsigned long long v[16]; };
__device__ __forceinline__ void tma2d(u32 dst, const Tmap* m, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"((u64)m), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void expect_tx(u32 bar, u32 bytes) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_init(u32 a, u32 n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(a), "r"(n) : "memory"); }
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
    u32 ok;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(ok) : "r"(a), "r"(parity) : "memory");
    } while (!ok);
}
// Arrives on barrier a when `when` is nonzero: one predicated instruction, no branch (a branch among the
// consumers' wgmmas makes ptxas serialize them, C7513).
__device__ __forceinline__ void mbar_arrive_if(u32 a, int when) {
    asm volatile("{\n .reg .pred p;\n setp.ne.s32 p, %1, 0;\n @p mbarrier.arrive.shared::cta.b64 _, [%0];\n}"
                 :: "r"(a), "r"(when) : "memory");
}

// x by TMA (two 64-element boxes of BM rows from row ml, 128-byte swizzle, zero fill past K, and past M where
// M < BM), the weight and scale tiles by bulk copies, all completing on the stage's full barrier; thread 256
// (the producer warpgroup) issues a stage once every consumer thread arrived on its empty barrier (after its
// warpgroup's wgmmas of that stage). No CTA-wide barrier and no branch in the consumers' K loop.
// The work of a launch: `ntiles` output tiles (token tile t % gx of row block yoff + t / gx) of nkt K tiles
// each, as iterations t * nkt + k. Without SK a CTA takes one tile (blockIdx.x, blockIdx.y): all its
// iterations, or with SPLIT blockIdx.z's share of them, storing float32 partials (scaled) to out as float
// [gridDim.z, M, ldo] (the columns from row block yoff on), which a second kernel sums. With SK (stream-K)
// CTA c of G takes iterations [c I / G, (c + 1) I / G) of I = ntiles x nkt, crossing tiles: a segment that
// holds a tile's every K tile stores it as usual; one without the tile's first K tile is its CTA's first
// segment and stores its float32 accumulators to workspace slot c, then counts itself on the tile's flag;
// the segment with the first K tile is its CTA's last, reached after the others: it waits for their
// count, adds their partials in K order and stores the tile, then zeroes the flag for the next launch.
// The waits need every CTA of the launch resident at once: G at most one per SM.
template <int BM, int S, int SWIGLU, int SPLIT, int SK>
__global__ void __launch_bounds__(384, 1) fp4_wgmma_tma(
    const __grid_constant__ Tmap tm, const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
    const float* __restrict__ gscale, u16* __restrict__ out, int M, int N, int nkt, int nrb, int ldo, int yoff,
    int gx, int ntiles, float* __restrict__ work, int* __restrict__ flags)
{
    constexpr int XB = BM * 256, STAGE = XB + 2 * 4096 + 2 * 512;
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 s0 = (u32)__cvta_generic_to_shared(smem), bars = s0 + S * STAGE;  // full[S], empty[S]
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const long long total = (long long)ntiles * nkt;
    int ia, ib;  // this CTA's iterations
    if (SK) {
        ia = (int)(total * blockIdx.x / gridDim.x);
        ib = (int)(total * (blockIdx.x + 1) / gridDim.x);
    } else {
        const int tile = blockIdx.y * gx + blockIdx.x;
        ia = tile * nkt + (SPLIT ? (int)(((long long)nkt * blockIdx.z) / gridDim.z) : 0);
        ib = tile * nkt + (SPLIT ? (int)(((long long)nkt * (blockIdx.z + 1)) / gridDim.z) : nkt);
    }
    // The last token tile of M >= BM rows loads the BM rows ending at M (overlapping the tile before it) and
    // stores only its own: a box mostly past M, zero-filled by TMA, made M = 288 run 20-54% slower than 512.
    auto first_row = [&](int tile) { const int m0 = (tile % gx) * BM; return M >= BM ? min(m0, M - BM) : m0; };
    auto issue = [&](int i, int st) {
        const int tile = i / nkt, kt = i - tile * nkt, by = tile / gx + yoff, ml = first_row(tile);
        const int rb0 = min(2 * by, nrb - 1), rb1 = min(2 * by + 1, nrb - 1);
        const u32 base = s0 + st * STAGE, full = bars + 8 * st;
        expect_tx(full, STAGE);
        tma2d(base, &tm, kt * 128, ml, full);
        tma2d(base + BM * 128, &tm, kt * 128 + 64, ml, full);
        bulk(base + XB, codes + ((size_t)rb0 * nkt + kt) * 4096, 4096, full);
        bulk(base + XB + 4096, codes + ((size_t)rb1 * nkt + kt) * 4096, 4096, full);
        bulk(base + XB + 8192, scales + ((size_t)rb0 * nkt + kt) * 512, 512, full);
        bulk(base + XB + 8192 + 512, scales + ((size_t)rb1 * nkt + kt) * 512, 512, full);
    };
    if (tid == 0) {
        for (int s = 0; s < S; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (S + s), 8);  // lane 0 of each consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int n_it = ib - ia;
    if (tid >= 256) {  // the producer warpgroup: one thread issues every stage once its consumers released it
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 256) {
            PDL_WAIT();
            for (int i = 0; i < n_it; ++i) {
                const int st = i % S;
                if (i >= S) mbar_wait(bars + 8 * (S + st), ((i / S) - 1) & 1);
                issue(ia + i, st);
            }
            // the last stages' releases (the consumers release every stage they used)
            for (int i = max(0, n_it - S); i < n_it; ++i) mbar_wait(bars + 8 * (S + i % S), (i / S) & 1);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");  // BM = 256 needs more than 65536 / 384
    const float gs = gscale[0] * 16384.0f;
    const int r0 = 16 * warp + g;
    // Token tiles of at most 64 decode two k16 steps per wgmma group (one fence, commit and wait per two
    // steps: 1-4% faster per call at M = 24-32, level at 64, docs/benchmarks.md); larger tiles one step,
    // which leaves their accumulators the registers.
    constexpr int G = BM <= 64 ? 2 : 1;
    u32 a[2 * G][8];  // the A fragments of two groups: a group's decode waits for the group before the last
    for (int i = ia, j = 0; i < ib;) {  // one segment (of one tile) per pass; j: stages consumed before it
        const int tile = i / nkt, k0 = i - tile * nkt, nk = min(nkt - k0, ib - i);
        float acc[BM / 2];
#pragma unroll
        for (int e = 0; e < BM / 2; ++e) acc[e] = 0.f;
        for (int kt = 0; kt < nk; ++kt) {
            const int st = (j + kt) % S;
            mbar_wait(bars + 8 * st, ((j + kt) / S) & 1);
            const u32 base = s0 + st * STAGE;
            const u32 wbase = base + XB + wg * 4096, sbase = base + XB + 2 * 4096 + wg * 512;
            u32 sc0a, sc0b, sc1a, sc1b;
            lds64(sbase + r0 * 8, sc0a, sc0b);
            lds64(sbase + (r0 + 8) * 8, sc1a, sc1b);
#pragma unroll
            for (int q0 = 0; q0 < 4; q0 += G) {  // one wgmma group: k16 steps q0 .. q0 + G - 1
                u32 w[G][2], h[G][2];
#pragma unroll
                for (int e = 0; e < G; ++e) {
                    const int q = q0 + e;
                    w[e][0] = lds32(wbase + r0 * 64 + (q << 4) + 4 * t);
                    w[e][1] = lds32(wbase + (r0 + 8) * 64 + (q << 4) + 4 * t);
                    const u32 p0 = q < 2 ? sc0a : sc0b, p1 = q < 2 ? sc1a : sc1b;
                    h[e][0] = scale_pair((q & 1) ? p0 >> 16 : p0 & 0xFFFF);
                    h[e][1] = scale_pair((q & 1) ? p1 >> 16 : p1 & 0xFFFF);
                }
                wg_wait<1>();  // the group that last read these fragments (two groups back) is done
#pragma unroll
                for (int e = 0; e < G; ++e) decode_q(a[(q0 + e) % (2 * G)], w[e][0], w[e][1], h[e][0], h[e][1]);
                wg_fence();
#pragma unroll
                for (int e = 0; e < G; ++e) {
                    const int q = q0 + e, f = q % (2 * G);
                    wgmma_bm(acc, a[f][0], a[f][1], a[f][2], a[f][3], desc(base + q * 32, 16, 1024) | (1ull << 62));
                    wgmma_bm(acc, a[f][4], a[f][5], a[f][6], a[f][7],
                             desc(base + BM * 128 + q * 32, 16, 1024) | (1ull << 62));
                }
                wg_commit();
                if (q0 == 0) {  // this warpgroup's wgmmas of the previous K tile are done: release its stage
                    wg_wait<1>();
                    mbar_arrive_if(bars + 8 * (S + (j + kt + S - 1) % S), (kt > 0) & (lane == 0));
                }
            }
        }
        wg_wait<0>();
        j += nk;
        mbar_arrive_if(bars + 8 * (S + (j + S - 1) % S), lane == 0);
        const bool last_segment = i + nk == ib;
        if (last_segment) PDL_TRIGGER();
        if (SK && nk < nkt) {  // a part of the tile's K: through the workspace
            const long long G = gridDim.x, x0 = (long long)tile * nkt;
            const int cf = (int)(((x0 + 1) * G + total - 1) / total) - 1;  // the CTAs holding the tile's first
            const int cl = (int)(((x0 + nkt) * G + total - 1) / total) - 1;  // and last K tiles
            if (k0 > 0) {  // the first segment of this CTA (i == ia): its partial to slot blockIdx.x, counted
#pragma unroll
                for (int e = 0; e < BM / 8; ++e)
                    __stcg((float4*)work + (size_t)blockIdx.x * (BM * 32) + e * 256 + tid,
                           make_float4(acc[4 * e], acc[4 * e + 1], acc[4 * e + 2], acc[4 * e + 3]));
                __threadfence();
                asm volatile("bar.sync 1, 256;" ::: "memory");
                if (tid == 0) atomicAdd(flags + tile, 1);
                i += nk;
                continue;
            }
            // k = 0: this CTA's last segment, reached after the others (at the start of the next CTAs' ranges)
            if (tid == 0) {
                int seen;
                do {
                    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(flags + tile) : "memory");
                } while (seen < cl - cf);
                flags[tile] = 0;  // every other segment has counted: ready for the next launch
            }
            asm volatile("bar.sync 1, 256;" ::: "memory");
            for (int c = cf + 1; c <= cl; ++c) {  // their partials in K order
                const float4* part = (const float4*)work + (size_t)c * (BM * 32) + tid;
#pragma unroll
                for (int e = 0; e < BM / 8; ++e) {
                    const float4 v = __ldcg(part + e * 256);
                    acc[4 * e] += v.x; acc[4 * e + 1] += v.y; acc[4 * e + 2] += v.z; acc[4 * e + 3] += v.w;
                }
            }
        }
        // The stores from one pointer per thread stepped by immediates and ldo (ptxas kept a 64-bit multiply
        // and branch per element of the per-element address form: ~2,800 instructions per thread at BM = 256).
        const int m0 = (tile % gx) * BM, row = (tile / gx + yoff) * 128 + 64 * wg + r0;
        const int tok0 = first_row(tile) + 2 * t;  // e & 1 adds a token, jj eight; e >> 1 adds 8 rows of W
        const bool col0 = row < N, col1 = row + 8 < N;
        float* pf = (float*)out + ((size_t)blockIdx.z * M + tok0) * ldo + row - yoff * 128;  // SPLIT
        u16* ph = out + (size_t)tok0 * ldo + (row >> 1);  // SWIGLU (even rows store)
        u16* pb = out + (size_t)tok0 * ldo + row;
        const int odd = g & 1;  // SWIGLU: rows 2i (gate) and 2i + 1 (up) sit in lanes g and g ^ 1 (lane ^ 4)
#pragma unroll
        for (int jj = 0; jj < BM / 8; ++jj) {
            const int ta = tok0 + 8 * jj;  // rows below m0 are the tile before's to store
            const bool own0 = ta >= m0 && ta < M, own1 = ta + 1 >= m0 && ta + 1 < M;
            if (SWIGLU) {  // the even lane takes the pairs of rows row, row ^ 1 (e = 0, 1), the odd one those
                // of rows row + 8 and its neighbour (e = 2, 3): each lane rounds two SwiGLUs, none wasted
                float v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) v[e] = acc[4 * jj + e] * gs;
                const float r0 = __shfl_xor_sync(0xffffffffu, odd ? v[0] : v[2], 4);
                const float r1 = __shfl_xor_sync(0xffffffffu, odd ? v[1] : v[3], 4);
                const u16 y0 = odd ? swiglu(r0, v[2]) : swiglu(v[0], r0);
                const u16 y1 = odd ? swiglu(r1, v[3]) : swiglu(v[1], r1);
                const bool col = odd ? (row + 7 < N) : col0;  // the pair's gate row: row or row + 7
                u16* q = ph + (size_t)(8 * jj) * ldo + (odd ? 4 : 0);  // odd row: (row + 7) >> 1 == (row >> 1) + 4
                if (own0 && col) q[0] = y0;
                if (own1 && col) q[ldo] = y1;
                continue;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float v = acc[4 * jj + e] * gs;
                const bool ok = ((e & 1) ? own1 : own0) && ((e >> 1) ? col1 : col0);
                const size_t at = (size_t)(8 * jj + (e & 1)) * ldo;
                if (SPLIT) {
                    if (ok) pf[at + 8 * (e >> 1)] = v;
                } else if (ok) {
                    pb[at + 8 * (e >> 1)] = to_bf16(v);
                }
            }
        }
        i += nk;
    }
}

"""


@lru_cache(maxsize=None)
def source(block_m: int) -> str:
    """The kernel's CUDA source for BM = block_m (one string object per tile: `nvrtc.kernel`'s cache hashes
    it on every launch)."""
    return DEVICE_HELPERS + "typedef unsigned long long u64;\n" + _wgmma_fn(block_m) + _KERNEL.replace(
        "typedef unsigned long long u64;\n", "", 1)
