"""Host us of one MLA backend forward (K/V write + attention launch) through FastMLARun against run(): 128 heads,
rank 512 + 64, a 9-token extend over 56 cached tokens (the "mixed" scenario), 300 calls timed back to back without
synchronizing, alternated 4 times; outputs compared."""
import sys, time, statistics
sys.path.insert(0, "tests/gpu")
import torch
from dataclasses import replace
from test_flashinfer import mla_backend, BF16, DEV
from pieceworks.testing import scenarios as S
sc = replace([s for s in S.ATTENTION_SCENARIOS if s.name == "mixed"][0], page_size=16)
case = S.mla_case(sc, 128, 512, 64, BF16, DEV, seed=0)
x = case.inputs
impls = {"fast": mla_backend(16, 128), "run()": mla_backend(16, 128)}
impls["run()"]._fast_run_refused = True
outs = {}
for k, impl in impls.items():
    impl.plan(case.meta)
    out = torch.zeros_like(x["q_nope"])
    for _ in range(3):
        impl.forward(x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], out, 0, x["scale"], case.pool)
    outs[k] = out
print("bit-equal", torch.equal(outs["fast"], outs["run()"]), "recorded", impls["fast"]._fast_run is not None)
res = {}
for rnd in range(4):
    for k, impl in impls.items():
        out = outs[k]
        torch.cuda.synchronize()
        ts = []
        for _ in range(300):
            t = time.perf_counter()
            impl.forward(x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], out, 0, x["scale"], case.pool)
            ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        res.setdefault(k, []).append(statistics.median(ts) * 1e6)
for k, v in res.items():
    print(k, " / ".join(f"{u:.1f}" for u in v), "us per forward")
