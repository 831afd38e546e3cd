"""How fast can a CTA stream the wgmma kernel's weight tiles (4 KB codes x 2 row blocks + 512 B scales x 2 per
K tile, row-block-major)? bulk copies into an S-stage ring (as shipped, 4 copies per stage; or 2 copies of
codes+scales adjacent) against ld.global.nc register batches of U K tiles; G CTAs share the I = tiles x nkt
iterations evenly. us per call (graph of rotating weight copies, median of 7), TB/s of codes+scales."""
import os, sys
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from common import graph_time, copies_for
from pieceworks.backends import nvrtc

SRC = r"""
typedef unsigned int u32; typedef unsigned long long u64;
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
__device__ __forceinline__ void mbar_arrive(u32 a) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(a) : "memory"); }
__device__ __forceinline__ uint4 ldg(const void* p) {
    uint4 v; asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)); return v;
}
__device__ __forceinline__ u32 ldg32(const void* p) { u32 v; asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p)); return v; }

// MODE 0: 4 bulk copies per stage (codes rb0, rb1, scales rb0, rb1); MODE 1: 2 copies (codes+scales of a row
// block adjacent, 4608 B); MODE 2: ld.global batches of U K tiles by the 256 consumer threads.
template <int S, int MODE, int U, int SPACE, int LATE, int FENCE>
__global__ void __launch_bounds__(384, 1) probe(const unsigned char* __restrict__ codes, const unsigned char* __restrict__ scales,
                                                int nkt, int ntiles, u32* __restrict__ out) {
    constexpr int STAGE = SPACE;
    extern __shared__ __align__(1024) unsigned char smem[];
    const int tid = threadIdx.x;
    const long long total = (long long)ntiles * nkt;
    const int ia = (int)(total * blockIdx.x / gridDim.x), ib = (int)(total * (blockIdx.x + 1) / gridDim.x);
    u32 acc = 0;
    if (MODE == 2) {
        if (tid >= 256) return;
        const int half = tid >> 7, l = tid & 127;
        for (int i = ia; i < ib; i += U) {
            uint4 a[U], b[U]; u32 c[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int ii = min(i + u, ib - 1), tile = ii / nkt, kt = ii - tile * nkt;
                const size_t r0 = (size_t)(2 * tile) * nkt + kt, r1 = r0 + nkt;
                a[u] = ldg(codes + r0 * 4096 + tid * 16);
                b[u] = ldg(codes + r1 * 4096 + tid * 16);
                c[u] = ldg32(scales + (half ? r1 : r0) * 512 + l * 4);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w ^ b[u].x ^ b[u].y ^ b[u].z ^ b[u].w ^ c[u];
        }
        out[blockIdx.x * 256 + tid] = acc;
        return;
    }
    const u32 s0 = (u32)__cvta_generic_to_shared(smem), bars = s0 + S * STAGE;
    if (tid == 0) {
        for (int s = 0; s < S; ++s) { mbar_init(bars + 8 * s, 1); mbar_init(bars + 8 * (S + s), 8); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int n_it = ib - ia;
    if (tid >= 256) {
        if (tid == 256) {
            for (int i = 0; i < n_it; ++i) {
                const int st = i % S;
                if (i >= S) mbar_wait(bars + 8 * (S + st), ((i / S) - 1) & 1);
                const int ii = ia + i, tile = ii / nkt, kt = ii - tile * nkt;
                const size_t r0 = (size_t)(2 * tile) * nkt + kt, r1 = r0 + nkt;
                const u32 base = s0 + st * STAGE, full = bars + 8 * st;
                expect_tx(full, 9216);
                if (MODE == 0) {
                    bulk(base, codes + r0 * 4096, 4096, full);
                    bulk(base + 4096, codes + r1 * 4096, 4096, full);
                    bulk(base + 8192, scales + r0 * 512, 512, full);
                    bulk(base + 8192 + 512, scales + r1 * 512, 512, full);
                } else {
                    bulk(base, codes + r0 * 4608, 4608, full);
                    bulk(base + 4608, codes + r1 * 4608, 4608, full);
                }
            }
        }
        return;
    }
    for (int i = 0; i < n_it; ++i) {
        const int st = i % S;
        mbar_wait(bars + 8 * st, (i / S) & 1);
        const u32 base = s0 + st * STAGE;
        u32 x0, x1, x2, x3, y0, y1, y2, y3, z;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3) : "r"(base + tid * 16));
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(y0), "=r"(y1), "=r"(y2), "=r"(y3) : "r"(base + 4096 + tid * 16));
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(z) : "r"(base + 8192 + tid * 4));
        acc ^= x0 ^ x1 ^ x2 ^ x3 ^ y0 ^ y1 ^ y2 ^ y3 ^ z;
        if (FENCE) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            }
        }
        __syncwarp();
        if (LATE) {
            if ((tid & 31) == 0 && i > 0) mbar_arrive(bars + 8 * (S + (i + S - 1) % S));
        } else if ((tid & 31) == 0) mbar_arrive(bars + 8 * (S + st));
    }
    if (LATE && (tid & 31) == 0 && n_it > 0) mbar_arrive(bars + 8 * (S + (n_it - 1) % S));
    out[blockIdx.x * 256 + tid] = acc;
}
"""

SHAPES = {"llama.qkv": (96, 32), "llama.o": (64, 32), "llama.gate_up": (448, 32), "llama.down": (64, 112),
          "dsv3.expert.gate_up": (64, 56), "dsv3.expert.down": (112, 16)}  # (64-row blocks, K tiles of 128)
dev = torch.device("cuda")
variants = [(l, S, m, U, sp, late, f) for l, S, m, U, sp, late, f in [("bulk4 S8", 8, 0, 1, 9216, 0, 0), ("+space 25600", 8, 0, 1, 25600, 0, 0), ("+late", 8, 0, 1, 25600, 1, 0), ("+fences", 8, 0, 1, 25600, 1, 1), ("late only", 8, 0, 1, 9216, 1, 0), ("fences only", 8, 0, 1, 9216, 0, 1)]]
grids = [int(g) for g in (sys.argv[1] if len(sys.argv) > 1 else "96,128").split(",")]
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES)
out = torch.empty(264 * 256 * 4, dtype=torch.int32, device=dev)
print("shape | G | " + " | ".join(v[0] for v in variants) + "   (us; TB/s)", flush=True)
for name in names:
    nrb, nkt = SHAPES[name]
    nbytes = nrb * nkt * 4608
    copies = copies_for(nbytes)
    bufs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev) for _ in range(copies)]
    for G in grids:
        cells = []
        for label, S, mode, U, sp, late, f in variants:
            if mode == 2 or G <= 132:
                k = nvrtc.kernel(SRC, f"probe<{S}, {mode}, {U}, {sp}, {late}, {f}>", dev, suffix="a")
                shared = S * sp + 16 * S if mode < 2 else 0
                def call(i, k=k, shared=shared):
                    b = bufs[i % copies]
                    k((G, 1, 1), (384, 1, 1), [b, b[nrb * nkt * 4096:], nkt, nrb // 2, out], False, shared)
                t = graph_time(call, copies)
                cells.append(f"{t * 1e6:6.2f} ({nbytes / t / 1e12:4.2f})")
            else:
                cells.append("-")
        print(f"{name:20s} | {G:3d} | " + " | ".join(cells), flush=True)
    del bufs
