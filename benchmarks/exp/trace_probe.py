"""Probe (exp/head-probe, not for main): torch.profiler traces (gzip chrome JSON into $OUT) of a 16-token prompt and a
256 + 32 mixed step, each run as the extend graph's `run`, its bare replay, a piecewise step (plan, pieces, logits) and
the whole graph + logits, five times each from an idle GPU; and FlashInfer's plan of the piecewise step in stamps."""
import gzip
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np
import torch
from graphs import whole_graph

from pieceworks import Executor
from pieceworks.backends.attention import flashinfer_fast as ff
from pieceworks.backends.attention.flashinfer import step_lengths
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context

ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.max_context=9216", "quantization.format=none",
      "runtime.device=cuda", "runtime.dtype=bfloat16", "kv_cache.num_tokens=40960", "backends.attention=flashinfer",
      "backends.options.flashinfer.variant=fa2", "cuda_graph.decode.enabled=off",
      "cuda_graph.piecewise.sizes=[16,64,128,256,288,512]", "cuda_graph.extend.sizes=[16,32,64,128,256,288,512]"]
ex = Executor.from_config(None, ov, progress=False)
eg = ex.extend_graphs
med = statistics.median
sync = torch.cuda.synchronize
OUT = Path(os.environ.get("OUT", "/tmp"))


def fast_plan_stamped(self, wrapper, qo_lens, kv_lens, page_lists, st, t0):
    b, ps = len(kv_lens), self.page_size
    counts = [-(-n // ps) for n in kv_lens]
    total = 4 * b + 2 + sum(counts)
    v = self._views.get(b) or self._make_views(b)
    a = v.a
    if b == 1:
        n, c, pages = kv_lens[0], counts[0], page_lists[0]
        a[0] = a[2] = 0
        a[1], a[3], a[4], a[5] = qo_lens[0], c, n - (c - 1) * ps, n
        a[6: 6 + c] = pages[:c]
    else:
        flat = ff.flat_pages(page_lists, counts)
        st.append(("flat_pages", time.perf_counter() - t0))
        np.cumsum(qo_lens, dtype=np.int32, out=a[1: b + 1])
        a[0] = a[b + 1] = 0
        np.cumsum(counts, dtype=np.int32, out=a[b + 2: 2 * b + 2])
        lens = a[3 * b + 2: 4 * b + 2]
        lens[:] = kv_lens
        a[2 * b + 2: 3 * b + 2] = lens - (np.asarray(counts, dtype=np.int32) - 1) * ps
        a[4 * b + 2: total] = flat
    st.append(("csr arrays", time.perf_counter() - t0))
    bucket = -(-total // 1024) * 1024
    pair = self._copies.get(bucket)
    if pair is None:
        pair = self._copies[bucket] = (self.device_buf[:bucket], self.stage[:bucket])
    pair[0].copy_(pair[1], non_blocking=True)
    st.append(("copy", time.perf_counter() - t0))
    args = self.args
    rows = int(a[b])
    args[self.at: self.at + 5] = [v.qo_host, v.kv_host, v.lens_host, rows, b]
    wrapper._plan_info = self.fn(*args)
    st.append(("planner (C++)", time.perf_counter() - t0))
    wrapper._qo_indptr_buf, wrapper._paged_kv_indptr_buf = v.qo, v.kv
    wrapper._paged_kv_last_page_len_buf, wrapper._kv_lens_buffer = v.last, v.lens
    wrapper._paged_kv_indices_buf = self.device_buf[4 * b + 2: total]
    wrapper._batch_size, wrapper._qo_indptr_last = b, rows
    wrapper._max_q_len, wrapper._max_kv_len = max(qo_lens), max(kv_lens)
    wrapper._seq_lens_kv = wrapper._seq_lens_q = v.lens_host
    st.append(("attributes", time.perf_counter() - t0))


def plan_stamped(att, meta, st):
    t0 = time.perf_counter()
    att._meta = meta
    qo_lens, kv_lens = step_lengths(meta)
    att._rows = sum(qo_lens)
    st.append(("lengths", time.perf_counter() - t0))
    wrapper = att._prefill_wrapper(meta.device)
    att._plan_guard.before(wrapper)
    st.append(("guard before", time.perf_counter() - t0))
    fast_plan_stamped(att._fast_plan, wrapper, qo_lens, kv_lens, meta.page_lists, st, t0)
    att._fast.rebind(wrapper, meta.page_size)
    st.append(("rebind", time.perf_counter() - t0))
    att._plan_guard.after(wrapper, meta.device)
    att._wrapper = wrapper
    st.append(("guard after", time.perf_counter() - t0))


def case(chunk, decodes, context=512):
    seqs = [ex.new_sequence() for _ in range(decodes + 1)]
    for s in seqs[1:]:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,)).tolist()]))
    toks = [torch.randint(0, ex.vocab_size, (chunk,)).tolist()] + [[1]] * decodes
    T = sum(map(len, toks))
    mode = ForwardMode.classify(list(map(len, toks)), [s.kv_len for s in seqs])
    new = ex._reserve_pages(seqs, toks)
    size = ex.piecewise.padded_size(T)
    meta, ids = ex.prepare_step(mode, GraphMode.PIECEWISE, seqs, toks, size)
    k = ex.table.step(mode, GraphMode.PIECEWISE)
    me, ie = ex.prepare_step(mode, GraphMode.EAGER, seqs, toks)
    ke = ex.table.step(mode, GraphMode.EAGER)
    ends = torch.tensor(me.qo_indptr()[1:], device="cuda") - 1
    att = k.attention

    def pw():
        att.plan(meta)
        with forward_context(ForwardContext(k, meta, ex.kv)):
            h = ex.piecewise(ids, meta.positions)
        ex.model.compute_logits(h[ends])

    w = whole_graph(ex, ke, me, ie, ends)
    g = eg.graphs[eg.padded_size(T)]
    fns = {"ext_run": lambda: eg.run(mode, seqs, toks, None), "ext_replay": g.replay, "piecewise": pw,
           "whole_logits": w.replay}
    for fn in fns.values():
        for _ in range(3):
            fn()
    sync()
    assert att._fast_plan is not None and att._fast is not None, "no FastPlan / FastRun"
    rows = []
    for _ in range(30):
        sync()
        st = []
        plan_stamped(att, meta, st)
        rows.append(st)
    sync()
    names = [n for n, _ in rows[0]]
    print(f"== {chunk} + {decodes}: plan stamps (us, cumulative): "
          + ", ".join(f"{n} {med(r[i][1] for r in rows) * 1e6:.0f}" for i, n in enumerate(names)), flush=True)
    walls = {n: [] for n in fns}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for rep in range(5):
            for name, fn in fns.items():
                sync()
                t0 = time.perf_counter()
                with torch.profiler.record_function(f"STEP {name} {rep}"):
                    fn()
                sync()
                walls[name].append((time.perf_counter() - t0) * 1e3)
    print("  walls under the profiler (ms): " + ", ".join(f"{n} {med(v):.3f}" for n, v in walls.items()), flush=True)
    path = OUT / f"trace_{chunk}_{decodes}.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb") as z:
        z.write(f.read())
    path.unlink()
    w = None
    ex._release(seqs, new)
    for s in seqs:
        ex.free(s)
    torch.cuda.empty_cache()


for c, d in ((16, 0), (256, 32)):
    case(c, d)
