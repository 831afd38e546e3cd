"""Alternated A/B of a piecewise extend step: (a) plan after the first replay +
CUDA K/V write, (b) plan first + CUDA K/V write, (c) plan first + Triton K/V write; whole graph on a second
executor (its buffers never re-planned)."""
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")  # run from the repository root
import torch
from common import sync
from graphs import whole_graph

from pieceworks import Executor
from pieceworks.backends import kv_write_cuda
from pieceworks.core.batch import ForwardMode, GraphMode

base = ["model.arch=llama", "model.preset=llama-3.1-8b", "kv_cache.num_tokens=16384",
        "cuda_graph.decode.enabled=off", "backends.attention=flashinfer", "backends.options.flashinfer.variant=fa2"]
ex = Executor.from_config(None, base + ["cuda_graph.piecewise.enabled=on",
                                        "cuda_graph.piecewise.sizes=[16,64,128,256]"], progress=False)
ex2 = Executor.from_config(None, base + ["cuda_graph.piecewise.enabled=off"], progress=False)
real_unsupported = kv_write_cuda.unsupported
for T in [int(t) for t in sys.argv[1].split(",")]:
    toks = [torch.randint(0, ex.vocab_size, (T,)).tolist()]
    seq, seq2 = ex.new_sequence(), ex2.new_sequence()
    pages, pages2 = ex._reserve_pages([seq], toks), ex2._reserve_pages([seq2], toks)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], toks, ex.piecewise.padded_size(T))
    k = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)
    att = k.attention
    bound = {}
    for name, unsupported in (("triton", lambda *a: "off"), ("cuda", real_unsupported)):
        kv_write_cuda.unsupported = unsupported
        att._bound = {}
        for _ in range(3):
            ex.run_model(k, meta, ids)
        bound[name] = dict(att._bound)
    sync()
    meta2, ids2 = ex2.prepare_step(ForwardMode.EXTEND, GraphMode.EAGER, [seq2], toks)
    graph = whole_graph(ex2, ex2.table.step(ForwardMode.EXTEND, GraphMode.EAGER), meta2, ids2)
    overlaps = type(att).plan_overlaps_gpu
    ids_sep, meta_sep = ids.clone(), __import__("dataclasses").replace(meta, positions=meta.positions.clone())
    variants = {"a: late plan, cuda kv, 1 copy": (True, "cuda", False), "b: plan first, cuda kv": (False, "cuda", False),
                "c: plan first, triton kv": (False, "triton", False),
                "d: plan first, triton kv, 2 copies (old)": (False, "triton", True), "whole graph": None}
    out = {v: [] for v in variants}
    for _ in range(50):
        for v, how in variants.items():
            if how is not None:
                att.plan_overlaps_gpu = (lambda m: overlaps(att, m)) if how[0] else (lambda m: False)
                att._bound = bound[how[1]]
                fn = (lambda: ex.run_model(k, meta_sep, ids_sep)) if how[2] else (lambda: ex.run_model(k, meta, ids))
            else:
                fn = graph.replay
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out[v].append((time.perf_counter() - t0) * 1e3)
    w = statistics.median(out["whole graph"])
    print(f"T={T}: " + ", ".join(f"{v} {statistics.median(x):.3f} ms (gap {statistics.median(x) - w:.3f})"
                                 for v, x in out.items()), flush=True)
    graph = None
    att._bound = {}
    ex._release([seq], pages)
    ex2._release([seq2], pages2)
    ex.free(seq)
    ex2.free(seq2)
    torch.cuda.empty_cache()
