"""The default NVFP4 GEMM backend (`fp4_gemm.triton`: M <= 16 on its CUDA decode kernel, 17..1024 on its
wgmma kernel (sm_90; the fused Triton tiles elsewhere), dequantize + cuBLAS above) vs torch bf16 matmul
(cuBLAS) on Llama-3.1-8B and DeepSeek-V3 expert shapes.

    python benchmarks/fp4_gemm.py --ms 1,4,8,16 --pdl on --out DIR   # the shipped tile table
    python benchmarks/fp4_gemm.py --table T.json --out DIR           # another tile table
    python benchmarks/fp4_gemm.py --sweep [--sweep-m 32] --out DIR   # try candidate tiles per M bucket
                                             # first, then benchmark the best table (DIR/gemm_sweep.json)

Times are CUDA-graph replays of back-to-back calls that rotate over enough weight copies (>= 400 MB)
that L2 (60 MB on the H200) never serves a weight twice; the median of 7 replays, per call. Bandwidth
counts packed weights + block scales + activations in + out, against 4.24 TB/s. Each line's relative
error is one call against dequantize + bf16 matmul. Needs a CUDA GPU and triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

import torch
from common import (HBM, SHAPES, add_pdl_option, configure_pdl, copies_for, fp4_bytes, graph_time, md_table,
                    random_nvfp4, rel_err, time_bf16)

from pieceworks.backends.base import BackendSpec
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
from pieceworks.backends.fp4_gemm.triton import TileConfig, TritonFp4GemmBackend, choose_split_k, parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES
from pieceworks.quant import nvfp4

MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
# The M at which each bucket of the table is tuned, and the bucket's upper bound.
BUCKETS = [(1, 8), (16, 16), (32, 32), (64, 64), (256, 256), (1024, 1024), (16384, None)]


def random_weights(n: int, k: int, copies: int, gen: torch.Generator):
    """`copies` independent k32-layout NVFP4 weights (random bytes are random codes in any layout)."""
    return [random_nvfp4(n, k, gen) for _ in range(copies)]


def check_once(backend, x, w, n) -> float:
    """Relative error of one call against dequantize + bf16 matmul (the torch reference)."""
    from pieceworks.backends.fp4_gemm.k32 import unpack_k32, unpack_scales_k32

    weight, scale, gs = w
    k = x.shape[1]
    codes = unpack_k32(weight, k, n)
    s = unpack_scales_k32(scale, n)[:, : k // 16].float()
    wd = (nvfp4.e2m1_decode(codes) * (s * gs).repeat_interleave(16, 1)).to(torch.bfloat16)
    ref = (x @ wd.t()).float()
    return rel_err(backend.forward(x, weight, scale, gs, gs, n), ref)


_WEIGHTS: dict = {}


def weights_for(n: int, k: int, gen):
    """Rotation copies of a random weight of this shape, made once per run."""
    if (n, k) not in _WEIGHTS:
        _WEIGHTS[(n, k)] = random_weights(n, k, copies_for(n * k * 0.5625), gen)
    return _WEIGHTS[(n, k)]


def time_fp4(backend, m: int, n: int, k: int, gen) -> float:
    ws = weights_for(n, k, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    return graph_time(lambda i: backend.forward(x, *ws[i % len(ws)], ws[0][2], n), len(ws))


def backend_with(table) -> TritonFp4GemmBackend:
    backend = TritonFp4GemmBackend(BackendSpec.for_device("cuda", fp4_numerics="w4a16"))
    backend.table = table
    return backend


# --- tile sweep --------------------------------------------------------------------------------------


def candidates(m: int) -> list[dict]:
    out = []
    if m <= 16:
        # The 64x256 one_dot tile beat 128x128 / 256x128 one_dot and every mma.sync tile (docs/benchmarks.md);
        # 64x128 one_dot fits 6 programs per SM instead of 4, so it is tried with more programs.
        out.append(dict(block_m=16, block_n=64, block_k=256, num_stages=3, w_as_a=True, one_dot=True,
                        target_ctas=264, max_split=16))
        for target, min_iters in ((264, 2), (396, 2), (396, 4)):  # the same, wave-balanced splits
            out.append(dict(block_m=16, block_n=64, block_k=256, num_stages=3, w_as_a=True, one_dot=True,
                            target_ctas=target, max_split=16, balance_waves=True, min_split_iters=min_iters))
        for target, stages in ((264, 3), (528, 3), (792, 3), (1056, 3), (792, 4)):
            out.append(dict(block_m=16, block_n=64, block_k=128, num_stages=stages, w_as_a=True,
                            one_dot=True, target_ctas=target, max_split=16))
        if m <= 8:
            # 8-row tiles: Triton runs the dot as mma.sync m16n8k16 with the decoded weights as the
            # register A operand and x as an n8 B operand (half the MMA work of the 16-column wgmma).
            for target, two, perm, bal in ((264, True, False, False), (396, True, True, True),
                                           (396, False, False, False)):
                out.append(dict(block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=3, w_as_a=True,
                                one_dot=False, target_ctas=target, max_split=16, two_acc=two, perm_k=perm,
                                balance_waves=bal))
            for target, min_iters in ((396, 3), (396, 4), (528, 4), (264, 4)):
                out.append(dict(block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=3, w_as_a=True,
                                one_dot=False, target_ctas=target, max_split=16, two_acc=True,
                                balance_waves=True, min_split_iters=min_iters))
    if m > 16:  # the wgmma kernel's token tiles up to the bucket's M (sm_90; dequantize + cuBLAS elsewhere)
        out += [dict(kind="wgmma", block_m=bm, num_stages=cuda_wgmma.max_stages(bm))
                for bm in cuda_wgmma.BLOCK_MS if bm <= max(64, m)]
    if 16 < m <= 64:
        for bn, bk, one_dot in ((64, 128, False), (128, 128, False), (64, 256, False), (64, 128, True),
                                (128, 128, True), (64, 256, True)):
            for target in (264, 528):
                out.append(dict(block_m=m, block_n=bn, block_k=bk, num_stages=3, w_as_a=True,
                                one_dot=one_dot, target_ctas=target, max_split=8))
        for target, min_iters in ((264, 2), (396, 2), (396, 4)):  # the shipped tile, wave-balanced splits
            out.append(dict(block_m=m, block_n=64, block_k=128, num_stages=3, w_as_a=True, one_dot=True,
                            target_ctas=target, max_split=8, balance_waves=True, min_split_iters=min_iters))
        for target, min_iters in ((264, 2), (396, 4)):  # wave-balanced splits of the block_k 256 tile
            out.append(dict(block_m=m, block_n=64, block_k=256, num_stages=3, w_as_a=True, one_dot=True,
                            target_ctas=target, max_split=8, balance_waves=True, min_split_iters=min_iters))
    elif 64 < m <= 256:
        for bm, bn, bk, wa, od in ((64, 128, 128, True, False), (128, 128, 128, True, False),
                                   (64, 128, 128, True, True), (128, 128, 128, True, True)):
            out.append(dict(block_m=bm, block_n=bn, block_k=bk, num_warps=8, num_stages=3,
                            w_as_a=wa, one_dot=od, group_m=8, target_ctas=132, max_split=4))
    elif m > 256:
        for bn, bk, wa in ((128, 128, True), (256, 128, True), (128, 128, False)):  # block_k: whole 128-wide tiles
            out.append(dict(block_m=128, block_n=bn, block_k=bk, num_warps=8, num_stages=3,
                            w_as_a=wa, group_m=8))
        out.append(dict(kind="dequant"))
    return out


def _compile_job(job):
    cfg, n, k, m, split = job
    from pieceworks.backends.fp4_gemm import triton_kernels

    torch.cuda.set_device(0)
    gen = torch.Generator("cuda").manual_seed(0)
    (w, s, gs), = random_weights(n, k, 1, gen)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    try:
        triton_kernels.fp4_gemm(x, w, s, gs, n, k, TileConfig(**cfg), split, counters)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, the config is then skipped
        return f"{cfg} n={n} k={k}: {type(e).__name__}: {str(e)[:300]}"


def precompile(jobs, workers: int) -> list[str]:
    """Compile every (config, specialization) in parallel processes; Triton's disk cache keeps them."""
    import multiprocessing as mp

    seen, unique = set(), []
    for job in jobs:
        cfg, n, k, m, split = job
        kp = -(-k // 512) * 512
        # What Triton specializes on: the constexprs (split or not, even K), not the sizes.
        key = json.dumps([cfg, split > 1, k == kp], sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(job)
    with mp.get_context("spawn").Pool(workers) as pool:
        return [e for e in pool.map(_compile_job, unique, chunksize=1) if e]


def sweep_jobs(buckets) -> list:
    jobs = []
    for m_tune, _ in buckets:
        for cand in candidates(m_tune):
            tile = TileConfig(**cand)
            for n, k in SHAPES.values():
                if tile.kind == "fused":
                    jobs.append((cand, n, k, m_tune, choose_split_k(tile, m_tune, n, k)))
    return jobs


def shipped_buckets(shipped: list[dict], lo: int, hi: int | None) -> list[dict]:
    """The buckets of `shipped` over rows lo + 1..hi (None: no bound), the last one bounded at hi: what a
    bucket that is not swept keeps."""
    out = []
    for t in shipped:
        top = t["max_m"]
        if top is not None and top <= lo:
            continue
        out.append(dict(t, max_m=hi if top is None or (hi is not None and top >= hi) else top))
        if out[-1]["max_m"] == hi:
            return out
    return out


def sweep(out_dir: str, gen, workers: int, only_m=None) -> list[dict]:
    """Tune the buckets whose tuning M is in `only_m` (all when None); the others keep the shipped
    table's entries."""
    buckets = [b for b in BUCKETS if only_m is None or b[0] in only_m]
    jobs = sweep_jobs(buckets)
    t0 = time.time()
    errors = precompile(jobs, workers)
    print(f"precompiled {len(jobs)} jobs in {time.time() - t0:.0f}s; {len(errors)} failed", flush=True)
    for e in errors[:10]:
        print("  compile error:", e, flush=True)

    rows, table, lo = [], [], 0
    for m_tune, max_m in BUCKETS:
        if (m_tune, max_m) not in buckets:
            table.extend(shipped_buckets(FP4_GEMM_TILES, lo, max_m))
            lo = max_m
            continue
        lo = max_m
        scores = []
        for cand in candidates(m_tune):
            tile = TileConfig(max_m=None, **cand)
            backend = backend_with((tile,))
            times, ok = {}, True
            for name, (n, k) in SHAPES.items():
                try:
                    ws = weights_for(n, k, gen)[0]
                    x = torch.randn(m_tune, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                    err = check_once(backend, x, ws, n)
                    if not err < 1e-2:
                        print(f"  WRONG m={m_tune} {name} {cand}: rel err {err:.3g}", flush=True)
                        ok = False
                        break
                    times[name] = time_fp4(backend, m_tune, n, k, gen)
                except Exception as e:
                    print(f"  FAILED m={m_tune} {name} {cand}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    ok = False
                    break
            if ok:
                scores.append((cand, times))
                rows.append(dict(m=m_tune, cfg=cand, times_us={k: v * 1e6 for k, v in times.items()}))
        best_per_shape = {name: min(t[name] for _, t in scores) for name in SHAPES}
        ranked = sorted(scores, key=lambda s: sum(math.log(s[1][n] / best_per_shape[n]) for n in SHAPES))
        best = ranked[0][0]
        loss = {n: ranked[0][1][n] / best_per_shape[n] for n in SHAPES}
        print(f"M={m_tune}: best {best} (x of per-shape best: "
              + ", ".join(f"{n.split('.')[-1]} {v:.2f}" for n, v in loss.items()) + ")", flush=True)
        table.append(dict(max_m=max_m, **{k: v for k, v in TileConfig(**best).__dict__.items()
                                          if k != "max_m"}))
    with open(os.path.join(out_dir, "gemm_sweep.json"), "w") as f:
        json.dump(dict(rows=rows, table=table), f, indent=1)
    return table


# --- benchmark ---------------------------------------------------------------------------------------


def benchmark(table, out_dir: str, gen, ms=MS) -> list[dict]:
    backend, results = backend_with(parse_table(table)), []
    sms = multiprocessors(torch.device("cuda"))  # what triton_kernels.fp4_gemm passes to cuda_wgmma.plan
    for name, (n, k) in SHAPES.items():
        for m in ms:
            ws = weights_for(n, k, gen)[0]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            err = check_once(backend, x, ws, n)
            t_fp4 = time_fp4(backend, m, n, k, gen)
            t_bf16 = time_bf16(m, n, k, gen)
            tile, split = backend._plan(m, n, k)  # a wgmma tile's own split: cuda_wgmma.plan, in "wgmma"
            wg = tile.kind == "wgmma" and cuda_wgmma.plan(m, n, k, tile.block_m, tile.num_stages,
                                                          tile.narrow_block_m, sms)
            row = dict(shape=name, m=m, n=n, k=k, fp4_us=t_fp4 * 1e6, bf16_us=t_bf16 * 1e6,
                       speedup=t_bf16 / t_fp4, fp4_tbps=fp4_bytes(m, n, k) / t_fp4 / 1e12,
                       hbm_frac=fp4_bytes(m, n, k) / t_fp4 / HBM,
                       fp4_tflops=2 * m * n * k / t_fp4 / 1e12, bf16_tflops=2 * m * n * k / t_bf16 / 1e12,
                       rel_err=err, tile=dataclasses.asdict(tile), split_k=split,
                       wgmma=dict(zip(("block_m", "stages", "split", "tail", "stream_k"), wg)) if wg else None)
            results.append(row)
            print(f"{name:22s} M={m:6d}  fp4 {row['fp4_us']:9.1f} us  bf16 {row['bf16_us']:9.1f} us  "
                  f"x{row['speedup']:5.2f}  {row['fp4_tbps']:5.2f} TB/s ({100 * row['hbm_frac']:3.0f}%)  "
                  f"{row['fp4_tflops']:6.1f} TFLOP/s  err {err:.1e}", flush=True)
    with open(os.path.join(out_dir, "gemm_bench.json"), "w") as f:
        json.dump(dict(table=table, results=results, device=torch.cuda.get_device_name()), f, indent=1)
    return results


def markdown(results) -> str:
    return md_table(["shape (N x K)", "M", "fp4 us", "bf16 us", "speedup", "TB/s", "% of 4.24", "fp4 TFLOP/s"],
                    [[f"{r['shape']} ({r['n']}x{r['k']})", r["m"], f"{r['fp4_us']:.1f}", f"{r['bf16_us']:.1f}",
                      f"{r['speedup']:.2f}", f"{r['fp4_tbps']:.2f}", f"{100 * r['hbm_frac']:.0f}%",
                      f"{r['fp4_tflops']:.0f}"] for r in results])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--sweep", action="store_true", help="tune the tile table first")
    parser.add_argument("--table", help="a JSON tile table to benchmark (default: the shipped one)")
    parser.add_argument("--workers", type=int, default=14, help="processes compiling the sweep")
    parser.add_argument("--sweep-m", help="comma-separated tuning Ms to sweep (default: all buckets)")
    parser.add_argument("--ms", help="comma-separated Ms to benchmark (default: %s)" % MS)
    add_pdl_option(parser)
    args = parser.parse_args()
    configure_pdl(args)
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.sweep:
        only = [int(v) for v in args.sweep_m.split(",")] if args.sweep_m else None
        table = sweep(args.out, gen, args.workers, only)
    elif args.table:
        with open(args.table) as f:
            table = json.load(f)
    else:
        table = FP4_GEMM_TILES
    print("table:", json.dumps(table), flush=True)
    ms = [int(v) for v in args.ms.split(",")] if args.ms else MS
    results = benchmark(table, args.out, gen, ms)
    md = markdown(results)
    with open(os.path.join(args.out, "gemm_bench.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
