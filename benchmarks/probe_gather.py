"""Probe (not for main): host us of the FlashInfer attention plan of mixed steps, page indices gathered on the GPU
(page_gather_cuda) against built on the host, alternated in one process; GPU drained before each plan."""
from __future__ import annotations

import statistics
import time

import torch
from common import sync

from pieceworks import Executor
from pieceworks.backends import page_gather_cuda
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode

ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.sizes.num_hidden_layers=2", "model.max_context=9216",
      "runtime.dtype=bfloat16", "kv_cache.num_tokens=300000", "backends.attention=flashinfer",
      "backends.options.flashinfer.variant=fa2", "cuda_graph.decode.enabled=off", "cuda_graph.piecewise.enabled=off",
      "cuda_graph.extend.enabled=off"]
ex = Executor.from_config(None, ov, progress=False)
print(torch.cuda.get_device_name(), flush=True)
for chunk, decodes, ctx in ((256, 32, 512), (256, 63, 4096), (64, 16, 1024)):
    seqs = [ex.new_sequence() for _ in range(decodes + 1)]
    for s in seqs[1:]:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (ctx,)).tolist()]))
    toks = [torch.randint(0, ex.vocab_size, (chunk,)).tolist()] + [[1]] * decodes
    mode = ForwardMode.classify(list(map(len, toks)), [s.kv_len for s in seqs])
    new = ex._reserve_pages(seqs, toks)
    meta, ids = ex.prepare_step(mode, GraphMode.EAGER, seqs, toks)
    k = ex.table.step(mode, GraphMode.EAGER)
    outs = {}
    for name, least in (("gather", page_gather_cuda.MIN_PAGES), ("host", 10**9)):
        page_gather_cuda.MIN_PAGES = least
        ex.run_model(k, meta, ids)
        outs[name] = ex.run_model(k, meta, ids).clone()
    assert torch.equal(outs["gather"], outs["host"]), "hidden states differ"
    acc = {"gather": [], "host": []}
    for _ in range(200):
        for name, least in (("gather", 256), ("host", 10**9)):
            page_gather_cuda.MIN_PAGES = least
            sync()
            t0 = time.perf_counter()
            k.attention.plan(meta)
            acc[name].append((time.perf_counter() - t0) * 1e6)
    page_gather_cuda.MIN_PAGES = 256
    pages = sum(-(-s.kv_len // 16) for s in seqs) + 16
    print(f"{chunk} + {decodes} x 1 over {ctx}: ~{pages} pages; plan host us gather "
          f"{statistics.median(acc['gather']):.1f} / host {statistics.median(acc['host']):.1f}; hidden states equal",
          flush=True)
    ex._release(seqs, new)
    for s in seqs:
        ex.free(s)
