"""Per-layer attention through the pieceworks FlashInfer backends vs raw FlashInfer, on one GPU.

Decode steps run in FULL CUDA graphs in pieceworks, so decode is timed the same way for both sides: one
graph holding the call for each of `--layers` layers (each layer its own KV cache, larger than L2),
replayed; time per call = replay time / layers. The pieceworks call is `backend.forward` (new K/V
written into the pool, then the kernel); the raw call is the FlashInfer wrapper's `run` on the same batch
and plan. Extend attention runs eagerly between piecewise graph pieces, so extend is timed eagerly.
The host-side plan (`backend.plan`, page table -> FlashInfer CSR + wrapper.plan) runs once per step for
all layers and is reported separately, with a whole decode step (plan + replay) at 1 and at all layers.

    python benchmarks/attention.py [--layers 16] [--out results.md]
    python benchmarks/attention.py --compile-only      # JIT-build the FlashInfer modules and exit
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
from common import md_table

from pieceworks.backends.attention.flashinfer import FlashInferAttentionBackend, FlashInferOptions, paged_kv_indices
from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.mla.flashinfer import FlashInferMLABackend, mla_plan_args
from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata
from pieceworks.executor.kv_cache import KVLayout, KVPool

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def step_meta(seqs: list[tuple[int, int]], page_size: int, graph: GraphMode, seed: int = 0) -> StepMetadata:
    """A step over sequences (prefix, new) with pages scattered over a pool of exactly their size + 1."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // page_size) for p, n in seqs]
    pages = (torch.randperm(sum(need), generator=gen) + 1).split(need)
    table = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    slots, positions = [], []
    for i, ((prefix, n), mine) in enumerate(zip(seqs, pages)):
        table[i, : len(mine)] = mine.to(torch.int32)
        for pos in range(prefix, prefix + n):
            slots.append(int(mine[pos // page_size]) * page_size + pos % page_size)
            positions.append(pos)
    mode = ForwardMode.classify([n for _, n in seqs], [p for p, _ in seqs])
    return StepMetadata(mode=mode, graph_mode=graph, extend_lens=[n for _, n in seqs],
                        prefix_lens=[p for p, _ in seqs], page_size=page_size, page_table=table.to(DEV),
                        slot_mapping=torch.tensor(slots, device=DEV), positions=torch.tensor(positions, device=DEV),
                        graph_batch_size=len(seqs) if graph is GraphMode.FULL else None)


def graph_ms(call, layers: int, iters: int = 50) -> float:
    """GPU time of one call, from a CUDA graph of `layers` calls replayed `iters` times."""
    for layer in range(layers):
        call(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            call(layer)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (iters * layers)


def eager_ms(call, layers: int, iters: int = 10) -> float:
    for layer in range(layers):
        call(layer)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for layer in range(layers):
            call(layer)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (iters * layers)


def host_ms(fn, iters: int = 30) -> float:
    """Median host wall time of fn() (GPU drained before each call)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------- MLA decode
def bench_mla(variant: str, layers: int, seqs=32, ctx=4096, heads=128, rank=512, rope=64, page_size=64) -> dict:
    import flashinfer
    from flashinfer.mla import MLAPlanMetadata

    facts = ModelFacts(arch="deepseek_v3", dtype=BF16, num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope,
                       page_size=page_size)
    backend = FlashInferMLABackend(BackendSpec.for_device(DEV, model=facts), FlashInferOptions(variant))
    meta = step_meta([(ctx - 1, 1)] * seqs, page_size, GraphMode.FULL)
    num_pages = int(meta.page_table.max()) + 1
    pool = KVPool(KVLayout("mla", layers, latent_dim=rank + rope), num_pages, page_size, BF16, DEV)
    pool.buffer.normal_(0, 0.5)
    g = torch.Generator(device=DEV).manual_seed(0)
    q_nope = torch.randn(seqs, heads, rank, device=DEV, dtype=BF16, generator=g) * 0.5
    q_pe = torch.randn(seqs, heads, rope, device=DEV, dtype=BF16, generator=g) * 0.5
    c_kv = torch.randn(seqs, rank, device=DEV, dtype=BF16, generator=g) * 0.5
    k_pe = torch.randn(seqs, rope, device=DEV, dtype=BF16, generator=g) * 0.5
    scale = (128 + rope) ** -0.5
    out_pw, out_raw = torch.empty_like(q_nope), torch.empty_like(q_nope)

    backend.plan(meta)
    backend.forward(q_nope, q_pe, c_kv, k_pe, out_pw, 0, scale, pool)  # learns the scale (one re-plan)
    plan_host = host_ms(lambda: backend.plan(meta))
    pw = graph_ms(lambda l: backend.forward(q_nope, q_pe, c_kv, k_pe, out_pw, l, scale, pool), layers)

    # raw FlashInfer: the same CSR metadata, a CUDA-graph wrapper, run per layer
    args = mla_plan_args(meta, scale, heads, rank, rope, BF16)
    csr = args.pop("csr")
    i32 = dict(dtype=torch.int32, device=DEV)
    raw = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device=DEV), use_cuda_graph=True,
        qo_indptr=torch.zeros(seqs + 1, **i32), kv_indptr=torch.zeros(seqs + 1, **i32),
        kv_indices=torch.zeros(csr["kv_indices"].numel(), **i32), kv_len_arr=torch.zeros(seqs, **i32), backend=variant)
    raw_plan = host_ms(lambda: raw.plan(metadata=MLAPlanMetadata.csr(**csr), **args))
    raw_ms = graph_ms(lambda l: raw.run(query=(q_nope, q_pe), kv_cache=pool.latent_cache(l), out=out_raw), layers)

    # the same step through both, and against the torch reference (layer 0)
    backend.plan(meta)
    backend.forward(q_nope, q_pe, c_kv, k_pe, out_pw, 0, scale, pool)
    raw.run(query=(q_nope, q_pe), kv_cache=pool.latent_cache(0), out=out_raw)
    from pieceworks.backends.mla.torch import TorchMLABackend

    ref = TorchMLABackend(BackendSpec.for_device(DEV, model=facts))
    ref.plan(meta)
    out_ref = torch.empty_like(q_nope)
    ref.forward(q_nope, q_pe, c_kv, k_pe, out_ref, 0, scale, pool)
    errs = dict(err_vs_raw=rel_err(out_pw, out_raw), err_vs_torch=rel_err(out_pw, out_ref))
    call = lambda l: backend.forward(q_nope, q_pe, c_kv, k_pe, out_pw, l, scale, pool)  # noqa: E731
    step = {n: _decode_step_ms(backend, meta, n, call) for n in (1, layers)}
    shape = f"{seqs} seq x {ctx} tok, {heads} heads, rank {rank}+{rope}, page {page_size}"
    return dict(case=f"MLA decode {variant}", shape=shape,
                raw_ms=raw_ms, pw_ms=pw, plan_ms=plan_host, raw_plan_ms=raw_plan, step_ms=step, **errs)


def _decode_step_ms(backend, meta, layers: int, call, iters: int = 20) -> float:
    """Host-to-done time of one decode step: plan once, replay a graph of `layers` calls."""
    graph = torch.cuda.CUDAGraph()
    backend.plan(meta)
    with torch.cuda.graph(graph):
        for layer in range(layers):
            call(layer)

    def step():
        backend.plan(meta)
        graph.replay()
        torch.cuda.synchronize()

    step()
    return host_ms(step, iters)


# ---------------------------------------------------------------- GQA decode and extend (Llama-3.1-8B)
def _gqa_setup(variant, seqs, page_size, graph, layers, heads=32, kv_heads=8, head_dim=128):
    facts = ModelFacts(dtype=BF16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size)
    # Tensor-core decode, as the raw FlashInfer call below (the backend's auto picks CUDA cores for 4 heads/KV).
    backend = FlashInferAttentionBackend(BackendSpec.for_device(DEV, model=facts),
                                         FlashInferOptions(variant, decode_tensor_cores=True))
    meta = step_meta(seqs, page_size, graph)
    pool = KVPool(KVLayout("gqa", layers, kv_heads, head_dim), int(meta.page_table.max()) + 1, page_size, BF16, DEV)
    pool.buffer.normal_()
    t = meta.num_tokens
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(t, heads, head_dim, device=DEV, dtype=BF16, generator=g)
    k = torch.randn(t, kv_heads, head_dim, device=DEV, dtype=BF16, generator=g)
    v = torch.randn(t, kv_heads, head_dim, device=DEV, dtype=BF16, generator=g)
    return backend, meta, pool, q, k, v


def bench_gqa_decode(variant: str, layers: int, seqs=32, ctx=4096, page_size=16) -> dict:
    import flashinfer

    backend, meta, pool, q, k, v = _gqa_setup(variant, [(ctx - 1, 1)] * seqs, page_size, GraphMode.FULL, layers)
    scale = 128**-0.5
    out_pw, out_raw = torch.empty_like(q), torch.empty_like(q)
    backend.plan(meta)
    plan_host = host_ms(lambda: backend.plan(meta))
    pw = graph_ms(lambda l: backend.forward(q, k, v, out_pw, l, scale, pool), layers)
    kv = paged_kv_indices(meta.page_table, meta.seq_lens, page_size)
    i32 = dict(dtype=torch.int32, device=DEV)
    raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device=DEV), "NHD", use_cuda_graph=True, use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.zeros(seqs + 1, **i32), paged_kv_indices_buffer=torch.zeros(kv.indices.numel(), **i32),
        paged_kv_last_page_len_buffer=torch.zeros(seqs, **i32), backend=backend.variant)
    plan = lambda: raw.plan(kv.indptr, kv.indices, kv.last_page_len, 32, 8, 128, page_size, q_data_type=BF16,  # noqa: E731
                            kv_data_type=BF16, sm_scale=scale)
    raw_plan = host_ms(plan)
    raw_ms = graph_ms(lambda l: raw.run(q, (pool.k_cache(l), pool.v_cache(l)), out=out_raw), layers)
    backend.plan(meta)
    backend.forward(q, k, v, out_pw, 0, scale, pool)
    raw.run(q, (pool.k_cache(0), pool.v_cache(0)), out=out_raw)
    from pieceworks.backends.attention.torch import TorchAttentionBackend

    ref, out_ref = TorchAttentionBackend(backend.spec), torch.empty_like(q)
    ref.plan(meta)
    ref.forward(q, k, v, out_ref, 0, scale, pool)
    errs = dict(err_vs_raw=rel_err(out_pw, out_raw), err_vs_torch=rel_err(out_pw, out_ref))
    step = {n: _decode_step_ms(backend, meta, n, lambda l: backend.forward(q, k, v, out_pw, l, scale, pool))
            for n in (1, layers)}
    return dict(case=f"GQA decode {backend.variant}", shape=f"{seqs} seq x {ctx} tok, 32/8 heads, d 128, page {page_size}",
                raw_ms=raw_ms, pw_ms=pw, plan_ms=plan_host, raw_plan_ms=raw_plan, step_ms=step, **errs)


def bench_gqa_extend(variant: str, layers: int, seqs=8, prefix=1536, new=512, page_size=16) -> dict:
    import flashinfer

    from pieceworks.backends.attention.flashinfer import qo_indptr

    backend, meta, pool, q, k, v = _gqa_setup(variant, [(prefix, new)] * seqs, page_size, GraphMode.PIECEWISE, layers)
    scale = 128**-0.5
    out_pw, out_raw = torch.empty_like(q), torch.empty_like(q)
    backend.plan(meta)
    plan_host = host_ms(lambda: backend.plan(meta))
    pw = eager_ms(lambda l: backend.forward(q, k, v, out_pw, l, scale, pool), layers)
    kv = paged_kv_indices(meta.page_table, meta.seq_lens, page_size)
    raw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device=DEV), "NHD",
                                                         backend=backend.variant)
    plan = lambda: raw.plan(qo_indptr(meta.extend_lens), kv.indptr, kv.indices, kv.last_page_len, 32, 8, 128,  # noqa: E731
                            page_size, causal=True, q_data_type=BF16, kv_data_type=BF16, sm_scale=scale)
    raw_plan = host_ms(plan)
    raw_ms = eager_ms(lambda l: raw.run(q, (pool.k_cache(l), pool.v_cache(l)), out=out_raw), layers)
    backend.plan(meta)
    backend.forward(q, k, v, out_pw, 0, scale, pool)
    raw.run(q, (pool.k_cache(0), pool.v_cache(0)), out=out_raw)
    shape = f"{seqs} seq x ({prefix} cached + {new} new), 32/8 heads, d 128"
    return dict(case=f"GQA extend {backend.variant} (eager)", shape=shape,
                raw_ms=raw_ms, pw_ms=pw, plan_ms=plan_host, raw_plan_ms=raw_plan, step_ms={},
                err_vs_raw=rel_err(out_pw, out_raw))


def compile_only() -> None:
    """Plan one tiny step per module the benchmark uses, so FlashInfer JIT-builds them (fa3 on Hopper)."""
    for seqs in ([(7, 1)], [(3, 5)]):
        gqa = ModelFacts(dtype=BF16, num_heads=32, num_kv_heads=8, head_dim=128)
        mla = ModelFacts(arch="deepseek_v3", dtype=BF16, num_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)
        for backend, facts in ((FlashInferAttentionBackend, gqa), (FlashInferMLABackend, mla)):
            t0 = time.perf_counter()
            impl = backend(BackendSpec.for_device(DEV, model=replace(facts, page_size=16)), FlashInferOptions("auto"))
            impl.plan(step_meta(seqs, 16, GraphMode.EAGER))
            print(f"built {backend.__name__} {impl.variant} for {seqs}: {time.perf_counter() - t0:.1f} s", flush=True)


def table(rows: list[dict], layers: int) -> str:
    cells = []
    for r in rows:
        step = " / ".join(f"{r['step_ms'][n]:.3f}" for n in sorted(r["step_ms"])) or "n/a (extend: eager)"
        vs_torch = f"{r['err_vs_torch']:.1e}" if "err_vs_torch" in r else "n/a"
        cells.append([r["case"], r["shape"], f"{r['raw_ms']:.4f}", f"{r['pw_ms']:.4f}", f"{r['pw_ms'] / r['raw_ms']:.3f}",
                      f"{r['plan_ms']:.3f} / {r['raw_plan_ms']:.3f}", step, f"{r['err_vs_raw']:.1e} / {vs_torch}"])
    return md_table(["case", "batch", "raw FlashInfer ms/layer", "pieceworks ms/layer", "ratio",
                     "plan ms/step (pieceworks / raw wrapper.plan)", f"decode step ms, 1 / {layers} layers",
                     "rel. err vs raw / vs torch reference"], cells, "l" * 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the markdown table (and a .json beside it) here")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--mla-fa2", action="store_true", help="also time FlashInfer MLA fa2")
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
        return
    rows = [bench_mla("auto", a.layers)]
    print(rows[-1], flush=True)
    if a.mla_fa2:
        rows.append(bench_mla("fa2", a.layers))
        print(rows[-1], flush=True)
    for fn in (bench_gqa_decode, bench_gqa_extend):
        rows.append(fn("auto", a.layers))
        print(rows[-1], flush=True)
    md = (f"GPU: {torch.cuda.get_device_name()}, torch {torch.version.__version__}, "
          f"flashinfer {__import__('flashinfer').__version__}, {a.layers} layers per graph\n\n" + table(rows, a.layers))
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            f.write(md + "\n")
        with open(a.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
