"""Run by tests/test_triton_k32_interp.py in a subprocess with TRITON_INTERPRET=1 (Triton's CPU interpreter
fixes its mode when a kernel is decorated, so it gets a fresh process): the NVFP4 GEMM K loop
(`triton_k32.fp4_tile_loop`) on k32 weights, on the CPU.

The interpreter has no bfloat16 dot and no float8 bitcast (its results are garbage), so three device
functions are swapped for float32 equivalents of the same values: the block-scale conversion, the
arithmetic e2m1 decode (USE_ASM off) and the dot. What this checks is the layout's index arithmetic:
which unit, scale and x column meet where (the tiled storage, the slots, the four-dot and one-dot
orders, perm_k's gathered x, two accumulator chains, x masked past K). Prints one JSON line per case: the relative error
against x @ dequantize(W).T in float64.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pieceworks.backends.fp4_gemm import triton_k32  # noqa: E402
from pieceworks.backends.fp4_gemm.k32 import repack_k32  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402


@triton.jit
def _e2m1_f32(sign, em, scale):
    e = (em >> 1) & 3
    m = (em & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(sign != 0, -mag, mag) * scale


@triton.jit
def _e4m3_f32(b):
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    return tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))


@triton.jit
def _scales_f32(s, USE_ASM: tl.constexpr):
    u = s.to(tl.int32)
    return _e4m3_f32(u & 0xFF) * 6.103515625e-05, _e4m3_f32((u >> 8) & 0xFF) * 6.103515625e-05


@triton.jit
def _mma_f32(acc, w, x, W_AS_A: tl.constexpr):
    if W_AS_A:
        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    return acc


triton_k32._e2m1_arith = _e2m1_f32
triton_k32.scales_k32 = _scales_f32
triton_k32._mma = _mma_f32


@triton.jit
def _loop_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, Kp, NUM_ITERS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_DOT: tl.constexpr, TWO_ACC: tl.constexpr,
                 W_AS_A: tl.constexpr, EVEN_K: tl.constexpr, PERM_K: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
    w_rows, s_rows = triton_k32.tile_row_bases(n_c, Kp)
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc, acc2 = triton_k32.fp4_tile_loop(
        acc, acc, x_ptr, rm.to(tl.int64) * K, rm < M, w_ptr, w_rows, w_rows, s_ptr, s_rows, s_rows, 0,
        NUM_ITERS, K, Kp, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, W_AS_A, False, False, ONE_DOT, TWO_ACC, PERM_K)
    if TWO_ACC:
        acc = acc + acc2
    if W_AS_A:
        acc = tl.trans(acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc * triton_k32.OUT_BIAS,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def run(m: int, n: int, k: int, block_k: int, one_dot: bool, two_acc: bool, w_as_a: bool, seed: int,
        perm_k: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    packed, scale, _ = nvfp4.quantize_weight(w)
    x = torch.randn(m, k, generator=gen).bfloat16()
    ref = x.double() @ nvfp4.dequantize(packed, scale, torch.ones(())).double().t()
    codes, scales = repack_k32(packed, scale)
    kp = codes.shape[1] * 2
    out = torch.zeros(m, n)
    _loop_kernel[(triton.cdiv(n, 32),)](x, codes.view(torch.int16), scales.view(torch.int16), out, m, n, k, kp,
                                        kp // block_k, 16, 32, block_k, one_dot, two_acc, w_as_a, k == kp, perm_k)
    return {"k32": float((out.double() - ref).norm() / ref.norm())}


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        print(json.dumps({"case": case, **run(*case)}), flush=True)
