"""Named batch scenarios and straightforward dense references for the backend-matrix suite.

The references here are deliberately naive (Python loops, float64, no paging): every backend, the
torch references included, is checked against them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata
from pieceworks.core.kv import KV_FP8, dequantize_kv, quantize_kv
from pieceworks.executor.kv_cache import KVLayout, KVPool
from pieceworks.quant import nvfp4


@dataclass(frozen=True)
class Scenario:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (cached prefix length, new tokens) per sequence
    page_size: int = 4

    @property
    def mode(self) -> ForwardMode:
        return ForwardMode.classify([n for _, n in self.seqs], [p for p, _ in self.seqs])


ATTENTION_SCENARIOS = (
    Scenario("small_decode", ((5, 1), (17, 1), (1, 1), (33, 1))),
    Scenario("extend_no_prefix", ((0, 7), (0, 3))),
    Scenario("extend_with_prefix", ((6, 5), (13, 9))),
    Scenario("mixed", ((9, 1), (0, 6), (4, 3), (20, 1))),
    Scenario("page_boundary", ((16, 16), (15, 1)), page_size=16),
    # decode over longer contexts: several KV pages per split in the split-KV kernels
    Scenario("long_decode", ((700, 1), (1, 1), (129, 1)), page_size=16),
    # one sequence past two splits of 1024 keys: a kernel that drops a split, or keys further back than
    # a window, fails here
    Scenario("long_context", ((2100, 1),), page_size=32),
    # prompts of more new tokens than a kernel's query block (16, 64, 128 rows): a block or tile that
    # covers only the first rows of a sequence fails here
    Scenario("long_extend", ((0, 150), (37, 90)), page_size=16),
)


@dataclass
class AttentionCase:
    pool: KVPool
    meta: StepMetadata
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor  # float64 [T, H, D_out]


def _paged_meta(sc: Scenario, pool: KVPool, device: torch.device, rng: random.Random) -> tuple[StepMetadata, list[list[int]]]:
    ps = sc.page_size
    free = list(range(1, pool.num_pages))
    rng.shuffle(free)
    pages, slots, positions = [], [], []
    for prefix, n in sc.seqs:
        need = -(-(prefix + n) // ps)
        mine, free = free[:need], free[need:]
        pages.append(mine)
        for pos in range(prefix, prefix + n):
            slots.append(mine[pos // ps] * ps + pos % ps)
            positions.append(pos)
    width = max(len(p) for p in pages)
    table = torch.zeros(len(pages), width, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = torch.tensor(p)
    meta = StepMetadata(
        mode=sc.mode, graph_mode=GraphMode.EAGER, extend_lens=[n for _, n in sc.seqs],
        prefix_lens=[p for p, _ in sc.seqs], page_size=ps, page_table=table.to(device),
        slot_mapping=torch.tensor(slots, device=device), positions=torch.tensor(positions, device=device),
        page_lists=pages,
    )
    return meta, pages


def attention_case(sc: Scenario, num_heads: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype, device: torch.device, seed: int = 0, window: int = 0,
                   softcap: float = 0.0, kv_scales: tuple[float, float] | None = None) -> AttentionCase:
    """Random GQA scenario: prefix KV written into shuffled pages, new q/k/v, float64 expectation (with
    `window`, each query sees itself and the window - 1 keys before it; with `softcap`, scores become
    softcap * tanh(scores / softcap); with `kv_scales` (k_scale, v_scale), an FP8 pool: the expectation
    reads every key and value, the new ones too, as stored, `quantize_kv`, and read back)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_pages = 1 + sum(-(-(p + n) // sc.page_size) for p, n in sc.seqs) + 2
    pool = KVPool(KVLayout("gqa", 1, num_kv_heads, head_dim), num_pages, sc.page_size,
                  dtype if kv_scales is None else KV_FP8, device, scales=None if kv_scales is None else [kv_scales])
    pool.buffer.fill_(float("nan"))  # slots no sequence owns may hold anything: a backend must not read them
    meta, pages = _paged_meta(sc, pool, device, rng)
    t = meta.num_tokens
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rnd(t, num_heads, head_dim), rnd(t, num_kv_heads, head_dim), rnd(t, num_kv_heads, head_dim)
    prefix_k = [rnd(p, num_kv_heads, head_dim) for p, _ in sc.seqs]
    prefix_v = [rnd(p, num_kv_heads, head_dim) for p, _ in sc.seqs]
    kc, vc = pool.k_cache(0), pool.v_cache(0)
    ks, vs = pool.k_scale(0), pool.v_scale(0)
    # quantize inputs to the test dtype first so the reference sees exactly what the backend sees
    q, k, v = (x.to(dtype) for x in (q, k, v))
    prefix_k, prefix_v = [x.to(dtype) for x in prefix_k], [x.to(dtype) for x in prefix_v]
    put = (lambda x, s: x) if kv_scales is None else quantize_kv  # what the pool holds of x
    for mine, pk, pv in zip(pages, prefix_k, prefix_v):
        _fill_pages(kc, mine, put(pk, ks))
        _fill_pages(vc, mine, put(pv, vs))
    stored = (lambda x, s: x) if kv_scales is None else (lambda x, s: dequantize_kv(quantize_kv(x, s), s))
    scale = 1.0 / math.sqrt(head_dim)
    group = num_heads // num_kv_heads
    expected, lo = [], 0
    for (prefix, n), pk, pv in zip(sc.seqs, prefix_k, prefix_v):
        keys = stored(torch.cat([pk, k[lo : lo + n]]), ks).double().repeat_interleave(group, 1)
        vals = stored(torch.cat([pv, v[lo : lo + n]]), vs).double().repeat_interleave(group, 1)
        expected.append(reference_attention(q[lo : lo + n].double(), keys, vals, prefix, scale, window, softcap))
        lo += n
    inputs = {"q": q.to(device), "k": k.to(device), "v": v.to(device)}
    return AttentionCase(pool, meta, inputs, torch.cat(expected))


def _fill_pages(cache: torch.Tensor, pages: list[int], rows: torch.Tensor) -> None:
    """cache[pages[pos // page_size], pos % page_size] = rows[pos] for every position, a page at a time."""
    ps = cache.shape[1]
    for start in range(0, rows.shape[0], ps):
        part = rows[start : start + ps]
        cache[pages[start // ps], : part.shape[0]] = part


def reference_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, prefix: int, scale: float,
                        window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of the n queries q [n, H, D] at positions prefix .. prefix + n - 1 over keys [S, H, D] and
    values [S, H, Dv] (every head's own; S = prefix + n): [n, H, Dv] in q's dtype. With `window`, a query sees
    itself and the window - 1 keys before it; with `softcap`, scores become softcap * tanh(scores / softcap)."""
    s = torch.einsum("nhd,thd->hnt", q, keys) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    pos, t = torch.arange(q.shape[0])[:, None] + prefix, torch.arange(keys.shape[0])[None, :]
    seen = (t <= pos) & (t > pos - window) if window else t <= pos
    return torch.einsum("hnt,thd->nhd", torch.softmax(s.masked_fill(~seen, float("-inf")), -1), vals)


def fused_qkv_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q [T, Hq, D], k and v [T, Hkv, D] as the Llama attention passes them (models/llama.py
    `attend_roped`): column views of one fused [T, (Hq + 2 Hkv) D] projection, each with a row stride of
    (Hq + 2 Hkv) D (not contiguous when T > 1)."""
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    parts = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1)
    return tuple(p.view(-1, *x.shape[1:]) for p, x in zip(parts, (q, k, v)))


def mla_case(sc: Scenario, num_heads: int, rank: int, rope: int, dtype: torch.dtype,
             device: torch.device, seed: int = 0) -> AttentionCase:
    """Random MLA scenario over a latent cache of [rank + rope] per token."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_pages = 1 + sum(-(-(p + n) // sc.page_size) for p, n in sc.seqs) + 2
    pool = KVPool(KVLayout("mla", 1, latent_dim=rank + rope), num_pages, sc.page_size, dtype, device)
    pool.buffer.fill_(float("nan"))
    meta, pages = _paged_meta(sc, pool, device, rng)
    t = meta.num_tokens
    rnd = lambda *s: (torch.randn(*s, generator=gen) * 0.5).to(dtype)  # noqa: E731
    q_nope, q_pe, c_kv, k_pe = rnd(t, num_heads, rank), rnd(t, num_heads, rope), rnd(t, rank), rnd(t, rope)
    prefix = [rnd(p, rank + rope) for p, _ in sc.seqs]
    cache = pool.latent_cache(0)
    for mine, pre in zip(pages, prefix):
        _fill_pages(cache, mine, pre)
    scale = 1.0 / math.sqrt(rank // 4 + rope)
    expected, lo = [], 0
    for (plen, n), pre in zip(sc.seqs, prefix):
        ent = torch.cat([pre, torch.cat([c_kv[lo : lo + n], k_pe[lo : lo + n]], -1)]).double()
        ent = ent[:, None].expand(-1, num_heads, -1)  # one latent per token, shared by every head
        q = torch.cat([q_nope[lo : lo + n], q_pe[lo : lo + n]], -1).double()
        expected.append(reference_attention(q, ent, ent[..., :rank], plen, scale))
        lo += n
    inputs = {"q_nope": q_nope.to(device), "q_pe": q_pe.to(device), "c_kv": c_kv.to(device),
              "k_pe": k_pe.to(device), "scale": scale}
    return AttentionCase(pool, meta, inputs, torch.cat(expected))


# (M, K, N); "large": more rows than a 64- or 128-row tile, K past a 512-wide split, M not a multiple of 16
GEMM_SHAPES = {"gemv": (1, 128, 48), "small_batch": (7, 272, 96), "prefill": (33, 64, 80), "large": (200, 1024, 64)}


def random_fp4_weight(n: int, k: int, gen: torch.Generator, device: torch.device):
    """A random NVFP4 linear (ModelOpt-quantized from a random float weight) with input_scale."""
    w = torch.randn(n, k, generator=gen) * 0.05
    packed, scale, scale_2 = nvfp4.quantize_weight(w)
    input_scale = torch.tensor(3.0 / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX))  # activation amax 3
    return tuple(t.to(device) for t in (packed, scale, scale_2, input_scale))


def dense_fp4_gemm(x: torch.Tensor, weight, weight_scale, weight_scale_2, input_scale, numerics: str) -> torch.Tensor:
    """float64 x @ dequant(W).T; for w4a4 x is first rounded through activation quantization."""
    w = nvfp4.dequantize(weight.cpu(), weight_scale.cpu(), weight_scale_2.cpu()).double()
    xs = x.cpu().float()
    if numerics == "w4a4":
        xs = nvfp4.fake_quantize_activation(xs, input_scale.cpu())
    return xs.double() @ w.t()


def dense_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, topk_group: int,
                renormalize: bool, scaling: float) -> list[list[tuple[int, float]]]:
    """DeepSeek-V3 routing one token at a time in Python (float64)."""
    out = []
    num_experts = logits.shape[1]
    per_group = num_experts // groups
    for row in logits.double():
        scores = torch.sigmoid(row)
        choice = scores + (bias.double() if bias.numel() else 0)
        gscore = [sorted(choice[g * per_group : (g + 1) * per_group].tolist())[-2:] for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -sum(gscore[g]))[:topk_group]
        allowed = [e for e in range(num_experts) if e // per_group in kept]
        ids = sorted(allowed, key=lambda e: -float(choice[e]))[:top_k]
        w = [float(scores[e]) for e in ids]
        if renormalize:
            total = sum(w)
            w = [x / total for x in w]
        out.append([(e, x * scaling) for e, x in zip(ids, w)])
    return out


def dense_moe(x, logits, bias, weights, top_k, groups, topk_group, renormalize, scaling, numerics) -> torch.Tensor:
    """Per-token, per-chosen-expert loop in float64 over dequantized expert weights."""
    w13, w13_s, w13_s2, w13_in, w2, w2_s, w2_s2, w2_in = (t.cpu() for t in weights)
    fp4 = w13.dtype == torch.uint8
    inter = w13.shape[1] // 2

    dense: dict[tuple[int, str], torch.Tensor] = {}  # (expert, part) -> float64 W.T, dequantized once

    def lin(key, v, w, s, s2, in_scale):
        wt = dense.get(key)
        if wt is None:
            wt = dense[key] = (nvfp4.dequantize(w, s, s2) if fp4 else w).double().t()
        if fp4 and numerics == "w4a4":
            v = nvfp4.fake_quantize_activation(v.float()[None], in_scale)[0]
        return v.double() @ wt

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, choices in enumerate(dense_route(logits.cpu(), bias.cpu(), top_k, groups, topk_group, renormalize, scaling)):
        xt = x[t].cpu()
        for e, weight in choices:
            sl = slice(None, inter), slice(inter, None)
            g = lin((e, "gate"), xt, w13[e, sl[0]], w13_s[e, sl[0]] if fp4 else None, w13_s2[e, 0] if fp4 else None,
                    w13_in[e] if fp4 else None)
            u = lin((e, "up"), xt, w13[e, sl[1]], w13_s[e, sl[1]] if fp4 else None, w13_s2[e, 1] if fp4 else None,
                    w13_in[e] if fp4 else None)
            h = (F.silu(g) * u).to(x.dtype)
            out[t] += weight * lin((e, "down"), h, w2[e], w2_s[e] if fp4 else None, w2_s2[e] if fp4 else None,
                                   w2_in[e] if fp4 else None)
    return out


def random_moe_weights(num_experts: int, hidden: int, inter: int, fp4: bool, dtype: torch.dtype,
                       gen: torch.Generator, device: torch.device):
    """Stacked expert weights in the MoEWeights layout (see backends/moe/base.py)."""
    from pieceworks.backends.moe.base import MoEWeights

    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.1
    if not fp4:
        empty = torch.empty(0, device=device)
        return MoEWeights(w13.to(dtype).to(device), empty, empty, empty, w2.to(dtype).to(device), empty, empty, empty)
    # gate and up of an expert share one global scale, as ModelOpt exports them (Blackwell MoE kernels
    # take one per expert)
    shared = [nvfp4.weight_global_scale(w13[e]) for e in range(num_experts)]
    q13 = [[nvfp4.quantize_weight(w13[e, :inter], shared[e]), nvfp4.quantize_weight(w13[e, inter:], shared[e])]
           for e in range(num_experts)]
    q2 = [nvfp4.quantize_weight(w2[e]) for e in range(num_experts)]
    in13 = torch.full((num_experts,), 2.0 / 2688)
    in2 = torch.full((num_experts,), 0.5 / 2688)
    t = lambda x: x.to(device)  # noqa: E731
    return MoEWeights(
        t(torch.stack([torch.cat([g[0], u[0]]) for g, u in q13])),
        t(torch.stack([torch.cat([g[1], u[1]]) for g, u in q13])),
        t(torch.stack([torch.stack([g[2], u[2]]) for g, u in q13])), t(in13),
        t(torch.stack([q[0] for q in q2])), t(torch.stack([q[1] for q in q2])),
        t(torch.stack([q[2] for q in q2])), t(in2),
    )
