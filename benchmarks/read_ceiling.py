"""How fast one kernel can only read a decode GEMM's bytes: the ceiling a GEMM of that shape meets per call.

    python benchmarks/read_ceiling.py [--shapes llama.qkv,...] [--pdl]

For each shape of fp4_gemm.py, a read-only CUDA kernel streams as many bytes as the M = 1 GEMM reads
(packed codes + block scales; x and y are a few KB) laid out as the decode GEMM's CTAs read them (one CTA
per 16 weight rows, its warps splitting the slab into contiguous runs), each lane XOR-folding what it
loads into one word per CTA (so nothing is optimized away), in the same CUDA-graph timing as the GEMM
benchmarks (back-to-back calls rotating over >= 400 MB of copies, median of 7 replays). Two ways to keep
bytes in flight: the register ring (each lane D 16-byte loads ahead: `ring WxD`) and bulk copies into
shared memory (each warp S stages of G 576-byte chunks: `bulk WxSxG`). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import HBM, SHAPES, copies_for, graph_time  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda_device import DEVICE_HELPERS  # noqa: E402
from pieceworks.backends.nvrtc import kernel  # noqa: E402

SOURCE = DEVICE_HELPERS + r"""
// Bulk copies (cp.async.bulk) into shared memory, completed on an mbarrier (one arrival: the expect_tx).
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n fence.mbarrier_init.release.cluster;"
                 :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_to_smem(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

// CTA blockIdx.x reads chunks [blockIdx.x * nchunks, + nchunks) of 576 bytes (codes 512 + scales 64, as
// one run here); warp w its share, lane l the 16-byte words l, l + 32, ... of each chunk (36 per chunk).
template <int W, int D>
__global__ void __launch_bounds__(W * 32) read_ring(const U4* __restrict__ p, int nchunks, u32* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (nchunks * warp) / W, c1 = (nchunks * (warp + 1)) / W;
    const U4* q = p + ((size_t)blockIdx.x * nchunks + c0) * 36 + lane;
    const int words = (c1 - c0) * 36;  // this warp's 16-byte words
    U4 buf[D];
    u32 acc = 0;
    PDL_WAIT();
    int i = 0;
    for (; i + 32 * D <= words; i += 32 * D) {
#pragma unroll
        for (int d = 0; d < D; ++d) ld_stream(buf[d], q + i + 32 * d, true);
#pragma unroll
        for (int d = 0; d < D; ++d) acc ^= buf[d].x ^ buf[d].y ^ buf[d].z ^ buf[d].w;
    }
    for (; i < words; i += 32) {  // the run's last words, fewer than 32 D
        U4 v;
        v.x = v.y = v.z = v.w = 0;
        ld_stream(v, q + i, i + lane < words);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    PDL_TRIGGER();
    if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;  // never (almost): keeps the loads
}

template <int W, int S, int G>
__global__ void __launch_bounds__(W * 32) read_bulk(const U4* __restrict__ p, int nchunks, u32* out) {
    __shared__ __align__(8) unsigned long long bars[W * S];
    extern __shared__ __align__(128) unsigned char ring[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (nchunks * warp) / W, c1 = (nchunks * (warp + 1)) / W, nc = c1 - c0;
    const U4* q = p + ((size_t)blockIdx.x * nchunks + c0) * 36;
    const U4* mine = (const U4*)ring + warp * S * G * 36;
    auto issue = [&](int st, int j) {
        const int cnt = min(G, nc - j * G);
        const u32 bar = smem_addr(&bars[warp * S + st]);
        mbar_expect(bar, cnt * 576);
        bulk_to_smem(smem_addr(mine + st * G * 36), q + j * G * 36, cnt * 576, bar);
    };
    if (lane == 0) {
        for (int st = 0; st < S; ++st) mbar_init(smem_addr(&bars[warp * S + st]));
        for (int st = 0; st < S && st * G < nc; ++st) issue(st, st);
    }
    __syncwarp();
    PDL_WAIT();
    u32 acc = 0;
    for (int j = 0; j * G < nc; ++j) {
        const int st = j % S, cnt = min(G, nc - j * G);
        mbar_wait(smem_addr(&bars[warp * S + st]), (j / S) & 1);
        for (int i = lane; i < cnt * 36; i += 32) {
            const U4 v = mine[st * G * 36 + i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        if (lane == 0 && (j + S) * G < nc) issue(st, j + S);
    }
    PDL_TRIGGER();
    if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}
"""

RINGS = [(2, 2), (2, 4), (4, 2), (4, 4), (8, 2), (8, 4), (16, 2), (16, 4), (8, 8)]
BULKS = [(2, 2, 4), (2, 3, 4), (4, 2, 4), (8, 2, 4), (8, 3, 4), (16, 2, 4), (16, 2, 2), (8, 4, 4), (4, 4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--pdl", action="store_true")
    args = ap.parse_args()
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ctas, nchunks = -(-n // 16), -(-k // 64)
        nbytes = ctas * nchunks * 576
        copies = copies_for(nbytes)
        bufs = [torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
        cells = []
        for w, d in RINGS:
            f = kernel(SOURCE, f"read_ring<{w}, {d}>", bufs[0].device)
            t = graph_time(lambda i: f((ctas, 1, 1), (w * 32, 1, 1), [bufs[i % copies], nchunks, out], args.pdl),
                           copies)
            cells.append((t, f"ring {w}x{d}"))
        for w, s, g in BULKS:
            f = kernel(SOURCE, f"read_bulk<{w}, {s}, {g}>", bufs[0].device)
            shared = w * s * g * 576
            t = graph_time(lambda i: f((ctas, 1, 1), (w * 32, 1, 1), [bufs[i % copies], nchunks, out], args.pdl,
                                       shared=shared), copies)
            cells.append((t, f"bulk {w}x{s}x{g}"))
        best = min(cells)
        print(f"{name}: {nbytes / 1e6:.1f} MB, " + " ".join(f"{c}={t * 1e6:.2f}" for t, c in cells)
              + f" | best {best[1]} {best[0] * 1e6:.2f} us ({nbytes / best[0] / HBM:.0%} of {HBM / 1e12} TB/s)",
              flush=True)
        bufs.clear()  # free the copies before the next shape


if __name__ == "__main__":
    main()
