"""Probe (exp/head-probe, not for main): host time per statement of ExtendGraphRunner.run and of a piecewise step's
head, with the GPU idle at the call (as graphs.py's back-to-back timing) and busy (a sleep kernel ahead: host only)."""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np
import torch
from common import gpu_ms, wall_ms
from graphs import whole_graph

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context
from pieceworks.executor import extend_graph as eg_mod

ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.max_context=9216", "quantization.format=none",
      "runtime.device=cuda", "runtime.dtype=bfloat16", "kv_cache.num_tokens=40960", "backends.attention=flashinfer",
      "backends.options.flashinfer.variant=fa2", "cuda_graph.decode.enabled=off",
      "cuda_graph.piecewise.sizes=[16,64,128,256,288,512]", "cuda_graph.extend.sizes=[16,32,64,128,256,288,512]"]
ex = Executor.from_config(None, ov, progress=False)
eg = ex.extend_graphs
med = statistics.median
sync = torch.cuda.synchronize


def run_stamped(self, mode, seqs, tokens, st):
    t0 = time.perf_counter()
    b = len(seqs)
    counts = np.fromiter(map(len, tokens), dtype=np.int64, count=b)
    ends = np.cumsum(counts)
    n = int(ends[-1])
    t = self.padded_size(n)
    s = self.seqs(t)
    kv_lens = [q.kv_len for q in seqs]
    st.append(time.perf_counter() - t0)  # 0 lengths
    if self._copied is not None:
        self._copied.synchronize()
    st.append(time.perf_counter() - t0)  # 1 event sync
    table = self._h_table[:b]
    eg_mod.page_table([q.pages for q in seqs], self.width, out=table)
    st.append(time.perf_counter() - t0)  # 2 page table
    eg_mod.token_rows(tokens, kv_lens, table, self.page_size, t, self.kv.reserved_slot, out=self._h_rows[:, :t])
    st.append(time.perf_counter() - t0)  # 3 token rows
    rows = ends - 1
    r = len(rows)
    self._h_last[:r] = rows
    self._h_last[r:s] = 0
    index = self._h_index
    index[0] = 0
    index[1: b + 1] = ends
    index[b + 1: s + 1] = n
    index[s + 1: s + 1 + b] = counts + kv_lens
    index[s + 1 + b: 2 * s + 1] = 0
    stop = self._at_table + -(-b * self.width // 2)
    st.append(time.perf_counter() - t0)  # 4 index
    self._dev[:stop].copy_(self._host[:stop], non_blocking=True)
    st.append(time.perf_counter() - t0)  # 5 copy
    self._copied = self._copied or torch.cuda.Event()
    self._copied.record()
    st.append(time.perf_counter() - t0)  # 6 event record
    meta = self._meta(mode, t, counts.tolist(), kv_lens)
    st.append(time.perf_counter() - t0)  # 7 meta
    self._plan(meta)
    st.append(time.perf_counter() - t0)  # 8 plan
    self.replay(t, meta)
    st.append(time.perf_counter() - t0)  # 9 replay
    out = self.logits[t][:r].clone()
    st.append(time.perf_counter() - t0)  # 10 clone
    return out


NAMES = ["lengths", "event sync", "page table", "token rows", "index", "copy", "event record", "meta", "plan",
         "replay", "clone"]


def stamps(fn, busy, reps=30):
    rows = []
    for _ in range(reps):
        sync()
        if busy:
            torch.cuda._sleep(20_000_000)
        st = []
        fn(st)
        sync()
        rows.append(st)
    return [med(r[i] for r in rows) * 1e6 for i in range(len(rows[0]))]


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

    def ext(st):
        run_stamped(eg, mode, seqs, toks, st)

    def pw(st):
        t0 = time.perf_counter()
        k.attention.plan(meta)
        st.append(time.perf_counter() - t0)
        with forward_context(ForwardContext(k, meta, ex.kv)):
            st.append(time.perf_counter() - t0)
            h = ex.piecewise(ids, meta.positions)
        st.append(time.perf_counter() - t0)
        ex.model.compute_logits(h[ends])
        st.append(time.perf_counter() - t0)

    for fn in (ext, pw):
        for _ in range(3):
            fn([])
    out = [f"== {chunk} + {decodes} (T {T}; piecewise {size}, extend bucket {eg.padded_size(T)})"]
    for busy in (False, True):
        e = stamps(ext, busy)
        p = stamps(pw, busy)
        out.append(f"  {'busy' if busy else 'idle'} ext: " + ", ".join(f"{n} {v:.0f}" for n, v in zip(NAMES, e)))
        out.append(f"  {'busy' if busy else 'idle'} pw: plan {p[0]:.0f}, ctx {p[1]:.0f}, pieces {p[2]:.0f}, "
                   f"logits {p[3]:.0f} us")
    g = eg.graphs[eg.padded_size(T)]
    w = whole_graph(ex, ke, me, ie, ends)
    for name, fn in (("ext replay", g.replay), ("whole+logits replay", w.replay),
                     ("ext run", lambda: eg.run(mode, seqs, toks, None))):
        hb = []
        for _ in range(30):
            sync()
            torch.cuda._sleep(20_000_000)
            t0 = time.perf_counter()
            fn()
            hb.append((time.perf_counter() - t0) * 1e6)
            sync()
        out.append(f"  {name}: b2b {wall_ms(fn, 30):.3f} ms, gpu {gpu_ms(fn, 30):.3f} ms, host (busy) {med(hb):.0f} us")
    print("\n".join(out), flush=True)
    w = None
    ex._release(seqs, new)
    for s in seqs:
        ex.free(s)
    torch.cuda.empty_cache()


for c, d in ((16, 0), (128, 0), (256, 32), (16, 0)):
    case(c, d)
