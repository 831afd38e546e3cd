"""Where the time of one step goes.

    python benchmarks/profile_step.py --tokens 16 --set backends.attention=flashinfer   # piecewise extend:
                                                                  # host time by function (cProfile)
    python benchmarks/profile_step.py --decode 1 --set quantization.format=nvfp4 \
        --set backends.attention=flashinfer       # full-graph decode: GPU time by kernel (torch.profiler),
                                                  # then host time by function (cProfile)

With programmatic dependent launch (runtime.pdl, on by default on sm_90) a kernel starts before the one
before it ends and waits on the GPU, so per-kernel times overlap and their sum exceeds the step; add
`--set runtime.pdl=off` for a breakdown whose sum is the GPU time of the step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from common import sync

from pieceworks import Executor
from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.core.context import ForwardContext, forward_context


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--arch", default="llama")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--decode", type=int, default=0, help="profile decode graph replays at this batch size")
    args = p.parse_args()
    if args.decode:
        profile_decode(args)
        return
    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", "model.max_context=4096",
                 "kv_cache.num_tokens=16384", "cuda_graph.piecewise.max_tokens=256",
                 "cuda_graph.decode.enabled=off", *args.set]
    ex = Executor.from_config(None, overrides, progress=False)
    toks = torch.randint(0, ex.vocab_size, (args.tokens,)).tolist()
    seq = ex.new_sequence()
    ex._reserve_pages([seq], [toks])
    pad = ex.piecewise.padded_size(args.tokens)
    meta, ids = ex.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], [toks], pad)
    kernels = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE)

    def step():
        for b in (kernels.attention, kernels.mla):
            if b is not None:
                b.plan(meta)
        with forward_context(ForwardContext(kernels, meta, ex.kv)):
            ex.piecewise(ids, meta.positions)

    for _ in range(5):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - t0) / args.steps
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    print(f"host time per step {host * 1e3:.3f} ms (launch-bound if close to wall {wall * 1e3:.3f} ms)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    sync()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


def kernel_family(name: str) -> str:
    n = name.lower()
    for key, family in (("nvfp4_decode_gemm", "fp4 gemm (cuda)"), ("nvfp4_decode_dequant", "fp4 dequant (cuda)"),
                        ("fp4_gemm", "fp4 gemm (Triton)"), ("splitk", "fp4 gemm split-K reduce"),
                        ("gemm", "bf16 gemm (cuBLAS: lm_head)"), ("gemv", "bf16 gemm (cuBLAS: lm_head)"),
                        ("nvjet", "bf16 gemm (cuBLAS: lm_head)"),
                        ("_decode_kernel", "attention (attention.triton)"),
                        ("prefill", "attention (FlashInfer)"), ("decode", "attention (FlashInfer)"),
                        ("write_rows", "KV write"), ("rms", "norm"), ("norm", "norm")):
        if key in n:
            return family
    return "other elementwise/reduction"


def decode_setup(args, context: int = 512):
    """An executor for `args` (preset, arch, --set overrides) with full decode graphs at batch
    `args.decode`, that many sequences of `context` tokens prefilled, and the next decode batch, after 5
    warm-up steps: (executor, batch). benchmarks/timeline.py uses it too."""
    from pieceworks.core.batch import ForwardBatch

    overrides = [f"model.arch={args.arch}", f"model.preset={args.preset}", "model.max_context=4096",
                 "kv_cache.num_tokens=65536", "cuda_graph.piecewise.enabled=off",
                 f"cuda_graph.decode.batch_sizes=[{args.decode}]", *args.set]
    ex = Executor.from_config(None, overrides, progress=False)
    seqs = [ex.new_sequence() for _ in range(args.decode)]
    for s in seqs:
        ex.forward(ForwardBatch([s], [torch.randint(0, ex.vocab_size, (context,)).tolist()]))
    batch = ForwardBatch(seqs, [[1]] * args.decode)
    for _ in range(5):
        ex.forward(batch)
    sync()
    return ex, batch


def profile_decode(args) -> None:
    """GPU time per kernel over full-graph decode steps of `args.decode` sequences of 512 tokens."""
    from torch.profiler import ProfilerActivity, profile

    ex, batch = decode_setup(args)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            ex.forward(batch)
        sync()
    per_kernel: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel.setdefault(ev.name, []).append(ev.device_time)
    total = sum(sum(v) for v in per_kernel.values()) / args.steps
    rows = sorted(((sum(v) / args.steps, len(v) / args.steps, k) for k, v in per_kernel.items()), reverse=True)
    print(f"decode batch {args.decode}: {total / 1e3:.3f} ms of kernel time per step over {args.steps} steps")
    from pieceworks.backends import pdl

    if pdl.enabled(ex.device):
        print("(PDL on: kernels overlap, so this sum exceeds the step; --set runtime.pdl=off for a breakdown)")
    families: dict[str, float] = {}
    for us, _, name in rows:
        families[kernel_family(name)] = families.get(kernel_family(name), 0.0) + us
    print("| kernel family | us per step | share |\n|---|---:|---:|")
    for fam, us in sorted(families.items(), key=lambda kv: -kv[1]):
        print(f"| {fam} | {us:.0f} | {100 * us / total:.0f}% |")
    print("\n| kernel | us per step | launches per step |\n|---|---:|---:|")
    for us, count, name in rows[:25]:
        print(f"| {name[:90]} | {us:.1f} | {count:.0f} |")

    # Host side, phase by phase (no profiler): before the graph launch, the launch call, after it
    # (logits clone), and the wait for the GPU.
    import statistics

    marks: list[tuple[float, float]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        t = time.perf_counter()
        replay(graph)
        marks.append((t, time.perf_counter()))

    phases: dict[str, list[float]] = {"prepare + plan": [], "graph launch call": [], "after launch": [],
                                      "wait for GPU": [], "whole step": []}
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            ex.forward(batch)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            a, b = marks[-1]
            for key, v in (("prepare + plan", a - t0), ("graph launch call", b - a), ("after launch", t1 - b),
                           ("wait for GPU", t2 - t1), ("whole step", t2 - t0)):
                phases[key].append(v)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    print("\n| host phase of a synchronized Executor.forward | median us |\n|---|---:|")
    for key, v in phases.items():
        print(f"| {key} | {statistics.median(v) * 1e6:.0f} |")

    # Inclusive wall time of selected calls inside those steps (wrapped one by one; nested calls count
    # in their callers too).
    import pieceworks.backends.attention.flashinfer as fi_attn
    import pieceworks.executor.cuda_graph as cg
    from pieceworks.executor import runner

    targets = [(runner.Executor, "_validate"), (runner.Executor, "_reserve_pages"),
               (type(ex.table), "step"), (cg.DecodeGraphRunner, "run"), (cg.DecodeGraphRunner, "_plan"),
               (cg, "page_table"), (fi_attn, "paged_kv_indices"), (torch.Tensor, "pin_memory"),
               (torch.Tensor, "copy_"), (torch.Tensor, "clone"), (torch.cuda.CUDAGraph, "replay")]
    for b in (ex.table.step(ForwardMode.DECODE, GraphMode.FULL).attention,):
        if b is not None:
            targets.append((type(b), "plan"))
            wrapper = getattr(b, "_graph_decode", {}).get(args.decode)
            if wrapper is not None:
                targets.append((type(wrapper), "plan"))
    spent: dict[str, float] = {}
    originals = []

    def wrap(owner, name):
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        originals.append((owner, name, fn))
        setattr(owner, name, timed)

    for owner, name in targets:
        wrap(owner, name)
    try:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ex.forward(batch)
            sync()
        total = (time.perf_counter() - t0) / args.steps
    finally:
        for owner, name, fn in reversed(originals):
            setattr(owner, name, fn)
    print(f"\n| call (inclusive wall time) | us per step |\n|---|---:|\n| synchronized step | {total * 1e6:.0f} |")
    for label, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {v / args.steps * 1e6:.0f} |")

    # Host side: Executor.forward under cProfile (each step synchronized, as a caller reading logits).
    prof_host = cProfile.Profile()
    t0 = time.perf_counter()
    prof_host.enable()
    for _ in range(args.steps):
        ex.forward(batch)
        sync()
    prof_host.disable()
    wall = (time.perf_counter() - t0) / args.steps
    out = io.StringIO()
    stats = pstats.Stats(prof_host, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    print(f"\nhost profile: {wall * 1e3:.3f} ms per synchronized step under cProfile (adds overhead); "
          "top functions by own time:")
    print(out.getvalue())


if __name__ == "__main__":
    main()
