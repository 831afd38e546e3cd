"""Where a shared-prefix request's TTFT goes: host before the model, the model (host / GPU events),
host after (logits, sampling, outputs); then a kernel profile of one such step."""
import random, statistics, sys, time
import torch
sys.path.insert(0, ".")
from pieceworks import Engine, SamplingParams

eng = Engine.from_config("configs/llama-3.1-8b-random-fp4.yaml", list(sys.argv[1:]), progress=False)
ex = eng.executor
V = ex.vocab_size
rng = random.Random(0)
prefix = [rng.randrange(V) for _ in range(2000)]
marks = {}
orig = ex.run_model
ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
def run_model(*a, **k):
    marks["in"] = time.perf_counter(); ev[0].record()
    out = orig(*a, **k)
    ev[1].record(); marks["out"] = time.perf_counter()
    return out
ex.run_model = run_model

def one(n_own, use_prefix=True):
    own = [rng.randrange(V) for _ in range(n_own)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.add_request((prefix if use_prefix else []) + own, SamplingParams(max_tokens=1, ignore_eos=True))
    ta = time.perf_counter()
    eng.step()
    t1 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    torch.cuda.synchronize()
    return dict(total=(t1 - t0) * 1e3, add=(ta - t0) * 1e3, pre=(marks["in"] - t0) * 1e3,
                model_host=(marks["out"] - marks["in"]) * 1e3, gpu=ev[0].elapsed_time(ev[1]),
                post=(t1 - marks["out"]) * 1e3)

def show(label, rows):
    keys = rows[0].keys()
    print(label, " ".join(f"{k} {statistics.median(r[k] for r in rows):.3f}" for k in keys), flush=True)

show("first (2000 + 500)", [one(500)])
for n in (256, 500, 512, 768):
    show(f"later own={n}", [one(n) for _ in range(7)])
for n in (500, 512, 2500):
    show(f"no prefix own={n}", [one(n, use_prefix=False) for _ in range(5)])
from torch.profiler import ProfilerActivity, profile
one(500)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        one(500)
tot = {}
for e in prof.key_averages():
    if e.device_time_total > 0:
        tot[e.key] = e.device_time_total / 3
s = sum(tot.values())
print(f"kernel time per later request (own 500): {s / 1e3:.3f} ms")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:22]:
    print(f"{v / 1e3:8.3f} ms  {k[:110]}")
