"""The device sampler's cost per step at V = 128,256 (Llama-3 vocabulary), per batch size and mix of
sampling parameters: `python benchmarks/sampler.py [--device cuda] [--batch 1 32 256] [--iters 200]`.

Columns, per `Sampler.sample` call (medians):
  host_us  host time to enqueue the step (until its one device-to-host copy starts), measured while
           the GPU is kept busy by a sleep kernel, so it excludes waiting: this is the part that adds to a
           decode step when it doesn't hide behind the graph replay
  gpu_us   GPU time of the step's kernels (CUDA events around the call, GPU otherwise idle)
  wall_us  the whole call on an idle GPU (enqueue + kernels + the copy)
  syncs    host syncs per call, as torch's sync debug mode counts them (1 is the design)
`--reference` adds the per-row host sampler of executor/scheduler.py (`sample`) for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pieceworks.engine.params import SamplingParams  # noqa: E402
from pieceworks.engine.sampler import Sampler, SamplingState  # noqa: E402

MIXES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "temperature": lambda i: SamplingParams(temperature=0.8),
    "top_p": lambda i: SamplingParams(temperature=0.8, top_p=0.95),
    "top_k+top_p+min_p": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "seeded": lambda i: SamplingParams(temperature=0.8, top_p=0.95, seed=i),
    "penalties": lambda i: SamplingParams(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5,
                                          frequency_penalty=0.5),
    "logprobs=5": lambda i: SamplingParams(temperature=0.8, logprobs=5),
    "mixed": lambda i: [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9, seed=i),
                        SamplingParams(top_k=40, repetition_penalty=1.2), SamplingParams(logprobs=2)][i % 4],
}


def run(device: torch.device, B: int, mix: str, iters: int, V: int) -> dict[str, float]:
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(B, V, device=device, generator=g) * 4
    states = [SamplingState.create(MIXES[mix](i), list(range(i, i + 512)), [2], device) for i in range(B)]
    sampler = Sampler(V, device)

    def step():
        res = sampler.sample(logits, states)
        for s, t in zip(states, res.token_ids):
            s.append(t)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    host, gpu, wall = [], [], []
    orig_tolist = torch.Tensor.tolist
    marks: list[float] = []

    def tolist(self, *a, **k):  # the step's one device-to-host copy: enqueueing ends here
        marks.append(time.perf_counter())
        return orig_tolist(self, *a, **k)

    for _ in range(iters):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work: the host never waits while enqueueing
        torch.Tensor.tolist = tolist
        try:
            t0 = time.perf_counter()
            step()
        finally:
            torch.Tensor.tolist = orig_tolist
        host.append((marks.pop() - t0) * 1e6)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        wall.append((time.perf_counter() - t0) * 1e6)
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    med = statistics.median
    return {"host_us": med(host), "gpu_us": med(gpu), "wall_us": med(wall), "syncs": syncs}


def reference(device: torch.device, B: int, iters: int, V: int) -> float:
    from pieceworks.executor.scheduler import sample

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(B, V, device=device, generator=g) * 4
    cpu_gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(max(iters // 10, 3)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        [sample(logits[i], 0.8, 0.95, cpu_gen) for i in range(B)]
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--mix", nargs="+", default=list(MIXES), choices=list(MIXES))
    p.add_argument("--reference", action="store_true")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        sys.exit("benchmarks/sampler.py measures the CUDA sampler: run it on a GPU machine")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, V = {a.vocab}")
    print(f"{'mix':20s} {'B':>4s} {'host_us':>9s} {'gpu_us':>9s} {'wall_us':>9s} {'syncs':>6s}")
    for B in a.batch:
        for mix in a.mix:
            r = run(device, B, mix, a.iters, a.vocab)
            print(f"{mix:20s} {B:4d} {r['host_us']:9.1f} {r['gpu_us']:9.1f} {r['wall_us']:9.1f} {r['syncs']:6d}")
        if a.reference:
            print(f"{'per-row host (old)':20s} {B:4d} {'':9s} {'':9s} {reference(device, B, a.iters, a.vocab):9.1f}")


if __name__ == "__main__":
    main()
