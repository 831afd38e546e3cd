"""Host time of the attention plan and the step inputs of a shared-prefix request, by part."""
import functools, random, statistics, sys, time
import torch
sys.path.insert(0, ".")
from pieceworks import Engine, SamplingParams
from pieceworks.backends.attention import flashinfer_fast as ff
from pieceworks.executor import inputs

eng = Engine.from_config("configs/llama-3.1-8b-random-fp4.yaml", [], progress=False)
ex = eng.executor
V = ex.vocab_size
T = {}
def timed(f, label):
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T.setdefault(label, []).append((time.perf_counter() - t) * 1e6); return r
    return g
ff.FastPlan.__call__ = timed(ff.FastPlan.__call__, "FastPlan.__call__")
ff.PlanCopyGuard.before = timed(ff.PlanCopyGuard.before, "guard.before")
ff.PlanCopyGuard.after = timed(ff.PlanCopyGuard.after, "guard.after")
ff.flat_pages = timed(ff.flat_pages, "flat_pages")
for name in ("page_table", "token_rows", "to_device"):
    setattr(inputs, name, timed(getattr(inputs, name), name))
ex.prepare_step = timed(ex.prepare_step, "prepare_step")
rng = random.Random(0)
prefix = [rng.randrange(V) for _ in range(2000)]
def one(n_own, use_prefix=True):
    own = [rng.randrange(V) for _ in range(n_own)]
    torch.cuda.synchronize()
    eng.add_request((prefix if use_prefix else []) + own, SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
one(500); one(500)
from pieceworks.core.batch import ForwardMode, GraphMode
att = ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE).attention
fp = getattr(att, "_fast_plan", None)
print("fast plan:", fp is not None, "refused:", getattr(att, "_fast_plan_refused", None), "variant:", getattr(att, "variant", None))
if fp is not None:
    fp.fn = timed(fp.fn, "planner (C++)")
att.plan = timed(att.plan, "attention.plan")
for label, kw in (("prefix 2000 + 500", {}), ("no prefix, 500", {"use_prefix": False})):
    T.clear()
    for _ in range(10):
        one(500, **kw)
    print(label)
    for k, v in T.items():
        print(f"  {k:20s} min {min(v):8.1f}  median {statistics.median(v):8.1f} us  n {len(v)}")
