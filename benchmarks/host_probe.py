"""Host time of a shared-prefix request's first step on this host: per part (min / median of 12 later
requests), the sync Engine; then the AsyncEngine's thread hand-offs."""
import asyncio, functools, random, statistics, sys, time
import torch
sys.path.insert(0, ".")
from pieceworks import AsyncEngine, Engine, SamplingParams

eng = Engine.from_config("configs/llama-3.1-8b-random-fp4.yaml", list(sys.argv[1:]), progress=False)
ex = eng.executor
V = ex.vocab_size
T = {}
def wrap(obj, name, label=None):
    f = getattr(obj, name)
    label = label or name
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T.setdefault(label, []).append((time.perf_counter() - t) * 1e6); return r
    setattr(obj, name, g)
kern = ex.table.step(__import__("pieceworks").core.batch.ForwardMode.EXTEND, __import__("pieceworks").core.batch.GraphMode.PIECEWISE)
for o, n in [(eng.scheduler, "schedule"), (ex, "new_sequence"), (ex.kv.allocator, "lookup"), (ex, "_forward"),
             (ex, "prepare_step"), (ex, "_reserve_pages"), (eng.sampler, "sample"), (eng, "add_request"),
             (ex, "register_full_pages"), (ex, "run_model"), (ex.model, "compute_logits")]:
    wrap(o, n)
wrap(kern.attention, "plan", "attention.plan")
rng = random.Random(0)
prefix = [rng.randrange(V) for _ in range(2000)]
def one(n_own):
    own = [rng.randrange(V) for _ in range(n_own)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.add_request(prefix + own, SamplingParams(max_tokens=1, ignore_eos=True))
    eng.step()
    T.setdefault("TOTAL add+step", []).append((time.perf_counter() - t0) * 1e6)
    while eng.has_unfinished():
        eng.step()
one(500); one(500)
T.clear()
for _ in range(12):
    one(500)
for k, v in T.items():
    print(f"{k:22s} min {min(v):9.1f} us  median {statistics.median(v):9.1f} us  n {len(v)}")
# pin_memory + H2D of small host tensors on this host
x = torch.zeros(3, 512, dtype=torch.int64)
ts = []
for _ in range(50):
    t = time.perf_counter(); x.pin_memory().to("cuda", non_blocking=True); ts.append((time.perf_counter() - t) * 1e6)
print(f"pin_memory + H2D [3, 512] int64: median {statistics.median(ts):.1f} us")
ts = []
for _ in range(50):
    t = time.perf_counter(); torch.tensor([499], device="cuda"); ts.append((time.perf_counter() - t) * 1e6)
print(f"torch.tensor([i], device=cuda): median {statistics.median(ts):.1f} us")
# AsyncEngine: generate() -> add_request on the loop thread; last output put -> the coroutine has it
aeng = AsyncEngine(eng)
marks = {}
orig_add = eng.add_request
def add(*a, **k):
    marks["add"] = time.perf_counter(); return orig_add(*a, **k)
eng.add_request = add
async def main():
    waits, ttft = [], []
    for _ in range(10):
        own = [rng.randrange(V) for _ in range(500)]
        t0 = time.perf_counter()
        async for out in aeng.generate(prefix + own, SamplingParams(max_tokens=1, ignore_eos=True)):
            t1 = time.perf_counter()
        waits.append((marks["add"] - t0) * 1e6); ttft.append((t1 - t0) * 1e3)
    print(f"AsyncEngine generate -> add_request median {statistics.median(waits):.1f} us; TTFT median {statistics.median(ttft):.3f} ms")
asyncio.run(main())
aeng.shutdown()
