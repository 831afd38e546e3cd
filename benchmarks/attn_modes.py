"""attention.triton decode: page ids loaded in the loop (shipped), computed (contiguous bench table; a ceiling),
or loaded one iteration ahead; us per call, bits compared with the shipped kernel."""
import sys, importlib.util
sys.path.insert(0, "benchmarks")
import torch
import triton_decode_attention as bench
from pieceworks.backends.attention.triton import num_splits
spec = importlib.util.spec_from_file_location("tdk_var", "benchmarks/tdk_var.py")
tv = importlib.util.module_from_spec(spec); spec.loader.exec_module(tv)
bench.tk = tv
HKV, D = 8, 128
for shape in sys.argv[1].split(","):
    batch, ctx = map(int, shape.split("x"))
    pol = num_splits(batch, HKV)
    state = bench.setup(batch, ctx, 16)
    gb = batch * ctx * HKV * D * 4 / 1e9
    out = state[1][0]
    for s, bn, st in sorted({(pol, 64, 2), (pol, 64, 3), (max(1, pol // 2), 128, 2), (pol, 32, 3)}):
        row = []
        for mode in (0, 1, 2):
            t = [bench.time_variant(state, s, True, block_n=bn, num_stages=st, mode=mode) for _ in range(2)]
            if mode == 0:
                ref = out.clone()
            eq = torch.equal(out, ref)
            row.append(f"mode{mode} {min(t):6.2f} us {gb * 1e3 / min(t):.2f} TB/s{'' if eq else ' DIFF'}")
        print(f"{batch}x{ctx} s{s} bn{bn} st{st}: " + " | ".join(row), flush=True)
    del state; torch.cuda.empty_cache()
