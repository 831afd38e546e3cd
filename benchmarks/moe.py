"""The fused NVFP4 MoE (w4a16) on one DeepSeek-V3 MoE layer: 256 experts, top-8 (8 groups, 4 kept), hidden
7168, moe_intermediate 2048. `moe.triton` (the default) runs up to `cuda_moe_max_t` tokens on the CUDA
decode kernel's MoE modes and larger batches on its Triton grouped GEMMs.

    python benchmarks/moe.py --out DIR             # the shipped MoE tile table
    python benchmarks/moe.py --sweep --out DIR     # try candidate tiles per token bucket first (add
                                                   # --cuda-moe-max-t 0 to benchmark them at decode sizes too)
    python benchmarks/moe.py --backend cuda --out DIR   # the CUDA MoE (moe.cuda) instead
    python benchmarks/moe.py --cuda-moe-max-t 0 --out DIR   # moe.triton without its CUDA decode path
    python benchmarks/moe.py --bf16 --tokens 256,1024,4096 --out DIR   # + bf16 experts (torch._grouped_mm)

For each token count T: the whole op (routing + align + both grouped GEMMs + combine) and the expert
part alone (align + GEMMs + combine on routed ids), as CUDA-graph replays that rotate over 8 routing
draws (fresh router logits, so different experts each call). Decode is reported as bandwidth over the
expert weights actually touched (unique experts of each draw x 24.8 MB), against 4.24 TB/s; prefill
as TFLOP/s. Writes DIR/moe_bench.json (the tile table and every row) and DIR/moe_bench.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from common import HBM, add_pdl_option, configure_pdl, graph_time, ints, md_table

from pieceworks.backends.base import BackendSpec
from pieceworks.backends.fp4_gemm.triton import TileConfig, parse_table
from pieceworks.backends.fp4_gemm.triton_tiles import MOE_TILES
from pieceworks.backends.moe.align import num_aligned_blocks
from pieceworks.backends.moe.base import MoEWeights
from pieceworks.backends.moe.routing import deepseek_route
from pieceworks.backends.moe.triton import TritonMoEBackend

E, H, I, TOPK, GROUPS, TOPK_GROUP, SCALE = 256, 7168, 2048, 8, 8, 4, 2.5
TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
BUCKETS = [(1, 4), (16, 16), (64, 64), (256, 256), (1024, 1024), (16384, None)]
EXPERT_BYTES = (2 * I * H + H * I) * (0.5 + 1 / 16)
DRAWS = 8


def random_moe(gen, experts: int = E) -> MoEWeights:
    """k32-layout random experts (random bytes are random codes in any layout)."""
    def mat(rows, cols):
        w = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = (torch.rand(experts, rows, cols // 16, device="cuda", generator=gen) * 2 + 0.05).to(torch.float8_e4m3fn)
        return w, s

    w13, s13 = mat(2 * I, H)
    w2, s2 = mat(H, I)
    ones = torch.ones(experts, device="cuda")
    return MoEWeights(w13, s13, torch.full((experts, 2), 0.01, device="cuda"), ones, w2, s2,
                      torch.full((experts,), 0.01, device="cuda"), ones)


def draws(t: int, gen, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` (x bf16 [t, H], router logits float32 [t, E])."""
    return [(torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=gen),
             torch.randn(t, E, device="cuda", generator=gen)) for _ in range(n)]


def bf16_experts(x, weights, ids, w13, w2):
    """The expert part in bf16 as a grouped-GEMM MoE runs it: pairs sorted by expert, x gathered, torch._grouped_mm
    over [E, H, 2I] gate/up and [E, I, H] down weights, SwiGLU, routing weights, summed per token (capturable)."""
    experts, topk, inter = w13.shape[0], ids.shape[1], w2.shape[1]
    order = ids.flatten().argsort(stable=True)
    ends = torch.searchsorted(ids.flatten()[order], torch.arange(1, experts + 1, device=x.device)).to(torch.int32)
    h = torch._grouped_mm(x[order // topk], w13, offs=ends)
    h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(h, w2, offs=ends) * weights.flatten()[order, None].to(h.dtype)
    return torch.zeros_like(x).index_add_(0, order // topk, y)


def candidates(t: int) -> list[dict]:
    # 8-row tiles (mma.sync m16n8k16, weights as the A operand, four dots) for decode-sized T
    # (perm_k: each thread of an MMA quad holds whole groups, so it converts a quarter of the scales)
    eight = [dict(block_m=8, block_n=bn, block_k=256, num_warps=w, num_stages=3, w_as_a=True, one_dot=False,
                  perm_k=p) for bn, w, p in ((64, 4, True), (128, 4, True), (64, 4, False), (128, 4, False),
                                             (32, 2, False), (128, 8, False))]
    if t <= 4:
        return eight[4:] + candidates(16)
    if 16 < t <= 64:
        return eight[:4] + candidates(256)
    if t <= 16:
        # (block_n, block_k, w_as_a, one_dot, stages); block_n 32 puts 64 weight rows (gate + up) in a
        # program, as the dense GEMM's decode tile does (Triton then uses mma.sync, not wgmma)
        return eight[:4] + [dict(block_m=16, block_n=bn, block_k=bk, num_stages=st, w_as_a=wa, one_dot=od)
                            for bn, bk, wa, od, st in ((64, 256, True, True, 3), (128, 256, True, True, 3),
                                                       (64, 128, True, True, 3), (64, 256, False, False, 3),
                                                       (128, 256, False, False, 3), (32, 256, True, True, 3),
                                                       (64, 256, True, True, 4))]
    if t <= 256:
        return [dict(block_m=bm, block_n=bn, block_k=bk, num_stages=3, w_as_a=wa, one_dot=od)
                for bm, bn, bk, wa, od in ((16, 64, 128, True, True), (16, 64, 256, True, True),
                                           (32, 64, 128, True, True), (64, 64, 128, True, True),
                                           (16, 64, 256, False, False), (16, 128, 256, False, False))]
    return [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=8, num_stages=3, w_as_a=True)
            for bm, bn, bk in ((64, 128, 128), (128, 128, 128), (64, 256, 128))]  # block_k: whole 128-wide tiles


def _compile_job(cand):
    """Compile both grouped GEMMs of one tile config on a 16-expert copy of the layer's shapes."""
    from pieceworks.backends.moe import triton_kernels as mk

    torch.cuda.set_device(0)
    e = 16
    w = random_moe(torch.Generator("cuda").manual_seed(0), e)
    x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    weights, ids = deepseek_route(torch.randn(4, e, device="cuda"), torch.empty(0, device="cuda"),
                                  TOPK, GROUPS, TOPK_GROUP, True, SCALE)
    tile = TileConfig(**cand)
    try:
        blocks = num_aligned_blocks(ids.numel(), e, tile.block_m)
        aligned = mk.align_gpu(ids, e, tile.block_m, blocks)
        mk.fused_moe(x, w.w13, w.w13_scale, w.w13_scale_2, w.w2, w.w2_scale, w.w2_scale_2, weights.contiguous(),
                     *aligned, TOPK, tile)
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{cand}: {type(exc).__name__}: {str(exc)[:300]}"


def precompile(workers: int) -> None:
    import multiprocessing as mp

    cands = list({json.dumps(c, sort_keys=True): c for t, _ in BUCKETS for c in candidates(t)}.values())  # unique
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(_compile_job, cands, chunksize=1) if e]
    print(f"precompiled {len(cands)} MoE tile configs in {time.time() - t0:.0f}s; {len(errors)} failed", flush=True)
    for e in errors:
        print("  compile error:", e, flush=True)


class Bench:
    def __init__(self, gen, backend: str = "triton", cuda_moe_max_t: int | None = None):
        self.gen = gen
        self.bias = torch.randn(E, device="cuda", generator=gen) * 0.01
        spec = BackendSpec.for_device("cuda", fp4_numerics="w4a16")
        if backend == "cuda":
            from pieceworks.backends.moe.cuda import CudaMoEBackend

            self.backend = CudaMoEBackend(spec)
            self.w = self.backend.prepare(random_moe(gen))  # r16c64 per expert
        else:
            from pieceworks.backends.fp4_gemm.triton import TritonTileOptions

            opts = TritonTileOptions() if cuda_moe_max_t is None else TritonTileOptions(cuda_moe_max_t=cuda_moe_max_t)
            self.backend = TritonMoEBackend(spec, opts)
            self.w = random_moe(gen)  # already the prepared shapes (I a multiple of 64, H of 512)

    def full(self, x, logits):
        return self.backend.forward(x, logits, self.bias, self.w, TOPK, GROUPS, TOPK_GROUP, True, SCALE)

    def experts(self, x, routed, tile):
        """The expert part as the backend runs it; a `tile` (sweeps): the Triton grouped GEMMs with it."""
        weights, ids = routed
        if self.backend.name == "cuda":
            return self.backend.experts(x, weights, ids, self.w)
        return self.backend.experts(x, weights, ids, self.w, tile)

    def route(self, logits):
        w, ids = deepseek_route(logits, self.bias, TOPK, GROUPS, TOPK_GROUP, True, SCALE)
        return w.contiguous(), ids

    def time_experts(self, t, tile, sets) -> float:
        routed = [self.route(lg) for _, lg in sets]
        return graph_time(lambda i: self.experts(sets[i % len(sets)][0], routed[i % len(sets)], tile),
                          len(sets), replays=5)

    def time_full(self, sets) -> float:
        return graph_time(lambda i: self.full(*sets[i % len(sets)]), len(sets), replays=5)


def sweep(bench: Bench, gen, only_t=None) -> list[dict]:
    """Tune the buckets whose tuning T is in `only_t` (all when None); the others keep MOE_TILES'."""
    table = []
    for t, max_m in BUCKETS:
        if only_t is not None and t not in only_t:
            table.append(next(row for row in MOE_TILES if row["max_m"] == max_m))
            continue
        sets = draws(t, gen, DRAWS if t <= 256 else 2)
        best = None
        for cand in candidates(t):
            tile = TileConfig(**cand)
            try:
                dt = bench.time_experts(t, tile, sets)
            except Exception as e:
                print(f"  FAILED T={t} {cand}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"  T={t} {cand}: {dt * 1e6:.1f} us", flush=True)
            if best is None or dt < best[1]:
                best = (cand, dt)
        print(f"T={t}: best {best[0]} {best[1] * 1e6:.1f} us", flush=True)
        table.append(dict(max_m=max_m, **best[0]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--precompile-only", action="store_true", help="compile the sweep's kernels and exit")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--sweep-t", help="comma-separated tuning Ts to sweep (default: all buckets)")
    parser.add_argument("--tokens", help="comma-separated Ts to benchmark (default: %s)" % TOKENS)
    parser.add_argument("--backend", default="triton", choices=("triton", "cuda"))
    parser.add_argument("--bf16", action="store_true", help="also time bf16 experts (torch._grouped_mm; +22.5 GB)")
    parser.add_argument("--cuda-moe-max-t", type=int, default=None,
                        help="moe.triton's backends.options.triton.cuda_moe_max_t (default: the option's default)")
    add_pdl_option(parser)
    args = parser.parse_args()
    configure_pdl(args)
    os.makedirs(args.out, exist_ok=True)
    if args.precompile_only:
        precompile(args.workers)
        return
    gen = torch.Generator("cuda").manual_seed(0)
    t0 = time.time()
    bench = Bench(gen, args.backend, args.cuda_moe_max_t)
    print(f"weights ready in {time.time() - t0:.1f}s; {torch.cuda.memory_allocated() / 1e9:.1f} GB", flush=True)
    if args.sweep and args.backend == "cuda":
        raise SystemExit("--sweep tunes the Triton MoE's tiles; the cuda backend has none")
    table = sweep(bench, gen, ints(args.sweep_t) if args.sweep_t else None) if args.sweep else MOE_TILES
    if args.backend == "triton":
        bench.backend.table = parse_table(table)
        print("table:", json.dumps(table), flush=True)
    results = []
    if args.bf16:  # random bf16 experts, each [K, N] a transposed [N, K] (K-major)
        w13, w2 = (torch.randn(E, n, k, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(0.02).transpose(1, 2)
                   for n, k in ((2 * I, H), (H, I)))
    for t in ints(args.tokens) if args.tokens else TOKENS:
        sets = draws(t, gen, DRAWS if t <= 256 else 2)
        cuda_path = args.backend == "cuda" or t <= bench.backend.options.cuda_moe_max_t
        tile = bench.backend.tile(t) if not cuda_path else None
        touched = [int(bench.route(logits)[1].unique().numel()) for _, logits in sets]
        nbytes = sum(touched) / len(touched) * EXPERT_BYTES + 2 * t * H * 2
        t_full = bench.time_full(sets)
        t_exp = bench.time_experts(t, None, sets)
        flops = 2 * t * TOPK * 3 * H * I
        row = dict(tokens=t, experts_touched=sum(touched) / len(touched), full_us=t_full * 1e6,
                   experts_us=t_exp * 1e6, touched_gb=nbytes / 1e9,
                   full_hbm_frac=nbytes / t_full / HBM, experts_hbm_frac=nbytes / t_exp / HBM,
                   tflops=flops / t_full / 1e12, backend=args.backend,
                   path="cuda" if cuda_path else "triton", tile=dataclasses.asdict(tile) if tile else None)
        if args.bf16:
            routed = [bench.route(logits) for _, logits in sets]
            row["bf16_experts_us"] = 1e6 * graph_time(
                lambda i: bf16_experts(sets[i % len(sets)][0], *routed[i % len(sets)], w13, w2), len(sets), replays=5)
        results.append(row)
        print(f"T={t}: whole op {row['full_us']:.1f} us, experts-only {row['experts_us']:.1f} us"
              + (f", bf16 experts {row['bf16_experts_us']:.1f} us" if args.bf16 else ""), flush=True)
    with open(os.path.join(args.out, "moe_bench.json"), "w") as f:
        json.dump(dict(table=table, results=results, device=torch.cuda.get_device_name()), f, indent=1)
    md = md_table(["T", "experts touched", "full op us", "experts-only us", "touched GB",
                   "% of 4.24 TB/s (full / experts)", "TFLOP/s"],
                  [[r["tokens"], f"{r['experts_touched']:.1f}", f"{r['full_us']:.1f}", f"{r['experts_us']:.1f}",
                    f"{r['touched_gb']:.2f}", f"{100 * r['full_hbm_frac']:.0f}% / {100 * r['experts_hbm_frac']:.0f}%",
                    f"{r['tflops']:.0f}"] for r in results], "r" * 7)
    with open(os.path.join(args.out, "moe_bench.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
