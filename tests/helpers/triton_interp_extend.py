"""Run by tests/test_triton_extend_interp.py in a subprocess with TRITON_INTERPRET=1 (Triton's CPU interpreter fixes
its mode when a kernel is decorated): attention.triton's extend kernel (`triton_extend_kernel.extend`) on float32
pools, on the CPU. Checks the device-side plan (query blocks found by the binary search over the offsets), the page
gathers and the causal mask against a float64 softmax; the bf16 numerics run on the GPU. Prints one JSON line per
case: the largest absolute error, and whether rows past the step's tokens were left untouched."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from pieceworks.backends.attention import triton_extend_kernel  # noqa: E402


def run(q_lens: list[int], prefixes: list[int], hq: int, hkv: int, block_q: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    d, ps, b = 64, 16, len(q_lens)
    lens = [p + n for p, n in zip(prefixes, q_lens)]
    npages = [-(-n // ps) for n in lens]
    pool = sum(npages) + 3
    order = torch.randperm(pool - 1, generator=gen) + 1  # page 0 reserved, the rest shuffled
    table = torch.zeros(b, max(npages) + 2, dtype=torch.int32)
    at = 0
    for i, n in enumerate(npages):
        table[i, :n] = order[at:at + n]
        at += n
    kc = torch.randn(pool, ps, hkv, d, generator=gen)
    vc = torch.randn(pool, ps, hkv, d, generator=gen)
    t = sum(q_lens)
    q = torch.randn(t + 3, hq, d, generator=gen)
    out = torch.full_like(q, float("nan"))
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    triton_extend_kernel.extend(q, kc, vc, out, table, qo, torch.tensor(lens, dtype=torch.int32), b, t, d**-0.5,
                                block_q=block_q, block_n=32)
    g, err = hq // hkv, 0.0
    for i in range(b):
        k = kc[table[i, :npages[i]].long()].flatten(0, 1)[:lens[i]].double().repeat_interleave(g, 1)
        v = vc[table[i, :npages[i]].long()].flatten(0, 1)[:lens[i]].double().repeat_interleave(g, 1)
        rows = slice(int(qo[i]), int(qo[i + 1]))
        s = torch.einsum("lhd,khd->hlk", q[rows].double(), k) * d**-0.5
        pos = prefixes[i] + torch.arange(q_lens[i])
        s = s.masked_fill(torch.arange(lens[i])[None, None, :] > pos[None, :, None], float("-inf"))
        ref = torch.einsum("hlk,khd->lhd", torch.softmax(s, -1), v)
        diff = (out[rows].double() - ref).abs().nan_to_num(nan=float("inf"))  # a row never written stays NaN
        err = max(err, float(diff.max()))
    return {"err": err, "tail_untouched": bool(torch.isnan(out[t:]).all())}


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        print(json.dumps(run(*case)), flush=True)
