"""The dequantizing kernel of the `cuda` fp4_gemm backend: an r16c64 weight (r16c64.py) back to bf16 [N, K] for
the rows above `decode_max_m`, where the backend runs dequantize + torch.matmul. The device helpers (scale
pair, slot decode, bf16 multiply) are cuda_device.py's, shared with the decode GEMM (cuda_decode_kernel.py). Imports
torch only; each template instance is compiled on its first launch.
"""

from __future__ import annotations

import torch

from pieceworks.backends.fp4_gemm.cuda_device import DEVICE_HELPERS
from pieceworks.backends.nvrtc import kernel

SOURCE = DEVICE_HELPERS + r"""
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


def dequant(codes, scales, gscale, n: int, k: int, swiglu: bool = False, pdl: bool = False):
    """bf16 [n, k] = e2m1 * scale * weight_scale_2 (swiglu: the interleaved gate/up rows put back in
    checkpoint order [gate; up])."""
    rg, ch, _ = codes.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=codes.device)
    kernel(SOURCE, f"nvfp4_decode_dequant<{int(swiglu)}>", codes.device)(
        (rg, -(-ch // 8), 1), (256, 1, 1), [codes, scales, out, gscale, n, k, ch, out.stride(0)], pdl)
    return out
