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
import triton_interp_numpy  # noqa: E402, F401  (beside this script: the interpreter under NumPy >= 2.3)

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




def backend_full(q_lens: list[int], prefixes: list[int], bucket: int, max_seqs: int, seed: int, hq: int = 8,
                 hkv: int = 2) -> dict:
    """attention.triton_all's forward of an extend step planned as a full graph plans it (`graph_batch_size`
    sequences, padding ones empty, `bucket` rows): real rows against the torch backend's eager step, padding rows
    zero, every row's K/V written at its slot."""
    from types import SimpleNamespace

    from pieceworks.backends.attention.torch import TorchAttentionBackend
    from pieceworks.backends.attention.triton import TritonAttentionBackend
    from pieceworks.backends.base import BackendSpec, ModelFacts
    from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata, extend_index

    gen = torch.Generator().manual_seed(seed)
    d, ps = 64, 16
    lens = [p + n for p, n in zip(prefixes, q_lens)]
    npages = [-(-n // ps) for n in lens]
    pool = sum(npages) + 1
    table = torch.zeros(max_seqs, max(npages) + 1, dtype=torch.int32)
    at, slots = 1, []
    for i, n in enumerate(npages):
        table[i, :n] = torch.arange(at, at + n)
        at += n
        pages = table[i]
        slots += [int(pages[p // ps]) * ps + p % ps for p in range(prefixes[i], lens[i])]
    t = sum(q_lens)
    slots += [0] * (bucket - t)  # padding rows: the reserved slot
    caches = [torch.randn(pool, ps, hkv, d, generator=gen) for _ in range(2)]
    q, k, v = (torch.randn(bucket, h, d, generator=gen) for h in (hq, hkv, hkv))
    kv = SimpleNamespace(k_cache=lambda layer, c=caches: c[0], v_cache=lambda layer, c=caches: c[1],
                         k_scale=lambda layer: 1.0, v_scale=lambda layer: 1.0)
    mode = ForwardMode.EXTEND if all(p == 0 for p in prefixes) else ForwardMode.MIXED
    meta = StepMetadata(mode=mode, graph_mode=GraphMode.FULL, extend_lens=list(q_lens), prefix_lens=list(prefixes),
                        page_size=ps, page_table=table, slot_mapping=torch.tensor(slots),
                        positions=torch.zeros(bucket, dtype=torch.int64), graph_batch_size=max_seqs,
                        extend_index=extend_index(q_lens, lens, max_seqs))
    spec = BackendSpec(device="cpu", model=ModelFacts(dtype=torch.float32, num_heads=hq, num_kv_heads=hkv,
                                                       head_dim=d))
    ref_caches = [c.clone() for c in caches]
    out = torch.full((bucket, hq, d), float("nan"))
    backend = TritonAttentionBackend(spec)
    backend.plan(meta)
    backend.forward(q, k, v, out, 0, d**-0.5, kv)
    ref_kv = SimpleNamespace(k_cache=lambda layer: ref_caches[0], v_cache=lambda layer: ref_caches[1],
                             k_scale=lambda layer: 1.0, v_scale=lambda layer: 1.0)
    ref = torch.full_like(out, float("nan"))
    eager = StepMetadata(mode=mode, graph_mode=GraphMode.EAGER, extend_lens=list(q_lens), prefix_lens=list(prefixes),
                         page_size=ps, page_table=table[: len(q_lens)], slot_mapping=torch.tensor(slots),
                         positions=torch.zeros(bucket, dtype=torch.int64))
    torch_backend = TorchAttentionBackend(spec)
    torch_backend.plan(eager)
    torch_backend.forward(q, k, v, ref, 0, d**-0.5, ref_kv)
    err = float((out[:t] - ref[:t]).abs().nan_to_num(nan=float("inf")).max())
    return {"err": err, "padding_zero": bool((out[t:] == 0).all()),
            "kv_equal": all(torch.equal(a[1:], b[1:]) for a, b in zip(caches, ref_caches))}


if __name__ == "__main__":
    fn = backend_full if sys.argv[2:] == ["backend"] else run
    for case in json.loads(sys.argv[1]):
        print(json.dumps(fn(*case)), flush=True)
