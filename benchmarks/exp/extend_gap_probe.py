"""Probe (not for the tree): where an extend graph's step exceeds the whole graph + logits at T = 64 / 128."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from common import gpu_ms, wall_ms
from graphs import whole_graph

from pieceworks import Executor
from pieceworks.core.batch import ForwardMode, GraphMode

ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.max_context=9216", "quantization.format=none",
      "runtime.device=cuda", "runtime.dtype=bfloat16", "kv_cache.num_tokens=40960",
      "backends.options.flashinfer.variant=fa2", "cuda_graph.decode.enabled=off",
      "cuda_graph.piecewise.sizes=[16,64,128,256]"]
ex = Executor.from_config(None, ov, progress=False)
eg = ex.extend_graphs
for T in (16, 64, 128):
    seq = ex.new_sequence()
    toks = [torch.randint(0, ex.vocab_size, (T,)).tolist()]
    pages = ex._reserve_pages([seq], toks)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.EAGER, [seq], toks)
    rows = torch.tensor([T - 1], device="cuda")
    row = {}
    eg.run(ForwardMode.EXTEND, [seq], toks, None)
    g = eg.graphs[T]
    row["ext_replay"], row["ext_replay_gpu"] = wall_ms(g.replay, 30), gpu_ms(g.replay, 30)
    row["ext_run"] = wall_ms(lambda: eg.run(ForwardMode.EXTEND, [seq], toks, None), 30)
    for name, k in (("fi", ex.table.step(ForwardMode.EXTEND, GraphMode.EAGER)),
                    ("tri", ex.table.step(ForwardMode.EXTEND, GraphMode.FULL))):
        for lg in (None, rows):
            w = whole_graph(ex, k, meta, ids, lg)
            key = f"{name}_whole{'_logits' if lg is not None else ''}"
            row[key], row[key + "_gpu"] = wall_ms(w.replay, 30), gpu_ms(w.replay, 30)
            del w
    print(T, {k: round(v, 3) for k, v in row.items()}, flush=True)
    ex._release([seq], pages)
    ex.free(seq)
