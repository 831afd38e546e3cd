"""Step times eager vs piecewise CUDA graphs vs a whole-forward CUDA graph, and decode graphs vs eager.

On one GPU, random weights at Llama-3.1-8B shape (or any preset):

    python benchmarks/graphs.py --out $OUT/graphs.md                # bf16: the extend and decode tables
    python benchmarks/graphs.py --quant nvfp4 --extend '' --decode 1  # NVFP4 decode at batch 1

On the CPU, a narrow 32-layer model shows the host cost of the eager path against the plain forward:

    python benchmarks/graphs.py --device cpu --threads 1 --set runtime.dtype=float32 --extend 16 --decode '' \
        --set cuda_graph.piecewise.enabled=off --set model.max_context=4096 --set model.sizes.hidden_size=256 \
        --set model.sizes.intermediate_size=512 --set model.sizes.num_attention_heads=8 \
        --set model.sizes.num_key_value_heads=2 --set model.sizes.head_dim=32 --set model.sizes.vocab_size=1024

Extend: one sequence extending by T tokens (no prefix). Eager, piecewise and a plain-torch forward of the
same weights through the same kernels (plain_llama.py; bf16 Llama) are timed alike, in alternation:
plan + forward + synchronize, wall clock, median of repeats, inputs prepared once outside the timing.
The whole-forward graph is captured per T and replayed without re-planning (`whole_graph`), timed back to
back (`common.wall_ms`: call, synchronize, repeat); piecewise is timed that way too, so that the difference compares
like with like (in the alternation each piecewise step follows a 25-45 ms eager call). Both
are also timed by CUDA events behind a sleep kernel (`common.gpu_ms`), so that the table separates the GPU-side
cost of the pieces from the wait for the host at the step's head, and the piecewise step's attention plans are timed
alone on the host (GPU drained: the part of that head which the whole graph, replayed unplanned, does not pay). Decode:
`Executor.forward` of a decode batch over --context-token sequences (logits included), with and without
the full decode graphs. `--mixed 256x32`: a mixed step (a 256-token chunk + 32 decode rows), timed as
extend. `--host-time` (CPU, e.g. `--preset tiny --layers 32 --set cuda_graph.piecewise.enabled=on`): the
piecewise runner's own host work per piece (stand-in graphs, no-op replays and attention). Where the extend
graphs (`cuda_graph.extend`, executor/extend_graph.py) take a row's step, a second table times it against
piecewise + logits and the whole graph + logits, back to back; the extend graph and the whole graph + logits also by
GPU time (the extend graphs' own kernels against the whole graph's, without the host work before a replay) and by the
host time of the call alone (GPU drained: the runner's step inputs, plan and launch against a bare replay). A third
table times `Executor.forward` of a new T-token prompt with and without them, alternated. The report ends with the
extend rows checked against docs/benchmarks.md's targets for piecewise and full extend graphs (graphs_report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
from common import gpu_ms, md_table, sync, wall_ms
from graphs_report import render
from plain_llama import PlainLlama

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context
from pieceworks.models.presets import preset_config
from pieceworks.testing.graphs import stand_in_capture


def timed_interleaved(fns: dict, repeats: int) -> dict:
    """Median ms of each fn, timed in alternation (a b a b ...) so that drift in clocks or host load
    hits all of them alike."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    sync()
    out = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            out[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 for name, v in out.items()}


def plan(kernels, meta) -> None:
    for b in (kernels.attention, kernels.mla):
        if b is not None:
            b.plan(meta)


def plain_diff(eager, plain_fw) -> float:
    """Largest |eager - plain| over the step's hidden states (0.0: bit-identical)."""
    a, b = eager(), plain_fw()
    sync()
    return float((a.float() - b.float()).abs().max())


def extend_row(ex: Executor, T: int, repeats: int, plain: PlainLlama | None = None) -> dict:
    seq = ex.new_sequence()
    toks = [torch.randint(0, ex.vocab_size, (T,)).tolist()]
    try:
        row = {"T": T, **step_row(ex, [seq], toks, repeats, plain)}
    finally:
        ex.free(seq)
    if ex._graph_mode(ForwardMode.EXTEND, 1, T) is GraphMode.FULL:
        row.update(prompt_forward(ex, toks, repeats))
    return row


def prompt_forward(ex: Executor, toks: list[list[int]], repeats: int) -> dict:
    """`Executor.forward` of a new sequence's prompt (logits returned, the sequence freed after), with the
    extend graphs and with them set aside (piecewise), timed in alternation."""
    runner = ex.extend_graphs

    def forward(graphs):
        def step():
            ex.extend_graphs, seq = graphs, ex.new_sequence()
            try:
                ex.forward(ForwardBatch([seq], toks))
            finally:
                ex.free(seq)
                ex.extend_graphs = runner
        return step

    return timed_interleaved({"forward_piecewise_ms": forward(None), "forward_extend_graph_ms": forward(runner)},
                             repeats)


def mixed_step(ex: Executor, chunk: int, decodes: int, context: int, seqs: list) -> list[list[int]]:
    """A mixed step's tokens: a `chunk`-token prefill chunk (no prefix) for a new sequence and one decode token for
    each of `decodes` sequences given `context` tokens first; its new sequences are appended to `seqs` (the caller
    frees them)."""
    new = [ex.new_sequence() for _ in range(decodes + 1)]
    seqs += new
    for s in new[1:]:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,)).tolist()]))
    return [torch.randint(0, ex.vocab_size, (chunk,)).tolist()] + [[1]] * decodes


def mixed_row(ex: Executor, chunk: int, decodes: int, context: int, repeats: int, plain=None) -> dict:
    """One `chunk`-token prefill chunk (no prefix) and `decodes` decode rows over `context`-token sequences."""
    seqs: list = []
    try:
        toks = mixed_step(ex, chunk, decodes, context, seqs)
        return {"T": f"{chunk} + {decodes} x 1", **step_row(ex, seqs, toks, repeats, plain)}
    finally:
        for s in seqs:
            ex.free(s)


def step_row(ex: Executor, seqs: list, toks: list[list[int]], repeats: int, plain: PlainLlama | None) -> dict:
    """One step over `seqs` feeding `toks` (not committed), timed eager, piecewise, plain, whole graph."""
    T = sum(map(len, toks))
    mode = ForwardMode.classify(list(map(len, toks)), [s.kv_len for s in seqs])
    new_pages = ex._reserve_pages(seqs, toks)
    row = {}
    try:
        meta, ids = ex.prepare_step(mode, GraphMode.EAGER, seqs, toks)
        k_eager = ex.table.step(mode, GraphMode.EAGER)

        def eager():
            return ex.run_model(k_eager, meta, ids)

        fns = {"eager_ms": eager}
        if plain is not None:
            plain_args = (meta.page_lists, meta.prefix_lens, meta.extend_lens, meta.slot_mapping)

            def plain_fw():
                plain.plan(*plain_args)
                return plain.forward(ids, meta.positions)

            fns["plain_ms"] = plain_fw
            row["plain_diff"] = plain_diff(eager, plain_fw)
        if ex.piecewise is not None and ex.piecewise.covers(T):
            pad = ex.piecewise.padded_size(T)
            meta_p, ids_p = ex.prepare_step(mode, GraphMode.PIECEWISE, seqs, toks, pad)
            k_pw = ex.table.step(mode, GraphMode.PIECEWISE)

            def piecewise():
                ex.run_model(k_pw, meta_p, ids_p)

            fns["piecewise_ms"] = piecewise
            row["padded_to"] = pad
        row.update(timed_interleaved(fns, repeats))
        if "piecewise_ms" in row:
            row["plan_us"] = plan_us(k_pw, meta_p, repeats)
        print(f"  T={T} " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")), flush=True)
        if ex.device.type != "cuda":
            return row
        if "piecewise_ms" in row:  # before the whole graph's capture: no plan may follow it
            row["piecewise_b2b_ms"], row["piecewise_gpu_ms"] = wall_ms(piecewise, repeats), gpu_ms(piecewise, repeats)
        full = ex._graph_mode(mode, len(seqs), T) is GraphMode.FULL  # the executor would run it in an extend graph
        if full and "piecewise_ms" in row:  # steps with their last tokens' logits, all timed back to back
            rows = torch.tensor(meta.qo_indptr()[1:], device=ex.device) - 1
            row["piecewise_logits_b2b_ms"] = wall_ms(
                lambda: ex.model.compute_logits(ex.run_model(k_pw, meta_p, ids_p)[rows]), repeats)

            def extend_graph():
                ex.extend_graphs.run(mode, seqs, toks, None)

            row["extend_graph_b2b_ms"], row["extend_graph_gpu_ms"] = wall_ms(extend_graph, repeats), gpu_ms(
                extend_graph, repeats)
            row["extend_graph_host_us"] = host_us(extend_graph, repeats)
            graph = whole_graph(ex, k_eager, meta, ids, rows)
            row["whole_logits_ms"], row["whole_logits_gpu_ms"] = wall_ms(graph.replay, repeats), gpu_ms(
                graph.replay, repeats)
            row["whole_logits_host_us"] = host_us(graph.replay, repeats)
        graph = whole_graph(ex, k_eager, meta, ids)
        row["whole_graph_ms"], row["whole_gpu_ms"] = wall_ms(graph.replay, repeats), gpu_ms(graph.replay, repeats)
        graph = None  # release the captured graph before the next T
    finally:
        ex._release(seqs, new_pages)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if "whole_graph_ms" not in row:
        return row
    saving = row["eager_ms"] - row["whole_graph_ms"]
    if "piecewise_ms" in row:
        row["kept_of_saving"] = (row["eager_ms"] - row["piecewise_ms"]) / saving if saving > 0 else float("nan")
        row["piecewise_vs_eager"] = row["piecewise_ms"] / row["eager_ms"]
    return row


def host_us(fn, repeats: int) -> float:
    """Median host us of fn() alone, the GPU drained before each call."""
    return wall_ms(fn, repeats, wait=False) * 1e3


def plan_us(kernels, meta, repeats: int) -> float:
    """Median host us of a prepared step's attention plans (`Executor.run_model`'s first work), the GPU drained
    before each: host time at a piecewise step's head that the whole graph, replayed without a plan, does not pay."""
    def plan():
        for backend in (kernels.attention, kernels.mla):
            if backend is not None:
                backend.plan(meta)

    return host_us(plan, repeats)


def whole_graph(ex: Executor, kernels, meta, ids, rows: torch.Tensor | None = None) -> torch.cuda.CUDAGraph:
    """The step's whole forward captured in one CUDA graph (after an eager forward of it: FlashInfer's JIT,
    the softmax scale), to be replayed without re-planning: the batch never changes, and FlashInfer's
    non-graph prefill wrapper re-allocates its index buffers on every plan, so a re-planned replay reads
    freed memory (seen on the H200: the GPU hung). A best case, which makes piecewise's comparison with it
    conservative. With `rows`, the graph computes those rows' logits too, as a step returns them."""
    graph = torch.cuda.CUDAGraph()
    for capture in (False, True):
        plan(kernels, meta)
        with forward_context(ForwardContext(kernels, meta, ex.kv)):
            with torch.cuda.graph(graph) if capture else contextlib.nullcontext():
                hidden = ex.model(ids, meta.positions)
                if rows is not None:
                    ex.model.compute_logits(hidden[rows])
        sync()
    return graph


def host_row(ex: Executor, T: int, repeats: int) -> dict:
    """`--host-time` (CPU): a piecewise step with no-op graph replays and attention calls, i.e. the runner's
    own host work, through the traced code (what each size's first replay runs) and through the recording."""
    pw, seq, toks = ex.piecewise, ex.new_sequence(), [torch.randint(0, ex.vocab_size, (T,)).tolist()]
    new_pages, size = ex._reserve_pages([seq], toks), pw.padded_size(T)
    try:
        meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], toks, size)
        noop = type("NoOpAttention", (), {"forward": lambda *a: None})()
        kernels = dataclasses.replace(ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE), attention=noop, mla=noop)
        with forward_context(ForwardContext(kernels, meta, ex.kv)):
            pw(ids, meta.positions)  # the size's first step records it
            pw.phase, pw.current_size = "replay", size  # for _run: the traced code, as that first step ran it
            ms = timed_interleaved({"traced": lambda: pw._run(size), "recorded": lambda: pw(ids, meta.positions)},
                                   repeats)
    finally:
        ex._release([seq], new_pages)
        ex.free(seq)
    n = len(pw.backend.pieces)
    return {"T": T, "pieces": n, **{f"{k}_us_per_piece": v * 1e3 / n for k, v in ms.items()}}


def decode_row(ex: Executor, bs: int, repeats: int, context: int = 512) -> dict:
    seqs = [ex.new_sequence() for _ in range(bs)]
    try:
        for s in seqs:
            ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,)).tolist()]))

        def step():
            ex.forward(ForwardBatch(seqs, [[1]] * bs))

        row = {"batch": bs, "graph_ms": wall_ms(step, repeats) if ex.decode_graphs else float("nan")}
        if ex.decode_graphs and ex.device.type == "cuda":
            # The replay alone (the graph as the last step planned it): GPU time without the host
            # work of Executor.forward (batch preparation, plan, sampling-side copies).
            graph = ex.decode_graphs.graphs[min(b for b in ex.decode_graphs.graphs if b >= bs)]
            row["replay_ms"] = wall_ms(graph.replay, repeats)
        saved, ex.decode_graphs = ex.decode_graphs, None
        try:
            row["eager_ms"] = wall_ms(step, repeats)
        finally:
            ex.decode_graphs = saved
    finally:
        for s in seqs:
            ex.free(s)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="llama")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--quant", default="none", choices=["none", "nvfp4"])
    p.add_argument("--attention", default="auto", help="backends.attention (and mla)")
    p.add_argument("--extend", default="16,64,128,256,512,1024,2048,8192")
    p.add_argument("--decode", default="1,8,32")
    p.add_argument("--mixed", default="", help="CHUNKxDECODES, e.g. 256x32: a mixed step of one prefill chunk and "
                   "DECODES decode rows over --context-token sequences")
    p.add_argument("--host-time", action="store_true", help="CPU: the piecewise runner's host time per piece "
                   "for each --extend T (stand-in graphs, no-op replays and attention)")
    p.add_argument("--context", type=int, default=512, help="tokens per sequence before the decode steps")
    p.add_argument("--decode-sizes", default=None, help="decode graph batch sizes (default schedule)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 keeps CPU timings steady)")
    p.add_argument("--plain", default="on", choices=("on", "off"),
                   help="time a plain-torch forward of the same weights next to eager (llama, quant none)")
    p.add_argument("--set", action="append", default=[], help="extra config overrides key=value")
    p.add_argument("--out", default=None, help="markdown + json report path")
    p.add_argument("--watchdog", type=float, default=300,
                   help="dump stacks if one phase (the build, one extend or decode row) runs this long (s)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import faulthandler

    # Armed per phase, once: a repeating timer over the whole run fired in healthy runs, and dumping the
    # stack of a thread that is running crashed the process once (H200, Python 3.12).
    faulthandler.dump_traceback_later(args.watchdog)

    sizes = {"num_hidden_layers": args.layers} if args.layers else {}
    decode_batches = [int(x) for x in args.decode.split(",") if x]
    # each sequence grows by one token per decode step: about 10 * repeats steps per batch size
    kv_tokens = max(40960, max(decode_batches, default=0) * (args.context + 12 * args.repeats + 64))
    # room for the longest default extend (8192) and the decode contexts, within what the preset's
    # positions allow (tiny: 512); a --set model.max_context=... comes later and wins
    positions = preset_config(args.arch, args.preset, sizes)["max_position_embeddings"]
    max_context = min(max(9216, args.context + 64), positions)
    overrides = [
        f"model.arch={args.arch}", f"model.preset={args.preset}", f"model.max_context={max_context}",
        f"quantization.format={args.quant}", f"runtime.device={args.device}", "runtime.dtype=bfloat16",
        f"kv_cache.num_tokens={kv_tokens}", f"backends.attention={args.attention}", f"backends.mla={args.attention}",
        *(f"model.sizes.{k}={v}" for k, v in sizes.items()), *args.set,
    ]
    if args.decode_sizes:
        overrides.append(f"cuda_graph.decode.batch_sizes=[{args.decode_sizes}]")
    t0 = time.perf_counter()
    ex = Executor.from_config(None, overrides, progress=False)
    build_s = time.perf_counter() - t0
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if ex.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "overrides": overrides, "build_s": build_s, "context": args.context,
        "backends": {op: sorted({b.name for b in ex.table.instances(op)}) for op in ("attention", "mla", "fp4_gemm", "moe")},
        "piecewise": ex.piecewise.describe() if ex.piecewise else None,
        "decode_graphs": ex.decode_graphs.describe() if ex.decode_graphs else None,
        "extend_graphs": ex.extend_graphs.describe() if ex.extend_graphs else None,
    }
    print(json.dumps({k: v for k, v in info.items() if k not in ("piecewise",)}, default=str), flush=True)
    print("piecewise:", {k: v for k, v in (info["piecewise"] or {}).items() if k != "sizes"}, flush=True)
    plain = None
    if args.plain == "on" and args.arch == "llama" and args.quant == "none":
        k_eager = ex.table.step(ForwardMode.EXTEND, GraphMode.EAGER)
        plain = PlainLlama(ex.model, ex.kv, getattr(k_eager.attention, "variant", "fa2"))
    if args.host_time and ex.piecewise is None:
        p.error("--host-time times the piecewise runner: add --set cuda_graph.piecewise.enabled=on")
    # a step holds at most the model's context (a --host-time step: at most the largest piecewise size)
    longest = min(ex.max_context, ex.piecewise.max_tokens) if args.host_time else ex.max_context
    extends = [int(x) for x in args.extend.split(",") if x]
    if any(T > longest for T in extends):
        print(f"skipping --extend {[T for T in extends if T > longest]}: longer than {longest} tokens", flush=True)
        extends = [T for T in extends if T <= longest]
    if args.host_time:
        stand_in_capture(ex.piecewise, rerun=False)
        rows = [host_row(ex, T, args.repeats * 5) for T in extends]
        print(md_table(list(rows[0]), [[f"{v:.2f}" if isinstance(v, float) else v for v in r.values()] for r in rows]))
        return
    ext = []
    for T in extends:
        faulthandler.dump_traceback_later(args.watchdog)
        ext.append(extend_row(ex, T, args.repeats if T <= 2048 else max(5, args.repeats // 4), plain))
        print(ext[-1], flush=True)
    if args.mixed:
        ext.append(mixed_row(ex, *map(int, args.mixed.split("x")), args.context, args.repeats, plain))
        print(ext[-1], flush=True)
    dec = []
    for bs in decode_batches:
        faulthandler.dump_traceback_later(args.watchdog)
        dec.append(decode_row(ex, bs, args.repeats * 5, args.context))
        print(dec[-1], flush=True)
    faulthandler.cancel_dump_traceback_later()
    md = render(info, ext, dec)
    print(md)
    if args.out:
        Path(args.out).write_text(md)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"info": info, "extend": ext, "decode": dec}, default=str, indent=1))


if __name__ == "__main__":
    main()
