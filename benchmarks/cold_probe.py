"""Is host work slower after the thread slept or waited for the GPU? The same Python / numpy work
timed warm and after 15 ms of: time.sleep, a Python spin, torch.cuda.synchronize on a GPU sleep, an
event.query() spin on it. Then the Engine's add -> run_model path after a sleep vs a spin."""
import random, statistics, sys, time
import torch
sys.path.insert(0, ".")
from pieceworks.executor.inputs import page_table, token_rows
pages = [list(range(1, 158))]; toks = [list(range(500))]
def work():
    t = page_table(pages, 157); token_rows(toks, [2000], t.numpy(), 16, 512, 0)
cycles = int(15e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate in kHz
def sleep(): time.sleep(0.015)
def spin():
    e = time.perf_counter() + 0.015
    while time.perf_counter() < e: pass
def cuda_sync():
    torch.cuda._sleep(cycles); torch.cuda.synchronize()
def event_spin():
    torch.cuda._sleep(cycles); ev = torch.cuda.Event(); ev.record()
    while not ev.query(): pass
def blocking_event():
    torch.cuda._sleep(cycles); ev = torch.cuda.Event(blocking=True); ev.record(); ev.synchronize()
for name, prep in [("warm", lambda: None), ("after time.sleep", sleep), ("after python spin", spin),
                   ("after cuda synchronize", cuda_sync), ("after event.query spin", event_spin),
                   ("after blocking event", blocking_event)]:
    r = []
    for _ in range(30):
        prep(); t = time.perf_counter(); work(); r.append((time.perf_counter() - t) * 1e6)
    print(f"{name:26s} median {statistics.median(r):7.1f} us  min {min(r):7.1f}", flush=True)

from pieceworks import Engine, SamplingParams
eng = Engine.from_config("configs/llama-3.1-8b-random-fp4.yaml", [], progress=False)
ex = eng.executor
V = ex.vocab_size
marks = {}
orig = ex.run_model
def run_model(*a, **k):
    marks["in"] = time.perf_counter(); return orig(*a, **k)
ex.run_model = run_model
rng = random.Random(0)
prefix = [rng.randrange(V) for _ in range(2000)]
def one(prep):
    own = [rng.randrange(V) for _ in range(500)]
    req = prefix + own
    torch.cuda.synchronize(); prep()
    t0 = time.perf_counter()
    eng.add_request(req, SamplingParams(max_tokens=1, ignore_eos=True))
    eng.step()
    t1 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return (marks["in"] - t0) * 1e3, (t1 - t0) * 1e3
one(sleep); one(sleep)
for name, prep in [("sleep 15 ms", sleep), ("spin 15 ms", spin), ("sleep 15 ms", sleep), ("spin 15 ms", spin)]:
    r = [one(prep) for _ in range(8)]
    print(f"later request after {name}: add -> run_model median {statistics.median(x[0] for x in r):.3f} ms, "
          f"add + step {statistics.median(x[1] for x in r):.3f} ms", flush=True)
