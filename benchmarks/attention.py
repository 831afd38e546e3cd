"""Per-layer attention through the pieceworks FlashInfer backends vs raw FlashInfer, on one GPU.

Decode steps run in FULL CUDA graphs in pieceworks, so decode is timed the same way for both sides: one
graph holding the call for each of `--layers` layers (each layer its own KV cache, larger than L2),
replayed; time per call = replay time / layers. The pieceworks call is `backend.forward` (new K/V
written into the pool, then the kernel); the raw call is the FlashInfer wrapper's `run` on the same batch
and plan. Extend attention runs eagerly between piecewise graph pieces, so extend is timed eagerly.
The host-side plan (`backend.plan`, page table -> FlashInfer CSR + wrapper.plan) runs once per step for
all layers and is reported separately, with a whole decode step (plan + replay) at 1 and at all layers.

    python benchmarks/attention.py [--layers 16] [--variant auto|fa2|fa3] [--out results.md]
    python benchmarks/attention.py --compile-only      # JIT-build the FlashInfer modules and exit
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch
from common import graph_time, md_table, rel_err, wall_ms

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


def graph_ms(call, layers: int) -> float:
    """GPU time of one call: median of 50 replays of a CUDA graph of `layers` calls."""
    return graph_time(call, layers, replays=50) * 1e3


def eager_ms(call, layers: int) -> float:
    return wall_ms(lambda: [call(layer) for layer in range(layers)], 10) / layers


def host_ms(fn) -> float:
    """Median host wall time of fn() (GPU drained before each call)."""
    return wall_ms(fn, 30, wait=False)


def measure(case: str, shape: str, backend, meta, layers: int, call, out, raw_plan, raw_call, raw_out,
            reference=None, timed=graph_ms) -> dict:
    """One row: host ms of one plan and ms per layer (`timed`) of the backend's `call(layer)` and of raw
    FlashInfer's, and the relative error of the backend's layer-0 output against raw FlashInfer's and
    against `reference()` (the torch backend's output); with a reference (decode), the step ms of 1 and
    `layers` layers."""
    backend.plan(meta)
    row = dict(case=case, shape=shape, plan_ms=host_ms(lambda: backend.plan(meta)), pw_ms=timed(call, layers),
               raw_plan_ms=host_ms(raw_plan), raw_ms=timed(raw_call, layers), step_ms={})
    backend.plan(meta)
    call(0)
    raw_call(0)
    row["err_vs_raw"] = rel_err(out, raw_out)
    if reference is not None:
        row["err_vs_torch"] = rel_err(out, reference())
        row["step_ms"] = {n: decode_step_ms(backend, meta, n, call) for n in (1, layers)}
    return row


def decode_step_ms(backend, meta, layers: int, call) -> float:
    """Host-to-done time of one decode step: plan once, replay a graph of `layers` calls."""
    graph = torch.cuda.CUDAGraph()
    backend.plan(meta)
    with torch.cuda.graph(graph):
        for layer in range(layers):
            call(layer)
    return wall_ms(lambda: (backend.plan(meta), graph.replay()), 20)


def bench_mla(variant: str, layers: int, seqs=32, ctx=4096, heads=128, rank=512, rope=64, page_size=64) -> dict:
    import flashinfer
    from flashinfer.mla import MLAPlanMetadata

    from pieceworks.backends.mla.torch import TorchMLABackend

    facts = ModelFacts(arch="deepseek_v3", dtype=BF16, num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope,
                       page_size=page_size)
    backend = FlashInferMLABackend(BackendSpec.for_device(DEV, model=facts), FlashInferOptions(variant))
    meta = step_meta([(ctx - 1, 1)] * seqs, page_size, GraphMode.FULL)
    num_pages = int(meta.page_table.max()) + 1
    pool = KVPool(KVLayout("mla", layers, latent_dim=rank + rope), num_pages, page_size, BF16, DEV)
    pool.buffer.normal_(0, 0.5)
    g = torch.Generator(device=DEV).manual_seed(0)
    q_nope, q_pe, c_kv, k_pe = (torch.randn(*shape, device=DEV, dtype=BF16, generator=g) * 0.5
                                for shape in ((seqs, heads, rank), (seqs, heads, rope), (seqs, rank), (seqs, rope)))
    scale = (128 + rope) ** -0.5
    out, raw_out = torch.empty_like(q_nope), torch.empty_like(q_nope)
    call = lambda l: backend.forward(q_nope, q_pe, c_kv, k_pe, out, l, scale, pool)  # noqa: E731
    backend.plan(meta)
    call(0)  # learns the scale (one re-plan)

    # raw FlashInfer: the same CSR metadata, a CUDA-graph wrapper, run per layer
    args = mla_plan_args(meta, scale, heads, rank, rope, BF16)
    csr = args.pop("csr")
    i32 = dict(dtype=torch.int32, device=DEV)
    raw = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device=DEV), use_cuda_graph=True,
        qo_indptr=torch.zeros(seqs + 1, **i32), kv_indptr=torch.zeros(seqs + 1, **i32),
        kv_indices=torch.zeros(csr["kv_indices"].numel(), **i32), kv_len_arr=torch.zeros(seqs, **i32), backend=variant)

    def reference():
        ref, ref_out = TorchMLABackend(BackendSpec.for_device(DEV, model=facts)), torch.empty_like(q_nope)
        ref.plan(meta)
        ref.forward(q_nope, q_pe, c_kv, k_pe, ref_out, 0, scale, pool)
        return ref_out

    shape = f"{seqs} seq x {ctx} tok, {heads} heads, rank {rank}+{rope}, page {page_size}"
    return measure(f"MLA decode {variant}", shape, backend, meta, layers, call, out,
                   lambda: raw.plan(metadata=MLAPlanMetadata.csr(**csr), **args),
                   lambda l: raw.run(query=(q_nope, q_pe), kv_cache=pool.latent_cache(l), out=raw_out), raw_out,
                   reference)


def bench_gqa(variant: str, layers: int, seqs: list[tuple[int, int]], heads=32, kv_heads=8, head_dim=128,
              page_size=16) -> dict:
    """Llama-3.1-8B attention over sequences (prefix, new): a decode step when every new is 1 (graphs,
    FlashInfer's tensor-core decode, the torch reference), else an extend step (eager, FlashInfer prefill)."""
    import flashinfer

    from pieceworks.backends.attention.flashinfer import qo_indptr
    from pieceworks.backends.attention.torch import TorchAttentionBackend

    decode = all(n == 1 for _, n in seqs)
    facts = ModelFacts(dtype=BF16, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size)
    # Tensor-core decode, as the raw FlashInfer call below (the backend's auto picks CUDA cores for 4 heads/KV).
    backend = FlashInferAttentionBackend(BackendSpec.for_device(DEV, model=facts),
                                         FlashInferOptions(variant, decode_tensor_cores=True))
    meta = step_meta(seqs, page_size, GraphMode.FULL if decode else GraphMode.PIECEWISE)
    pool = KVPool(KVLayout("gqa", layers, kv_heads, head_dim), int(meta.page_table.max()) + 1, page_size, BF16, DEV)
    pool.buffer.normal_()
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(meta.num_tokens, h, head_dim, device=DEV, dtype=BF16, generator=g)
               for h in (heads, kv_heads, kv_heads))
    scale = head_dim**-0.5
    out, raw_out = torch.empty_like(q), torch.empty_like(q)
    kv = paged_kv_indices(meta.page_table, meta.seq_lens, page_size)
    shapes = dict(q_data_type=BF16, kv_data_type=BF16, sm_scale=scale)
    buffer = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    if decode:
        i32 = dict(dtype=torch.int32, device=DEV)
        raw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            buffer, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend=backend.variant,
            paged_kv_indptr_buffer=torch.zeros(len(seqs) + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(kv.indices.numel(), **i32),
            paged_kv_last_page_len_buffer=torch.zeros(len(seqs), **i32))
        plan = lambda: raw.plan(kv.indptr, kv.indices, kv.last_page_len, heads, kv_heads, head_dim,  # noqa: E731
                                page_size, **shapes)
    else:
        raw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(buffer, "NHD", backend=backend.variant)
        plan = lambda: raw.plan(qo_indptr(meta.extend_lens), kv.indptr, kv.indices, kv.last_page_len,  # noqa: E731
                                heads, kv_heads, head_dim, page_size, causal=True, **shapes)

    def reference():
        ref, ref_out = TorchAttentionBackend(backend.spec), torch.empty_like(q)
        ref.plan(meta)
        ref.forward(q, k, v, ref_out, 0, scale, pool)
        return ref_out

    prefix, new = seqs[0]
    case = f"GQA decode {backend.variant}" if decode else f"GQA extend {backend.variant} (eager)"
    shape = (f"{len(seqs)} seq x {prefix + 1} tok, {heads}/{kv_heads} heads, d {head_dim}, page {page_size}"
             if decode else f"{len(seqs)} seq x ({prefix} cached + {new} new), {heads}/{kv_heads} heads, d {head_dim}")
    return measure(case, shape, backend, meta, layers, lambda l: backend.forward(q, k, v, out, l, scale, pool), out,
                   plan, lambda l: raw.run(q, (pool.k_cache(l), pool.v_cache(l)), out=raw_out), raw_out,
                   reference if decode else None, graph_ms if decode else eager_ms)


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
    ap.add_argument("--variant", default="auto", choices=("auto", "fa2", "fa3"), help="FlashInfer's (auto: fa3 on sm_90)")
    a = ap.parse_args()
    if a.compile_only:
        compile_only()
        return
    rows = []
    for bench, seqs in ((bench_mla, ()), (bench_gqa, ([(4095, 1)] * 32,)), (bench_gqa, ([(1536, 512)] * 8,))):
        rows.append(bench(a.variant, a.layers, *seqs))
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
