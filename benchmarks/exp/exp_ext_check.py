"""exp/triton-extend: the extend kernel against a float reference (bf16, GPU), then an executor with attention.triton
for every mode against FlashInfer's (logits of an extend step and a mixed step)."""
import torch
from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch
from pieceworks.backends.attention import triton_extend_kernel as tk

torch.manual_seed(0)
dev = "cuda"
def case(q_lens, prefixes, hq=32, hkv=8, d=128, ps=16):
    B = len(q_lens); lens = [p + q for p, q in zip(prefixes, q_lens)]
    npages = [-(-l // ps) for l in lens]; P = sum(npages) + 3
    perm = torch.randperm(P - 1) + 1
    table = torch.zeros(B, max(npages) + 2, dtype=torch.int32); i = 0
    for b, n in enumerate(npages):
        table[b, :n] = perm[i:i + n]; i += n
    kc = torch.randn(P, ps, hkv, d, device=dev).bfloat16(); vc = torch.randn(P, ps, hkv, d, device=dev).bfloat16()
    T = sum(q_lens); q = torch.randn(T + 5, hq, d, device=dev).bfloat16(); out = torch.full_like(q, float("nan"))
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    table = table.to(dev)
    tk.extend(q, kc, vc, out, table, qo, torch.tensor(lens, dtype=torch.int32, device=dev), B, T, d**-0.5)
    torch.cuda.synchronize()
    g = hq // hkv; worst = 0.0
    for b in range(B):
        pg = table[b, :npages[b]].long()
        K = kc[pg].flatten(0, 1)[:lens[b]].float(); V = vc[pg].flatten(0, 1)[:lens[b]].float()
        t0 = int(qo[b]); pos = prefixes[b] + torch.arange(q_lens[b], device=dev)
        qq = q[t0:t0 + q_lens[b]].float()                                  # [L, hq, d]
        s = torch.einsum("lhd,khd->hlk", qq, K.repeat_interleave(g, 1)) * d**-0.5
        s = s.masked_fill(torch.arange(lens[b], device=dev)[None, None, :] > pos[None, :, None], float("-inf"))
        ref = torch.einsum("hlk,khd->lhd", torch.softmax(s, -1), V.repeat_interleave(g, 1))
        o = out[t0:t0 + q_lens[b]].float()
        worst = max(worst, float((o - ref).norm() / ref.norm()))
    assert torch.isnan(out[T:]).all()
    return worst
ok = True
for ql, pf in [([16], [0]), ([256], [0]), ([37], [20]), ([1] * 32 + [256], [512] * 32 + [0]),
               ([40, 1, 1, 17], [0, 50, 3, 33]), ([2048], [1000]), ([3, 700, 1], [100, 0, 4000])]:
    e = case(ql, pf)
    ok &= e < 1e-2
    print("kernel", len(ql), "seqs, tokens", sum(ql), "rel err", f"{e:.2e}")
print("kernel ok" if ok else "KERNEL MISMATCH")

def run(att):
    ex = Executor.from_config(None, ["model.arch=llama", "model.preset=llama-3.1-8b", "model.sizes.num_hidden_layers=2",
                                     "quantization.format=none", "runtime.dtype=bfloat16", "kv_cache.num_tokens=16384",
                                     f"backends.attention={att}", "backends.options.flashinfer.variant=fa2",
                                     "cuda_graph.decode.enabled=off", "model.max_context=4096"], progress=False)
    g = torch.Generator().manual_seed(0)
    seqs = [ex.new_sequence() for _ in range(5)]
    toks = [torch.randint(0, ex.vocab_size, (n,), generator=g).tolist() for n in (300, 17, 64, 1, 129)]
    outs = [ex.forward(ForwardBatch(seqs, toks)).float()]
    toks2 = [[5], [6], torch.randint(0, ex.vocab_size, (40,), generator=g).tolist(), [7], [8]]
    outs.append(ex.forward(ForwardBatch(seqs, toks2)).float())
    toks3 = [torch.randint(0, ex.vocab_size, (n,), generator=g).tolist() for n in (8, 3, 1, 200, 16)]
    outs.append(ex.forward(ForwardBatch(seqs, toks3)).float())
    names = {op: sorted(b.name for b in ex.table.instances(op)) for op in ("attention",)}
    ex.close()
    return outs, names
a, na = run("flashinfer")
b, nb = run("triton")
print(na, nb)
for i, (x, y) in enumerate(zip(a, b)):
    rel = float((x - y).norm() / x.norm())
    same = float((x.argmax(-1) == y.argmax(-1)).float().mean())
    print(f"step {i}: logits rel diff {rel:.2e}, same argmax {same:.2f}")
