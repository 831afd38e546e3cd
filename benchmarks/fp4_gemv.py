"""Experiment: a GEMV-style NVFP4 kernel (CUDA-core FMAs, no tensor cores) for M <= 8, swept against
the shipped tile table and bf16. Not used by the backend: measured on the H200 (2026-12-01, see
docs/benchmarks.md) it beat the shipped split-K wgmma tiles only at M = 1 on the smaller shapes
(qkv, o, expert down: 15-20%) and lost from M = 2 on.

    python benchmarks/fp4_gemv.py --out DIR

Same timing method as benchmarks/fp4_gemm.py (CUDA-graph replays rotating over >= 400 MB of weight
copies). Every timed configuration is first checked against dequantize + bf16 matmul. Writes
DIR/gemv_sweep.json and prints the best configuration per shape and M.

The kernel:
    A GEMV-style Triton kernel for weight-only NVFP4 at a handful of rows (decode): no tensor cores.

    When it was written, the wgmma path of `triton_kernels` padded M <= 4 to 16 rows and spent more issue
    slots on MMA bookkeeping than on decoding (since the eighth session M <= 8 runs an 8-row mma.sync
    tile, not compared with this kernel); here every program streams BLOCK_N weight rows
    over the whole of K with plain FMAs, so there is no split-K and no second kernel. The weight layout
    is the same k32 layout (see fp4_gemm/triton_k32.py), decoded by the same `decode_tile`.

    Two accumulation schemes (constexpr BF16_PARTIAL):
    - False: every product in fp32 (exact w4a16 numerics up to fp32 summation order);
    - True: the four slot products of each k32 unit are summed with bf16x2 FMAs (4 values, rounded to
      bf16 three times) before the fp32 accumulation: fewer instructions per weight, relative error of a
      dot product around 1e-3 (bf16's own rounding of the output is 2e-3).

    Prefetch: the next K tile's weights and scales are loaded before the current one is decoded, so each
    warp keeps two tiles of loads in flight (Triton pipelines loads only into shared memory for dots).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4_gemm import (  # noqa: E402
    HBM,
    SHAPES,
    backend_with,
    fp4_bytes,
    graph_time,
    random_weights,
    time_bf16,
    time_fp4,
    weights_for,
)

from pieceworks.backends.fp4_gemm.k32 import tile_k32, unpack_k32, unpair_scales  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import parse_table  # noqa: E402
from pieceworks.backends.fp4_gemm.triton_k32 import OUT_BIAS, decode_tile  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402


@triton.jit
def _fma_bf16x2(a, b, c):
    return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _mul_bf16x2(a, b):
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit(do_not_specialize=["M"])
def _fp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_om, num_iters,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, BF16_PARTIAL: tl.constexpr, USE_ASM: tl.constexpr,
):  # USE_ASM=False: plain Triton arithmetic (for the interpreter in tests)
    BQ: tl.constexpr = BLOCK_K // 4
    BG: tl.constexpr = BLOCK_K // 32
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_c = tl.where(rn < N, rn, N - 1).to(tl.int64)  # rows past N re-read row N-1, never stored
    rm = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BQ)
    xc = (c // 32) * 128 + (c // 8) % 4 * 16 + c % 8  # element of slot 0 of k32 unit c (k32.element_of)
    t32 = tl.arange(0, BG)  # scale pair (int16) within the tile
    w_ptrs = w_ptr + (n_c * stride_wn)[:, None] + c[None, :]
    s_ptrs = s_ptr + (n_c * stride_sn)[:, None] + t32[None, :]
    x_ptrs = x_ptr + (rm.to(tl.int64) * stride_xm)[:, None] + xc[None, :]
    xm = (rm < M)[:, None]
    shape: tl.constexpr = (BLOCK_M, BLOCK_N, BQ)
    acc = tl.zeros(shape, dtype=tl.float32)
    w = tl.load(w_ptrs)
    s = tl.load(s_ptrs)
    for it in range(num_iters):
        more = it + 1 < num_iters
        w_next = tl.load(w_ptrs + BQ, mask=more, other=0)
        s_next = tl.load(s_ptrs + BG, mask=more, other=0)
        if EVEN_K:
            x0 = tl.load(x_ptrs, mask=xm, other=0.0)
            x1 = tl.load(x_ptrs + 8, mask=xm, other=0.0)
            x2 = tl.load(x_ptrs + 64, mask=xm, other=0.0)
            x3 = tl.load(x_ptrs + 72, mask=xm, other=0.0)
        else:
            xk = (it * BLOCK_K + xc)[None, :]
            x0 = tl.load(x_ptrs, mask=xm & (xk < K), other=0.0)
            x1 = tl.load(x_ptrs + 8, mask=xm & (xk + 8 < K), other=0.0)
            x2 = tl.load(x_ptrs + 64, mask=xm & (xk + 64 < K), other=0.0)
            x3 = tl.load(x_ptrs + 72, mask=xm & (xk + 72 < K), other=0.0)
        x0, x1, x2, x3 = x0.to(tl.bfloat16), x1.to(tl.bfloat16), x2.to(tl.bfloat16), x3.to(tl.bfloat16)
        v0, v1, v2, v3 = decode_tile(w, s, BLOCK_N, BLOCK_K, USE_ASM)
        if BF16_PARTIAL and USE_ASM:
            p = _mul_bf16x2(tl.broadcast_to(v0[None, :, :], shape), tl.broadcast_to(x0[:, None, :], shape))
            p = _fma_bf16x2(tl.broadcast_to(v1[None, :, :], shape), tl.broadcast_to(x1[:, None, :], shape), p)
            p = _fma_bf16x2(tl.broadcast_to(v2[None, :, :], shape), tl.broadcast_to(x2[:, None, :], shape), p)
            p = _fma_bf16x2(tl.broadcast_to(v3[None, :, :], shape), tl.broadcast_to(x3[:, None, :], shape), p)
            acc += p.to(tl.float32)
        elif BF16_PARTIAL:
            p = (v0[None, :, :] * x0[:, None, :]).to(tl.bfloat16)
            p = (p + v1[None, :, :] * x1[:, None, :]).to(tl.bfloat16)
            p = (p + v2[None, :, :] * x2[:, None, :]).to(tl.bfloat16)
            p = (p + v3[None, :, :] * x3[:, None, :]).to(tl.bfloat16)
            acc += p.to(tl.float32)
        else:
            acc += v0.to(tl.float32)[None, :, :] * x0.to(tl.float32)[:, None, :]
            acc += v1.to(tl.float32)[None, :, :] * x1.to(tl.float32)[:, None, :]
            acc += v2.to(tl.float32)[None, :, :] * x2.to(tl.float32)[:, None, :]
            acc += v3.to(tl.float32)[None, :, :] * x3.to(tl.float32)[:, None, :]
        w = w_next
        s = s_next
        w_ptrs += BQ
        s_ptrs += BG
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2) * (tl.load(gs_ptr) * OUT_BIAS)  # [BM, BN]; undo decode_k32's 2^-14
    offs = rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp4_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
             N: int, K: int, block_n: int, block_k: int, num_warps: int, bf16_partial: bool,
             use_asm: bool = True) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(W).T for M <= 8, W in the k32 layout (see `fp4_gemm`)."""
    M = x.shape[0]
    Kp = weight.shape[1] * 2
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    assert M <= 8 and Kp % block_k == 0, (M, Kp, block_k)
    _fp4_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight.view(torch.int16), weight_scale.view(torch.int16), weight_scale_2, out,
        M, N, K, x.stride(0), weight.stride(0) // 2, weight_scale.stride(0) // 2, out.stride(0), Kp // block_k,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K == Kp, BF16_PARTIAL=bf16_partial, USE_ASM=use_asm, num_warps=num_warps, num_stages=1,
    )
    return out


CONFIGS = [dict(block_n=bn, block_k=bk, num_warps=nw, bf16_partial=bp)
           for bn, bk, nw, bp in itertools.product((4, 8, 16), (256, 512), (2, 4), (False, True))]
MS = (1, 2, 4, 8)


def _compile(job):
    cfg, m, n, k = job
    gen = torch.Generator("cuda").manual_seed(0)
    (w, s, gs), = random_weights(n, -(-k // 512) * 512, 1, gen)  # k32 weights are padded to 512
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    try:
        fp4_gemv(x, w, s, gs, n, k, **cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{cfg} m={m}: {type(e).__name__}: {str(e)[:400]}"


def rel_err(cfg, x, w, n) -> float:
    weight, scale, gs = w
    k = x.shape[1]
    # this kernel reads the units row-major (the layout before the tiled storage); the reference decodes them that way
    blocks = unpair_scales(scale)[:, : k // 16]  # this kernel's row-major scale pairs -> block order
    wd = (nvfp4.e2m1_decode(unpack_k32(tile_k32(weight), k)) * (blocks.float() * gs).repeat_interleave(16, 1))
    ref = (x @ wd.to(torch.bfloat16).t()).float()
    y = fp4_gemv(x, weight, scale, gs, n, k, **cfg).float()
    return float((y - ref).norm() / ref.norm())


def time_gemv(cfg, m, n, k, gen) -> float:
    ws = weights_for(n, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    return graph_time(lambda i: fp4_gemv(x, *ws[i % len(ws)], n, k, **cfg), len(ws))


def main() -> None:
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    t0 = time.time()
    # Triton specializes on BLOCK_M (next power of 2 of M) and EVEN_K; one shape per K class is enough.
    jobs = [(cfg, m, 256, k) for cfg in CONFIGS for m in MS for k in (4096, 1024 + 512 + 16 * 33)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = [e for e in pool.map(_compile, jobs, chunksize=1) if e]
    print(f"compiled {len(jobs)} in {time.time() - t0:.0f}s, {len(errors)} failed", flush=True)
    for e in errors[:5]:
        print("  ", e, flush=True)
    shipped = backend_with(parse_table(__import__("pieceworks.backends.fp4_gemm.triton_tiles",
                                                  fromlist=["x"]).FP4_GEMM_TILES))
    rows = []
    for name, (n, k) in SHAPES.items():
        w0 = weights_for(n, k, gen)[0]
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            best = None
            for cfg in CONFIGS:
                try:
                    err = rel_err(cfg, x, w0, n)
                    if not err < 1e-2:
                        print(f"  WRONG {name} m={m} {cfg}: {err:.3g}", flush=True)
                        continue
                    t = time_gemv(cfg, m, n, k, gen)
                except Exception as e:
                    print(f"  FAILED {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                rows.append(dict(shape=name, m=m, cfg=cfg, us=t * 1e6, err=err))
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            t_ship = time_fp4(shipped, m, n, k, gen)
            t_bf16 = time_bf16(m, n, k, gen)
            if best is None:
                continue
            t, cfg, err = best
            print(f"{name:22s} M={m}  gemv {t * 1e6:7.1f} us ({fp4_bytes(m, n, k) / t / HBM * 100:3.0f}% of HBM, "
                  f"x{t_bf16 / t:4.2f} bf16)  shipped {t_ship * 1e6:7.1f} us  bf16 {t_bf16 * 1e6:7.1f} us  "
                  f"err {err:.1e}  {cfg}", flush=True)
            rows.append(dict(shape=name, m=m, best=cfg, gemv_us=t * 1e6, shipped_us=t_ship * 1e6,
                             bf16_us=t_bf16 * 1e6, err=err))
    with open(os.path.join(args.out, "gemv_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
