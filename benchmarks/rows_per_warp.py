"""Probe: the CUDA decode GEMM with each warp covering RG row groups (16 RG weight rows) against the same x
registers, so that x is read once per 16 RG rows instead of once per 16 (plain epilogue only).

    python benchmarks/rows_per_warp.py [--ms 1,8,9,16] [--variants 8x1,8x2,16x2,4x2] [--shapes ...]
    python benchmarks/rows_per_warp.py --sass LIBNVRTC      # offline: registers and loop length, no GPU

Variants WxRG: warps per CTA x row groups per warp (RG 1 is the shipped kernel's schedule in this probe's
code). The probe's kernel is the shipped one cut down (cuda_decode_kernel.py: the same loads, decode and mma
helpers, 2 chunks of weights in flight per lane, x loaded just before its chunk's mmas; one CTA per RG
row groups, every warp a contiguous run of K); it is checked against dequantize + bf16 matmul and timed
like cuda_decode_gemm.py (CUDA-graph replays over >= 400 MB of weights, median of 7, PDL on), next to the
shipped kernel with cuda.plan's configuration. Not a backend: the nineteenth session's measurement of
what halving x's reads buys (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pieceworks.backends import nvrtc  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda_device import DEVICE_HELPERS  # noqa: E402

SOURCE = DEVICE_HELPERS + r"""
// y[M, N] = x[M, K] @ dequant(W).T, M <= 8 NT; CTA blockIdx.x owns row groups RG b .. RG b + RG - 1 (16 rows
// each, clamped to the last: those rows are read, never stored); warp w a contiguous run of the chunks.
template <int W, int NT, int RG>
__global__ void __launch_bounds__(W * 32) rows_probe(
    const U4* __restrict__ codes, const u16* __restrict__ scales, const u16* __restrict__ x,
    u16* __restrict__ out, const float* __restrict__ gscale, int M, int N, int nchunks, int ldx, int ldo, int nrg)
{
    __shared__ float red[W * RG * NT * 128];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int c_begin = (nchunks * warp) / W, nc = (nchunks * (warp + 1)) / W - c_begin;
    const U4* cp[RG];
    const u16* sp[RG];
#pragma unroll
    for (int r = 0; r < RG; ++r) {
        const size_t chunk0 = (size_t)min((int)blockIdx.x * RG + r, nrg - 1) * nchunks + c_begin;
        cp[r] = codes + chunk0 * 32 + lane;
        sp[r] = scales + chunk0 * 32 + lane;
    }
    const u16* xp[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) xp[i] = x + (size_t)min(8 * i + g, M - 1) * ldx + c_begin * 64 + 16 * t;
    U4 w[2][RG];
    u32 s[2][RG];
    float acc[RG][NT][4];
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][i][e] = 0.f;
#pragma unroll
    for (int r = 0; r < RG; ++r) {
        ld_stream(w[0][r], cp[r], 0 < nc);
        ld_scale(s[0][r], sp[r], 0 < nc);
    }
    PDL_WAIT();
    // STEP(B, O, C): chunk C (at offset O from the pointers) from buffer B, chunk C + 1's weights into B ^ 1
#define SLOT(J, B, R) do { \
        const u32 a0 = bmul(slot<J>(w[B][R].x), sg), a1 = bmul(slot<J>(w[B][R].z), sh), \
                  a2 = bmul(slot<J>(w[B][R].y), sg), a3 = bmul(slot<J>(w[B][R].w), sh); \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) { \
            const U4& q = xv[i][J >> 1]; \
            mma(acc[R][i], a0, a1, a2, a3, (J & 1) ? q.z : q.x, (J & 1) ? q.w : q.y); \
        } \
    } while (0)
#define STEP(B, O, C) do { \
        _Pragma("unroll") for (int r = 0; r < RG; ++r) { \
            ld_stream(w[(B) ^ 1][r], cp[r] + ((O) + 1) * 32, (C) + 1 < nc); \
            ld_scale(s[(B) ^ 1][r], sp[r] + ((O) + 1) * 32, (C) + 1 < nc); \
        } \
        U4 xv[NT][2]; \
        _Pragma("unroll") for (int i = 0; i < NT; ++i) { \
            ld_x(xv[i][0], (const U4*)(xp[i] + (O) * 64), true); \
            ld_x(xv[i][1], (const U4*)(xp[i] + (O) * 64 + 8), true); \
        } \
        _Pragma("unroll") for (int r = 0; r < RG; ++r) { \
            const u32 h = scale_pair(s[B][r]); \
            const u32 sg = prmt(h, 0x1010u), sh = prmt(h, 0x3232u); \
            SLOT(0, B, r); \
            SLOT(1, B, r); \
            SLOT(2, B, r); \
            SLOT(3, B, r); \
        } \
    } while (0)
    int c = 0;
    for (; c + 2 <= nc; c += 2) {
        STEP(0, 0, c);
        STEP(1, 1, c + 1);
#pragma unroll
        for (int r = 0; r < RG; ++r) cp[r] += 64, sp[r] += 64;
#pragma unroll
        for (int i = 0; i < NT; ++i) xp[i] += 128;
    }
    if (c < nc) STEP(0, 0, c);
#undef STEP
#undef SLOT
    PDL_TRIGGER();
#pragma unroll
    for (int r = 0; r < RG; ++r)
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) red[((warp * RG + r) * NT + i) * 128 + lane * 4 + e] = acc[r][i][e];
    __syncthreads();
    const float gs = *gscale * 16384.0f;
    for (int idx = threadIdx.x; idx < RG * NT * 128; idx += W * 32) {
        const int r = idx / (NT * 128), i = (idx >> 7) % NT, q = idx & 127;
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < W; ++ww) v += red[((ww * RG + r) * NT + i) * 128 + q];
        const int l = q >> 2, e = q & 3;
        const int token = 8 * i + 2 * (l & 3) + (e & 1), n = ((int)blockIdx.x * RG + r) * 16 + (l >> 2) + 8 * (e >> 1);
        if (token < M && n < N) out[(size_t)token * ldo + n] = to_bf16(v * gs);
    }
}
"""


def probe_gemm(x, codes, scales, gscale, n: int, warps: int, rg: int, pdl: bool = True):
    m, k = x.shape
    nrg, nch, _ = codes.shape
    nt = -(-m // 8)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    run = nvrtc.kernel(SOURCE, f"rows_probe<{warps}, {nt}, {rg}>", x.device)
    run((-(-nrg // rg), 1, 1), (warps * 32, 1, 1),
                 [codes, scales, x, out, gscale, m, n, nch, x.stride(0), out.stride(0), nrg], pdl)
    return out


def sass(lib: str) -> None:
    from cuda_sass import compiled, main_loop, use_nvrtc

    use_nvrtc(lib)
    for nt in (1, 2):
        for w in (2, 4, 8, 16):
            for rg in (1, 2):
                regs, listing = compiled(SOURCE, f"rows_probe<{w}, {nt}, {rg}>", "sm_90")
                loop = main_loop(listing)
                print(f"rows_probe<{w}, {nt}, {rg}>: {regs} registers, main loop {len(loop)} instructions "
                      f"per 2 chunks ({16 * rg} rows)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,9,16")
    ap.add_argument("--variants", default="2x1,2x2,4x1,4x2,8x1,8x2,16x1,16x2")
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--sass", metavar="LIBNVRTC", help="offline: registers and loop lengths, then exit")
    args = ap.parse_args()
    if args.sass:
        return sass(args.sass)
    from fp4_gemm import SHAPES, copies_for, graph_time, random_weights
    from pieceworks.backends.fp4_gemm import cuda, cuda_decode, r16c64
    from pieceworks.quant import nvfp4

    variants = [tuple(int(a) for a in v.split("x")) for v in args.variants.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in (args.shapes.split(",") if args.shapes else SHAPES):
        n, k = SHAPES[name]
        copies = copies_for(n * k * 0.5625)
        raw = random_weights(n, k, copies, gen)
        weights = [(*r16c64.repack_decode(w, s), gs) for w, s, gs in raw]
        wd = nvfp4.dequantize(*raw[0], torch.bfloat16)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = (x @ wd.t()).float()
            warps, depth = cuda.plan(n, sms)
            cells = [f"shipped {warps}x{depth}=" + "%.2f" % (1e6 * graph_time(
                lambda i: cuda_decode.decode_gemm(x, *weights[i % copies], n, warps, depth, pdl=True), copies))]
            for wp, rg in variants:
                y = probe_gemm(x, *weights[0], n, wp, rg).float()
                err = float((y - ref).norm() / ref.norm())
                if not err < 1e-2:
                    raise SystemExit(f"{name} M={m} {wp}x{rg}: relative error {err:.3g}")
                t = graph_time(lambda i: probe_gemm(x, *weights[i % copies], n, wp, rg), copies)
                cells.append(f"{wp}x{rg}={t * 1e6:.2f}")
            print(f"{name} M={m}: " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
