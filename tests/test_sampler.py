"""The batched device sampler against plain-torch references (CPU; the GPU half is at the end).

Distributions are checked empirically: many rows of the same logits in one batch, each frequency
within 5 standard errors (sqrt(p (1 - p) / N)) of the reference probability, and exact support: a
token the reference gives probability 0 is never drawn. Processed logits (penalties) are checked
exactly against the formula. Fixed seeds throughout.
"""

from __future__ import annotations

import gc
import math
import warnings

import pytest
import torch

from pieceworks.engine.params import SamplingParams
from pieceworks.engine.processors import apply_min_p, apply_penalties, apply_top_k, apply_top_k_top_p
from pieceworks.engine.logprobs import logprob_table, read_logprobs
from pieceworks.engine.sampler import SamplingState, Sampler
from pieceworks.errors import RequestError

CPU = torch.device("cpu")
EOS = 7
# distinct, well-separated logits: no tie at a top_k edge, no cumulative probability near a top_p edge
BASE = torch.tensor([2.0, 1.4, 1.1, 0.3, 0.0, -0.6, -1.3, 0.9])
V = BASE.numel()
N = 8_000


def state(params: SamplingParams, prompt=(1, 2), out=(), eos=(EOS,), seed_offset=0) -> SamplingState:
    s = SamplingState.create(params, list(prompt), eos, CPU, seed_offset=seed_offset)
    for t in out:
        s.append(t)
    return s


def frequencies(sampler: Sampler, logits_row: torch.Tensor, make_state, n: int = N) -> torch.Tensor:
    """Token frequencies [V] float64 over n rows of `logits_row` sampled in one batch."""
    logits = logits_row.float().expand(n, -1).contiguous()
    res = sampler.sample(logits, [make_state() for _ in range(n)])
    assert all(res.finite)
    return torch.bincount(torch.tensor(res.token_ids), minlength=logits_row.numel()).double() / n


def assert_matches(freq: torch.Tensor, ref: torch.Tensor, n: int = N) -> None:
    assert torch.all(freq[ref == 0] == 0), f"drawn outside the support: freq {freq.tolist()} ref {ref.tolist()}"
    tol = 5 * torch.sqrt(ref * (1 - ref) / n) + 1e-12
    bad = (freq - ref).abs() > tol
    assert not bad.any(), f"freq {freq.tolist()}\nref  {ref.tolist()}\ntol  {tol.tolist()}"


def ref_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The reference distribution in float64, in vLLM's order: temperature, min_p, top_k, top_p."""
    x = logits.double() / temperature
    p = x.softmax(-1)
    x = x.masked_fill(p < min_p * p.max(), -math.inf)
    if top_k > 0:
        x = x.masked_fill(x < x.topk(top_k).values[-1], -math.inf)
    if top_p < 1:
        p = x.softmax(-1)
        sp, order = p.sort(descending=True)
        drop_sorted = (sp.cumsum(-1) - sp) >= top_p  # tokens after the nucleus has reached top_p
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), -math.inf)
    return x.softmax(-1)


# ----- greedy ---------------------------------------------------------------------------------------


def test_greedy_batch_is_argmax_bit_identical():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    logits[3, 17] = logits[3, 500] = logits[3].max() + 1  # a tie: the first index, as argmax
    sampler = Sampler(1000, CPU)
    res = sampler.sample(logits, [state(SamplingParams(temperature=0)) for _ in range(16)])
    assert res.token_ids == logits.argmax(-1).tolist()
    assert res.token_ids[3] == 17


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.9, top_k=1),  # top_k 1 is greedy
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(seed=3),
    ]
    states = [state(p, out=[5, 6]) for p in params]
    res = Sampler(300, CPU).sample(logits, states)
    want = logits.argmax(-1).tolist()
    for i in (0, 2, 4):
        assert res.token_ids[i] == want[i]


# ----- distributions --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature(temperature):
    sampler = Sampler(V, CPU, seed=11)
    p = SamplingParams(temperature=temperature)
    freq = frequencies(sampler, BASE, lambda: state(p))
    assert_matches(freq, ref_probs(BASE, temperature))


@pytest.mark.parametrize("top_k", [2, 3, 5, V, V + 10, -1])
def test_top_k(top_k):
    sampler = Sampler(V, CPU, seed=12)
    p = SamplingParams(top_k=top_k, temperature=0.8)
    freq = frequencies(sampler, BASE, lambda: state(p))
    ref = ref_probs(BASE, 0.8, top_k=min(max(top_k, 0), V))
    if 0 < top_k < V:
        assert int((ref > 0).sum()) == top_k
    assert_matches(freq, ref)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.85, 1.0])
def test_top_p(top_p):
    sampler = Sampler(V, CPU, seed=13)
    p = SamplingParams(top_p=top_p)
    freq = frequencies(sampler, BASE, lambda: state(p))
    ref = ref_probs(BASE, top_p=top_p)
    assert_matches(freq, ref)


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.7, 1.0])
def test_min_p(min_p):
    sampler = Sampler(V, CPU, seed=14)
    p = SamplingParams(min_p=min_p, temperature=1.3)
    freq = frequencies(sampler, BASE, lambda: state(p))
    assert_matches(freq, ref_probs(BASE, 1.3, min_p=min_p))


def test_truncations_keep_exactly_the_reference_set():
    """On processed logits: per-row top_k, top_p and min_p keep exactly the reference's tokens
    (the kept ones unchanged, the rest -inf), over 16 rows of a 1000-token vocabulary."""
    g = torch.Generator().manual_seed(22)
    B, W = 16, 1000
    logits = torch.randn(B, W, generator=g) * 2
    k = torch.tensor([1, 2, 5, 17, 100, 999, W, W] * 2)
    p = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.9, 0.99, 1.0, 0.6] * 2)
    m = torch.tensor([0.0, 0.01, 0.1, 0.5, 0.9, 1.0, 0.2, 0.0] * 2)
    for i in range(B):
        ref_k = torch.isfinite(ref_probs(logits[i], top_k=int(k[i]) % W).log())
        ref_p = ref_probs(logits[i], top_p=float(p[i])) > 0
        ref_m = ref_probs(logits[i], min_p=float(m[i])) > 0
        ref_kp = ref_probs(logits[i], top_k=int(k[i]) % W, top_p=float(p[i])) > 0
        for got, ref in ((apply_top_k(logits, k, 999)[i], ref_k), (apply_top_k_top_p(logits, None, p)[i], ref_p),
                         (apply_min_p(logits, m)[i], ref_m), (apply_top_k_top_p(logits, k, p)[i], ref_kp)):
            kept = torch.isfinite(got)
            assert torch.equal(kept, ref), (i, int(kept.sum()), int(ref.sum()))
            assert torch.equal(got[kept], logits[i][kept])
    assert int(torch.isfinite(apply_top_k(logits, k, 999)[2]).sum()) == 5


def test_all_truncations_together_in_vllm_order():
    sampler = Sampler(V, CPU, seed=15)
    p = SamplingParams(temperature=1.7, min_p=0.12, top_k=5, top_p=0.8)
    ref = ref_probs(BASE, 1.7, top_k=5, top_p=0.8, min_p=0.12)
    assert 1 < int((ref > 0).sum()) < 5  # each step removes something here
    assert_matches(frequencies(sampler, BASE, lambda: state(p)), ref)


def test_rows_with_different_params_in_one_batch():
    """Per-row parameters: two halves of one batch follow their own reference distributions."""
    sampler = Sampler(V, CPU, seed=16)
    a, b = SamplingParams(temperature=0.6, top_k=3), SamplingParams(temperature=2.0, top_p=0.9)
    n = N // 2
    logits = BASE.expand(2 * n, -1).contiguous()
    res = sampler.sample(logits, [state(a) if i % 2 == 0 else state(b) for i in range(2 * n)])
    ids = torch.tensor(res.token_ids)
    for half, ref in ((ids[0::2], ref_probs(BASE, 0.6, top_k=3)), (ids[1::2], ref_probs(BASE, 2.0, top_p=0.9))):
        assert_matches(torch.bincount(half, minlength=V).double() / n, ref, n)


def test_top_k_rows_next_to_rows_without_truncation():
    """The top-k selection path (no top_p in the batch) leaves rows without top_k whole."""
    sampler = Sampler(V, CPU, seed=20)
    a, b = SamplingParams(top_k=3, temperature=0.7), SamplingParams(temperature=1.2)
    n = N // 2
    res = sampler.sample(BASE.expand(2 * n, -1).contiguous(), [state(a) if i % 2 else state(b) for i in range(2 * n)])
    ids = torch.tensor(res.token_ids)
    for half, ref in ((ids[1::2], ref_probs(BASE, 0.7, top_k=3)), (ids[0::2], ref_probs(BASE, 1.2))):
        assert_matches(torch.bincount(half, minlength=V).double() / n, ref, n)


def test_seeded_rows_follow_the_distribution():
    sampler = Sampler(V, CPU, seed=17)
    n = 4000  # a generator each
    freq = frequencies(sampler, BASE, iter(state(SamplingParams(seed=s, top_k=6)) for s in range(n)).__next__, n)
    assert_matches(freq, ref_probs(BASE, top_k=6), n)


# ----- penalties ------------------------------------------------------------------------------------


def ref_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's formula token by token, in float32 like the logits."""
    out = logits.clone()
    for t in range(logits.numel()):
        x = out[t]
        if t in prompt or t in output:
            x = x / repetition if x > 0 else x * repetition
        count = output.count(t)
        x = x - torch.tensor(frequency, dtype=torch.float32) * count
        x = x - torch.tensor(presence, dtype=torch.float32) * (count > 0)
        out[t] = x
    return out


def test_apply_penalties_is_the_formula_exactly():
    g = torch.Generator().manual_seed(2)
    B, W = 5, 40
    logits = torch.randn(B, W, generator=g) * 3
    cases = [  # (prompt, output, presence, frequency, repetition)
        ([1, 2, 3], [3, 4, 4, 4, 9], 0.5, 0.25, 1.3),
        ([0, 39], [], -1.0, 2.0, 0.7),
        ([], [5, 5, 6], 0.0, 0.0, 1.0),
        ([7, 8], [8, 10, 10], 2.0, -2.0, 1.0),
        ([11] * 3, [12, 11], 0.0, 1.1, 2.5),
    ]
    prompt_mask = torch.zeros(B, W, dtype=torch.bool)
    counts = torch.zeros(B, W, dtype=torch.int32)
    for i, (p, o, *_ ) in enumerate(cases):
        prompt_mask[i, p] = True
        counts[i] += torch.bincount(torch.tensor(o, dtype=torch.long), minlength=W).int()
    pres, freq, rep = (torch.tensor([c[k] for c in cases], dtype=torch.float32) for k in (2, 3, 4))
    got = apply_penalties(logits, prompt_mask, counts, pres, freq, rep)
    for i, (p, o, a, f, r) in enumerate(cases):
        want = ref_penalties(logits[i], p, o, pres[i].item(), freq[i].item(), rep[i].item())
        assert torch.equal(got[i], want), i
    assert torch.equal(got[2], logits[2])  # neutral penalties: bit-identical
    # a penalty no row uses may be left out: the same as passing its neutral value
    neutral = {"presence": torch.zeros(B), "frequency": torch.zeros(B), "repetition": torch.ones(B)}
    for left_out in neutral:
        args = {"presence": pres, "frequency": freq, "repetition": rep}
        full = apply_penalties(logits, prompt_mask, counts, **{**args, left_out: neutral[left_out]})
        short = apply_penalties(logits, None if left_out == "repetition" else prompt_mask, counts,
                                **{**args, left_out: None})
        assert torch.equal(full, short), left_out


PENALTY_MIXES = {
    "presence+frequency / repetition": [dict(presence_penalty=0.8, frequency_penalty=0.3),
                                         dict(repetition_penalty=1.8)],
    "presence / repetition": [dict(presence_penalty=0.8), dict(repetition_penalty=1.8)],
    "frequency / presence": [dict(frequency_penalty=0.4), dict(presence_penalty=1.1)],
    "repetition only": [dict(repetition_penalty=1.6), dict(repetition_penalty=1.8)],
}


@pytest.mark.parametrize("mix", list(PENALTY_MIXES))
def test_penalties_end_to_end_greedy_tracks_appended_tokens(mix):
    """Greedy with penalties picks the argmax of the penalized logits, step after step, with the
    sampler adding only newly appended tokens to its device counts."""
    g = torch.Generator().manual_seed(3)
    W = 50
    logits = torch.randn(3, W, generator=g)
    a, b = PENALTY_MIXES[mix]
    params = [
        SamplingParams(temperature=0, **a),
        SamplingParams(temperature=0, **b),
        SamplingParams(temperature=0),  # no penalty: plain argmax every step
    ]
    prompts = [[4, 5], [int(logits[1].argmax()), 9], [1]]
    states = [state(p, prompt=pr, eos=()) for p, pr in zip(params, prompts)]
    sampler = Sampler(W, CPU)
    for _ in range(12):
        res = sampler.sample(logits, states)
        for i, (p, s) in enumerate(zip(params, states)):
            want = ref_penalties(logits[i], s.prompt_token_ids, s.output_token_ids,
                                 p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            assert res.token_ids[i] == int(want.argmax()), (i, s.output_token_ids)
        for s, t in zip(states, res.token_ids):
            s.append(t)
    assert len(set(states[0].output_token_ids)) > 1  # the penalties did move the argmax
    if params[1].repetition_penalty != 1:
        assert states[1].output_token_ids[0] != prompts[1][0]  # repetition counts the prompt
    assert set(states[2].output_token_ids) == {int(logits[2].argmax())}


def test_penalty_counts_on_the_device_match_the_output():
    W = 30
    sampler = Sampler(W, CPU, seed=4)
    s = state(SamplingParams(frequency_penalty=0.1), prompt=[3, 3, 29], out=[1, 2, 2])
    logits = torch.zeros(1, W)
    for _ in range(6):
        s.append(sampler.sample(logits, [s]).token_ids[0])
    table, slot, counted = s._penalty
    assert counted == len(s.output_token_ids) - 1  # the last token is counted at the next step
    sampler.sample(logits, [s])
    want = torch.bincount(torch.tensor(s.output_token_ids), minlength=W).int()
    assert torch.equal(table.counts[slot], want)
    assert table.prompt[slot].nonzero().flatten().tolist() == [3, 29]
    del s.output_token_ids[2:]  # a shrunk list is recounted from scratch
    sampler.sample(logits, [s])
    assert torch.equal(table.counts[slot], torch.bincount(torch.tensor(s.output_token_ids), minlength=W).int())


def test_penalty_slots_return_when_states_die():
    W = 10
    sampler = Sampler(W, CPU)
    states = [state(SamplingParams(presence_penalty=1.0)) for _ in range(5)]
    sampler.sample(torch.zeros(5, W), states)
    slots = {s._penalty[1] for s in states}
    assert len(slots) == 5 and 0 not in slots
    size = sampler._table.counts.shape[0]
    del states
    gc.collect()
    fresh = [state(SamplingParams(presence_penalty=1.0), out=[4]) for _ in range(5)]
    sampler.sample(torch.zeros(5, W), fresh)
    assert sampler._table.counts.shape[0] == size  # the freed slots were reused, not grown
    for s in fresh:  # and cleared: only this state's own token is counted
        assert sampler._table.counts[s._penalty[1]].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]


def test_release_frees_the_slot_now():
    W = 10
    sampler = Sampler(W, CPU)
    s = state(SamplingParams(repetition_penalty=1.5), out=[1])
    sampler.sample(torch.zeros(1, W), [s])
    slot = s._penalty[1]
    sampler.release(s)
    assert slot in sampler._table.free and s._penalty is None
    sampler.release(s)  # twice is harmless
    assert sampler._table.free.count(slot) == 1
    del s
    gc.collect()
    assert sampler._table.free.count(slot) == 1  # the finalizer doesn't free it a second time
    other = state(SamplingParams(presence_penalty=1.0), out=[2, 2])
    sampler.sample(torch.zeros(1, W), [other])
    assert other._penalty[1] == slot
    assert sampler._table.counts[slot].tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 0]


def test_frequency_penalty_distribution():
    sampler = Sampler(V, CPU, seed=18)
    p = SamplingParams(frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.5, temperature=0.9)
    out = [0, 0, 2]
    freq = frequencies(sampler, BASE, lambda: state(p, prompt=[5], out=out))
    pen = ref_penalties(BASE, [5], out, 0.2, 0.7, 1.5)
    assert_matches(freq, ref_probs(pen, 0.9))


# ----- min_tokens -----------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids():
    W = 12
    logits = torch.full((1, W), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0  # a stop id, second best
    logits[0, 5] = 1.0
    sampler = Sampler(W, CPU, seed=5)
    for p in (SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3]),
              SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[3])):
        s = state(p)
        got = []
        for _ in range(4):
            t = sampler.sample(logits, [s]).token_ids[0]
            got.append(t)
            s.append(t)
        assert EOS not in got[:3] and 3 not in got[:3], (p, got)
        if p.greedy:
            assert got == [5, 5, 5, EOS]
    s = state(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[3]))
    assert sampler.sample(logits, [s]).token_ids == [EOS]  # ignore_eos: EOS isn't a stop id to hold back


def test_with_max_tokens_copies_and_checks():
    """A server's prompts of one request: one SamplingParams, copied with each prompt's max_tokens, checked as
    construction checks it."""
    p = SamplingParams(max_tokens=5, min_tokens=3, logit_bias={1: 2.0}, stop=["x"])
    q = p.with_max_tokens(8)
    assert (q.max_tokens, p.max_tokens) == (8, 5)
    assert q == SamplingParams(max_tokens=8, min_tokens=3, logit_bias={1: 2.0}, stop=["x"])
    assert p.with_max_tokens(None).max_tokens is None
    with pytest.raises(RequestError, match=r"min_tokens=3 is out of range: allowed <= max_tokens \(2\)"):
        p.with_max_tokens(2)
    with pytest.raises(RequestError, match="max_tokens"):
        p.with_max_tokens(0)


def test_non_contiguous_logits():
    """A view of wider or transposed logits samples as its contiguous copy."""
    W = 12
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(3, W + 5, generator=g)
    wide[:, EOS] = 50.0
    params = [SamplingParams(temperature=0, min_tokens=2), SamplingParams(temperature=0, presence_penalty=1.0),
              SamplingParams(seed=4, top_k=3)]
    for view in (wide[:, :W], wide[:, :W].t().contiguous().t()):
        assert not view.is_contiguous()
        got = Sampler(W, CPU).sample(view, [state(p, out=[0]) for p in params]).token_ids
        want = Sampler(W, CPU).sample(view.contiguous(), [state(p, out=[0]) for p in params]).token_ids
        assert got == want and got[0] != EOS and got[1] == EOS


def test_min_tokens_sampled_distribution_excludes_only_stop_ids():
    sampler = Sampler(V, CPU, seed=19)
    p = SamplingParams(min_tokens=1, stop_token_ids=[0])
    freq = frequencies(sampler, BASE, lambda: state(p, eos=(EOS, 1)))
    masked = BASE.clone()
    masked[[0, 1, EOS]] = -math.inf
    assert_matches(freq, ref_probs(masked))


def test_logit_bias_moves_greedy_rows_and_leaves_their_neighbours():
    """Greedy rows take the argmax of the biased logits; rows without a bias keep their bits (the
    all-plain fast path), logprobs stay those of the raw logits."""
    W = 12
    logits = torch.randn(3, W, generator=torch.Generator().manual_seed(4))
    top = logits.argmax(-1).tolist()
    raise_tok, ban = (top[0] + 1) % W, top[2]
    params = [SamplingParams(temperature=0, logit_bias={raise_tok: 100.0}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={ban: -100.0}, logprobs=1)]
    res = Sampler(W, CPU).sample(logits, [state(p) for p in params])
    second = logits[2].clone()
    second[ban] = -math.inf
    assert res.token_ids == [raise_tok, top[1], int(second.argmax())]
    raw = logits[2].log_softmax(-1)
    assert res.logprobs[2][res.token_ids[2]] == pytest.approx(float(raw[res.token_ids[2]]), abs=1e-6)
    assert Sampler(W, CPU).sample(logits, [state(SamplingParams(temperature=0, logit_bias={}))] * 3).token_ids == top


def test_bias_and_allowed_ids_are_checked_once_per_request(monkeypatch):
    """A request's logit_bias and allowed_token_ids become arrays once (checked against the vocabulary then),
    not every step; the result of later steps is the same, and a row moved to another index follows."""
    from pieceworks.engine import rows as rows_module

    calls = []
    real = rows_module.check_ids
    monkeypatch.setattr(rows_module, "check_ids", lambda ids, v, name: (calls.append(name), real(ids, v, name)))
    W = 16
    logits = torch.randn(2, W, generator=torch.Generator().manual_seed(8))
    a = state(SamplingParams(temperature=0, logit_bias={3: 100.0}))
    b = state(SamplingParams(temperature=0, allowed_token_ids=[5, 9]))
    s = Sampler(W, CPU)
    first = s.sample(logits, [a, b]).token_ids
    assert first[0] == 3 and first[1] in (5, 9)
    assert s.sample(logits, [a, b]).token_ids == first
    assert s.sample(logits.flip(0), [b, a]).token_ids == first[::-1]
    assert sorted(calls) == ["allowed_token_ids", "logit_bias"]
    with pytest.raises(RequestError, match="logit_bias"):  # still checked, on first use
        Sampler(W, CPU).sample(logits[:1], [state(SamplingParams(temperature=0, logit_bias={W: 1.0}))])


def test_logit_bias_sampled_distribution_is_softmax_of_biased_logits():
    sampler = Sampler(V, CPU, seed=23)
    bias = {0: -100.0, 3: 1.5, 6: 2.0}
    p = SamplingParams(temperature=0.7, top_k=6, logit_bias=bias)
    freq = frequencies(sampler, BASE, lambda: state(p))
    biased = BASE.clone()
    for tok, b in bias.items():
        biased[tok] += b
    assert_matches(freq, ref_probs(biased, temperature=0.7, top_k=6))
    assert freq[0] == 0


def test_allowed_token_ids_restrict_their_rows_only():
    W = 12
    logits = torch.randn(3, W, generator=torch.Generator().manual_seed(6))
    top = logits.argmax(-1).tolist()
    allowed = [t for t in range(W) if t != top[0]][:3]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed), SamplingParams(temperature=0),
              SamplingParams(temperature=0, allowed_token_ids=[top[2]], logit_bias={(top[2] + 1) % W: 100.0})]
    res = Sampler(W, CPU).sample(logits, [state(p) for p in params])
    assert res.token_ids == [max(allowed, key=lambda t: float(logits[0, t])), top[1], top[2]]
    sampler = Sampler(V, CPU, seed=29)
    p = SamplingParams(temperature=0.8, allowed_token_ids=[1, 4, 6], logit_bias={4: 1.0})
    freq = frequencies(sampler, BASE, lambda: state(p))
    ref = torch.full_like(BASE, -math.inf)
    ref[[1, 4, 6]] = BASE[[1, 4, 6]] + torch.tensor([0.0, 1.0, 0.0])
    assert_matches(freq, ref_probs(ref, temperature=0.8))
    ids = Sampler(W, CPU).sample_ids(logits, [state(p) for p in params])  # async steps: the same tokens
    assert ids.tolist() == res.token_ids


def test_logit_bias_before_penalties_and_with_min_tokens():
    """The bias is added before the repetition penalty divides (vLLM v1's order), and a token min_tokens
    holds back stays out whatever its bias."""
    W = 10
    logits = torch.full((1, W), -4.0)
    logits[0, 2], logits[0, 4] = 3.0, 2.0
    p = SamplingParams(temperature=0, logit_bias={4: 1.5, EOS: 50.0}, repetition_penalty=2.0, min_tokens=1)
    # 4: (2 + 1.5) / 2 = 1.75 (in the prompt), 2: 3.0; EOS masked by min_tokens
    assert Sampler(W, CPU).sample(logits, [state(p, prompt=[4])]).token_ids == [2]
    p = SamplingParams(temperature=0, logit_bias={4: 4.5}, repetition_penalty=2.0)
    assert Sampler(W, CPU).sample(logits, [state(p, prompt=[4])]).token_ids == [4]  # (2 + 4.5) / 2 > 3
    assert Sampler(W, CPU).sample(logits, [state(SamplingParams(temperature=0, logit_bias={EOS: 50.0}))]).token_ids \
        == [EOS]


# ----- seeds ----------------------------------------------------------------------------------------


def _run(sampler, logits_fn, states, steps, track):
    out = []
    for step in range(steps):
        res = sampler.sample(logits_fn(step, len(states)), states)
        for s, t in zip(states, res.token_ids):
            s.append(t)
        out.append(res.token_ids[track])
    return out


def test_seeded_request_gives_the_same_tokens_alone_and_in_any_batch():
    W = 64
    g = torch.Generator().manual_seed(6)
    table = torch.randn(20, W, generator=g)
    own_row = table[0]

    def logits_fn(pos):
        def fn(step, B):
            x = table[(torch.arange(B) + step) % 20].clone()
            x[pos] = own_row + 0.1 * step
            return x
        return fn

    p = SamplingParams(seed=1234, temperature=1.1, top_p=0.95, max_tokens=None)
    alone = _run(Sampler(W, CPU, seed=0), logits_fn(0), [state(p)], 15, 0)
    others = [SamplingParams(), SamplingParams(seed=99, top_k=4), SamplingParams(temperature=0),
              SamplingParams(presence_penalty=1.5, min_p=0.1), SamplingParams(top_k=3, min_tokens=5)]
    batch = [state(o) for o in others[:2]] + [state(p)] + [state(o) for o in others[2:]]
    batched = _run(Sampler(W, CPU, seed=77), logits_fn(2), batch, 15, 2)
    assert alone == batched
    again = _run(Sampler(W, CPU, seed=5), logits_fn(0), [state(p)], 15, 0)
    assert again == alone
    other_seed = _run(Sampler(W, CPU, seed=0), logits_fn(0), [state(SamplingParams(seed=1235, temperature=1.1,
                                                                                    top_p=0.95))], 15, 0)
    assert other_seed != alone


def test_seed_offset_gives_distinct_streams_for_n():
    W = 1000
    logits = torch.zeros(3, W)  # uniform: streams that agreed would be a generator reuse
    p = SamplingParams(seed=8, n=3)
    res = Sampler(W, CPU).sample(logits, [state(p, seed_offset=i) for i in range(3)])
    assert len(set(res.token_ids)) == 3
    res2 = Sampler(W, CPU).sample(logits[:1], [state(p, seed_offset=1)])
    assert res2.token_ids[0] == res.token_ids[1]


def test_unseeded_rows_follow_the_sampler_seed():
    W = 1000
    logits = torch.zeros(4, W)
    a = Sampler(W, CPU, seed=3).sample(logits, [state(SamplingParams()) for _ in range(4)]).token_ids
    b = Sampler(W, CPU, seed=3).sample(logits, [state(SamplingParams()) for _ in range(4)]).token_ids
    c = Sampler(W, CPU, seed=4).sample(logits, [state(SamplingParams()) for _ in range(4)]).token_ids
    assert a == b and a != c


# ----- logprobs, finite flags -----------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(7)
    W = 200
    logits = torch.randn(4, W, generator=g) * 2
    params = [SamplingParams(logprobs=5, temperature=0.5, top_k=3, presence_penalty=1.0),
              SamplingParams(logprobs=0), SamplingParams(), SamplingParams(temperature=0, logprobs=20)]
    states = [state(p, out=[1, 2]) for p in params]
    res = Sampler(W, CPU, seed=1).sample(logits, states)
    ref = torch.log_softmax(logits, -1)
    assert res.logprobs[2] is None
    for i, k in ((0, 5), (1, 0), (3, 20)):
        d, tok = res.logprobs[i], res.token_ids[i]
        top = ref[i].topk(k).indices.tolist() if k else []
        assert set(d) == set(top) | {tok}
        for t, v in d.items():
            assert v == ref[i, t].item(), (i, t)
    assert res.token_ids[3] == int(logits[3].argmax())


def test_logprobs_with_a_vocabulary_smaller_than_asked():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    res = Sampler(3, CPU).sample(logits, [state(SamplingParams(logprobs=20, temperature=0))])
    assert res.logprobs[0].keys() == {0, 1, 2}


def test_finite_flags():
    W = 16
    logits = torch.randn(4, W, generator=torch.Generator().manual_seed(9))
    clean = logits.clone()
    logits[1, 3] = math.nan
    logits[2, 0] = math.inf
    for params in (SamplingParams(temperature=0), SamplingParams(top_p=0.9, repetition_penalty=1.2, seed=3),
                   SamplingParams(logprobs=2, top_k=4)):
        sampler = Sampler(W, CPU)
        res = sampler.sample(logits, [state(params) for _ in range(4)])
        assert res.finite == [True, False, False, True]
        assert res.token_ids[1] == res.token_ids[2] == -1  # never a token the model could be fed
        if params.logprobs is not None:
            assert res.logprobs[1] == res.logprobs[2] == {} and len(res.logprobs[0]) >= 2
        ref = Sampler(W, CPU).sample(clean[[0, 3]], [state(params) for _ in range(2)])
        if params.greedy or params.seed is not None:  # other rows are unaffected by the bad ones
            assert [res.token_ids[0], res.token_ids[3]] == ref.token_ids


# ----- host traffic ---------------------------------------------------------------------------------

_HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts the tensor methods that read a tensor's values on the host (each one a device-to-host
    copy when the tensor lives on a GPU), and `.to(cpu)`."""
    calls: list[str] = []
    for name in _HOST_READS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, __orig=orig, __name=name, **k):
            calls.append(__name)
            return __orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    orig_to = torch.Tensor.to

    def to(self, *a, **k):
        target = a[0] if a else k.get("device")
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            calls.append("to(cpu)")
        return orig_to(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


@pytest.mark.parametrize("mix", ["greedy", "sampled", "everything"])
def test_one_host_read_per_step(host_reads, mix):
    W = 500
    logits = torch.randn(8, W, generator=torch.Generator().manual_seed(10))
    if mix == "greedy":
        params = [SamplingParams(temperature=0)] * 8
    elif mix == "sampled":
        params = [SamplingParams(temperature=0.8)] * 8
    else:
        params = [SamplingParams(temperature=0), SamplingParams(top_k=5, logprobs=3, seed=1),
                  SamplingParams(top_p=0.5, min_p=0.1), SamplingParams(repetition_penalty=1.3, min_tokens=4),
                  SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, temperature=0),
                  SamplingParams(logprobs=0, seed=2, allowed_token_ids=[5, 6, 7]),
                  SamplingParams(top_k=1, logit_bias={9: 2.0}),
                  SamplingParams(min_tokens=2)]
    states = [state(p, out=[3, 4]) for p in params]
    sampler = Sampler(W, CPU)
    for step in range(3):
        host_reads.clear()
        res = sampler.sample(logits, states)
        assert host_reads == ["tolist"], host_reads
        for s, t in zip(states, res.token_ids):
            s.append(t)


# ----- argument checks ------------------------------------------------------------------------------


def test_bad_arguments():
    sampler = Sampler(10, CPU)
    s = state(SamplingParams())
    with pytest.raises(ValueError, match="float32"):
        sampler.sample(torch.zeros(1, 10, dtype=torch.float16), [s])
    with pytest.raises(ValueError, match=r"\[B, 10\]"):
        sampler.sample(torch.zeros(1, 11), [s])
    with pytest.raises(ValueError, match="logits on meta; this sampler works on cpu"):
        sampler.sample(torch.zeros(1, 10, device="meta"), [s])
    with pytest.raises(ValueError, match="2 logits rows for 1 states"):
        sampler.sample(torch.zeros(2, 10), [s])
    assert sampler.sample(torch.zeros(0, 10), []).token_ids == []
    bad = state(SamplingParams(presence_penalty=1.0), prompt=[10])
    with pytest.raises(RequestError, match=r"prompt token ids must lie in \[0, 10\)"):
        sampler.sample(torch.zeros(1, 10), [bad])
    with pytest.raises(RequestError, match=r"logit_bias token ids must lie in \[0, 10\)"):
        sampler.sample(torch.zeros(1, 10), [state(SamplingParams(logit_bias={12: 1.0}))])
    with pytest.raises(RequestError, match=r"allowed_token_ids token ids must lie in \[0, 10\)"):
        sampler.sample(torch.zeros(1, 10), [state(SamplingParams(allowed_token_ids=[3, 10]))])


# ----- GPU ------------------------------------------------------------------------------------------


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_gpu_one_sync_and_seed_determinism():
    """On the GPU (python -m pytest tests/test_sampler.py -m gpu): a steady-state step syncs once
    (torch's sync debug mode counts it), and a seeded request's tokens are the same alone and at
    another row of a batch with every other kind of row."""
    dev = torch.device("cuda")
    W, B, row = 128_256, 32, 5
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(B, W, device=dev, generator=g) * 3
    kinds = [lambda i: SamplingParams(temperature=0), lambda i: SamplingParams(top_k=50, logprobs=5),
             lambda i: SamplingParams(repetition_penalty=1.2, min_p=0.05, min_tokens=3),
             lambda i: SamplingParams(seed=i), lambda i: SamplingParams(presence_penalty=0.3, frequency_penalty=0.3,
                                                                          top_p=0.7, top_k=100, logprobs=0),
             lambda i: SamplingParams(temperature=0, logit_bias={i: 100.0, i + 1: -5.0}),
             lambda i: SamplingParams(top_k=20, allowed_token_ids=[i, 2 * i])]
    params = [kinds[i % len(kinds)](i) for i in range(B)]
    params[row] = SamplingParams(seed=5, top_p=0.9, temperature=0.8)
    states = [SamplingState.create(p, [1, 2, 3], [2], dev) for p in params]
    alone = SamplingState.create(params[row], [1, 2, 3], [2], dev)
    sampler, solo = Sampler(W, dev), Sampler(W, dev, seed=9)
    for _ in range(4):
        res = sampler.sample(logits, states)
        one = solo.sample(logits[row:row + 1].clone(), [alone])
        assert res.token_ids[row] == one.token_ids[0]
        assert res.token_ids[0] == int(logits[0].argmax())
        assert res.token_ids[5 + 7] == 12  # kinds[5]'s +100 bias (row 5 is the seeded row)
        assert res.token_ids[6] in (6, 12) and res.token_ids[6 + 7] in (13, 26)  # kinds[6]'s allowed ids
        for s, t in zip(states, res.token_ids):
            s.append(t)
        alone.append(one.token_ids[0])
    torch.cuda.synchronize()
    for _ in range(2):  # the pinned buffer and penalty table exist: a steady-state step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                res = sampler.sample(logits, states)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # (the first use of the debug mode in a process also warns that it is a prototype: not a sync)
        syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
        assert len(syncs) == 1, syncs
        for s, t in zip(states, res.token_ids):
            s.append(t)


@pytest.mark.gpu
@needs_cuda
def test_gpu_distribution():
    dev = torch.device("cuda")
    p = SamplingParams(temperature=0.9, top_k=6, top_p=0.85, min_p=0.05)
    logits = BASE.to(dev).expand(N, -1).contiguous()
    res = Sampler(V, dev, seed=21).sample(logits, [SamplingState.create(p, [1], [EOS], dev) for _ in range(N)])
    freq = torch.bincount(torch.tensor(res.token_ids), minlength=V).double() / N
    assert_matches(freq, ref_probs(BASE, 0.9, top_k=6, top_p=0.85, min_p=0.05))


# ----- the greedy fast path -------------------------------------------------------------------------


def test_finite_rows_and_greedy_ids_match_isfinite_and_argmax():
    from pieceworks.executor.cuda_graph import finite_rows, greedy_token_ids

    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(11))
    logits[1, 3] = math.nan
    logits[2, 0] = math.inf
    logits[3, 39] = -math.inf
    logits[4] = math.nan
    logits[5, 2] = logits[5, 30] = logits[5].max() + 1  # a tie: the first index
    finite = torch.isfinite(logits).all(-1)
    assert torch.equal(finite_rows(logits), finite)
    assert greedy_token_ids(logits).tolist() == torch.where(finite, logits.argmax(-1), -1).tolist()
    assert greedy_token_ids(logits)[5] == 2


def test_given_greedy_ids_are_what_the_fast_path_returns():
    """An all-greedy batch given its greedy ids (a decode graph's) returns them, the same result as
    without them; a batch that is not all plain greedy ignores them."""
    from pieceworks.executor.cuda_graph import greedy_token_ids

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(12))
    logits[2, 7] = math.inf
    plain = [state(SamplingParams(temperature=0)) for _ in range(5)]
    sampler = Sampler(64, CPU)
    without = sampler.sample(logits, plain)
    given = sampler.sample(logits, plain, greedy_token_ids(logits))
    assert given == without and given.finite == [True, True, False, True, True]
    mixed = plain[:4] + [state(SamplingParams(temperature=0, logprobs=2))]
    wrong = torch.zeros(5, dtype=torch.int64)  # not the argmax: must not be used for this batch
    res = sampler.sample(logits, mixed, wrong)
    assert res.token_ids == without.token_ids and res.logprobs[4] is not None
    with pytest.raises(ValueError, match="greedy_ids"):
        sampler.sample(logits, plain, greedy_token_ids(logits)[:3])


def test_sample_ids_leaves_the_ids_of_sample_on_the_device():
    """`sample_ids` (async steps) gives `sample`'s tokens, -1 for non-finite rows, without the host copy;
    rows whose token needs earlier tokens or returns logprobs are refused by name."""
    W = 64
    logits = torch.randn(4, W, generator=torch.Generator().manual_seed(3))
    logits[2, 5] = float("nan")
    params = [SamplingParams(seed=11, temperature=0.9, top_k=20), SamplingParams(temperature=0, logit_bias={7: 3.0}),
              SamplingParams(seed=12, top_p=0.8, min_p=0.02), SamplingParams(seed=13, logit_bias={1: -2.0})]
    want = Sampler(W, CPU).sample(logits, [state(p) for p in params]).token_ids
    got = Sampler(W, CPU).sample_ids(logits, [state(p) for p in params])
    assert got.dtype == torch.int64 and got.tolist() == want and want[2] == -1
    plain = [state(SamplingParams(temperature=0)) for _ in range(4)]
    greedy = torch.tensor([3, 1, 4, 1])  # an all-greedy batch returns the ids it was given, no kernel
    assert Sampler(W, CPU).sample_ids(logits, plain, greedy) is greedy
    asked = [SamplingParams(seed=11, temperature=0.9, logprobs=3), SamplingParams(temperature=0),
             SamplingParams(temperature=0, logprobs=0), SamplingParams(seed=13, logprobs=1)]
    want = Sampler(W, CPU).sample(logits, [state(p) for p in asked])
    ids = Sampler(W, CPU).sample_ids(logits, [state(p) for p in asked])
    got = read_logprobs(logprob_table(logits, ids, asked).tolist(), asked)
    assert got == want and want.logprobs[1] is None and want.logprobs[2] == {} and len(want.logprobs[0]) >= 3


def test_sample_ids_counts_tokens_in_flight():
    """A token drawn by `sample_ids` counts before `append` records it: for min_tokens, and in the
    penalty counts on the device (not again once appended): steps alternating sample_ids and sample
    give the tokens of sample() alone."""
    W = 16
    table = torch.randn(6, W, generator=torch.Generator().manual_seed(8))
    params = [SamplingParams(temperature=0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4),
              SamplingParams(temperature=0, min_tokens=4), SamplingParams(seed=5, frequency_penalty=2.0)]

    def tokens(use_ids: list[bool]) -> list[list[int]]:
        """Steps by sample_ids append their tokens one step late, as async steps do (the next step is
        sampled first); a step by sample() first appends what is in flight, as the engine's drain."""
        sampler, states = Sampler(W, CPU), [state(p, eos=(3,)) for p in params]
        out, pending = [], None

        def append(ids):
            for s, t in zip(states, ids):
                s.append(t)

        for step, fast in enumerate(use_ids):
            if not fast and pending is not None:
                append(pending)
                pending = None
            logits = table[(torch.arange(3) + step) % 6].clone()
            logits[1, 3] += 5.0  # EOS would win row 1 at once
            if fast:
                ids = sampler.sample_ids(logits, states).tolist()
                if pending is not None:
                    append(pending)
                pending = ids
            else:
                ids = sampler.sample(logits, states).token_ids
                append(ids)
            assert all(s.in_flight == int(fast) for s in states)
            out.append(ids)
        return out

    want = tokens([False] * 8)
    assert tokens([True] * 8) == want == tokens([True, False, True, True, False, False, True, True])
    assert [row[1] for row in want[:4]] != [3] * 4 and want[4][1] == 3  # min_tokens held EOS back
