"""The request boundary's catalog of bad input, at the Executor level: `forward` batches and the
arguments of `generate` / `score`. Every case is refused with a typed error (RequestError, or its
subclass BatchError) naming the argument and the bad value before any state changes: no page is held
afterwards and the executor gives exactly a fresh executor's output. Legitimate inputs (numpy and torch
integer ids, stop_token_ids=None) give the right result. A step with non-finite logits fails with
NonFiniteLogits naming the prompt. A soak mixes refused and accepted requests on a small pool."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch
from pieceworks.errors import BatchError, NonFiniteLogits, RequestError

PROMPT = [5, 17, 3, 99, 42, 7]


def make(arch: str = "llama") -> Executor:
    cfg = {"model": {"arch": arch, "preset": "tiny", "max_context": 40},
           "runtime": {"device": "cpu", "dtype": "float32"}, "kv_cache": {"num_tokens": 64, "page_size": 4}}
    return Executor.from_config(cfg, progress=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls gain nothing from threads; on a loaded CI machine two threads made each
    step ~20x slower (2.8 s vs 0.15 s for a 4-token generate, measured on the 2-core dev machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ex(one_thread):
    e = make()
    e.fresh = e.generate([PROMPT, PROMPT[:3]], 4)  # the output of a fresh executor
    return e


def intact(ex: Executor) -> None:
    assert not ex._live, "a refused request left a live sequence"
    assert ex.kv.allocator.num_free == ex.kv.allocator.capacity, "a refused request holds pages"


# --- forward -------------------------------------------------------------------------------------

BAD_TOKENS = [
    (None, "token ids must be a list of ints or a 1-D integer tensor, got NoneType None"),
    ("abc", "token ids must be a list of ints or a 1-D integer tensor, got str 'abc'"),
    (5, "got int 5"),
    ([1.0, 2.0], "token ids must be ints, got float 1.0"),
    ([1, True], "token ids must be ints, got bool True"),
    ([1, None], "token ids must be ints, got NoneType None"),
    ([np.float32(3)], "token ids must be ints, got float32"),
    ([torch.tensor(3)], "token ids must be ints, got Tensor"),
    (np.array([1.5]), "must be a 1-D integer tensor or list, got ndarray of float64"),
    (np.array([[1, 2]]), "got ndarray of int64 with shape [1, 2]"),
    (torch.tensor([1.0, 2.0]), "got Tensor of torch.float32"),
    (torch.tensor([True]), "got Tensor of torch.bool"),
    (torch.tensor([[1, 2]]), "with shape [1, 2]"),
    ([1, 2, 512], "token id(s) [512] outside the vocabulary [0, 512)"),
    (np.array([-1]), "token id(s) [-1] outside the vocabulary"),
    ([], "no new tokens"),
    (list(range(41)), "exceed the context limit of 40"),
]


@pytest.mark.parametrize("toks, needle", BAD_TOKENS, ids=[repr(t)[:30] for t, _ in BAD_TOKENS])
def test_forward_refuses_bad_token_ids(ex, toks, needle):
    seq = ex.new_sequence()
    try:
        with pytest.raises(BatchError) as e:
            ex.forward(ForwardBatch([seq], [toks]))
        assert needle in str(e.value) and f"sequence {seq.id}" in str(e.value), str(e.value)
        assert seq.kv_len == 0 and seq.pages == []
    finally:
        ex.free(seq)
    intact(ex)


def test_forward_refuses_malformed_batches(ex):
    seq = ex.new_sequence()
    cases = [
        (ForwardBatch(seq, [[1]]), "ForwardBatch.seqs must be a list, got Sequence"),
        (ForwardBatch([seq], None), "ForwardBatch.tokens must be a list, got NoneType"),
        (ForwardBatch([3], [[1]]), "ForwardBatch.seqs holds int 3"),
        (ForwardBatch([None], [[1]]), "ForwardBatch.seqs holds NoneType None"),
        (ForwardBatch([seq], [[1]], return_all_logits="yes"), "return_all_logits must be True, False or one bool"),
        (ForwardBatch([seq], [[1]], return_all_logits=[True, False]), "one bool per sequence, got \\[True, False\\]"),
        (ForwardBatch([seq, seq], [[1], [2]]), "appears twice"),
        ([seq], "forward takes a ForwardBatch, got list"),
    ]
    for batch, needle in cases:
        with pytest.raises(BatchError, match=needle):
            ex.forward(batch)
        assert seq.kv_len == 0 and seq.pages == []
    for handle in (None, 3):
        with pytest.raises(BatchError, match="free.. takes a Sequence handle"):
            ex.free(handle)
    ex.free(seq)
    intact(ex)


@pytest.mark.parametrize("as_ids", [
    lambda p: p, tuple, np.array, lambda p: np.array(p, dtype=np.int32), lambda p: np.array(p, dtype=np.uint16),
    torch.tensor, lambda p: torch.tensor(p, dtype=torch.int32), lambda p: [np.int64(t) for t in p],
], ids=["list", "tuple", "numpy", "numpy int32", "numpy uint16", "torch", "torch int32", "numpy scalars"])
def test_integer_ids_of_numpy_and_torch_are_accepted(ex, as_ids):
    seq, ref = ex.new_sequence(), ex.new_sequence()
    try:
        got = ex.forward(ForwardBatch([seq], [as_ids(PROMPT)]))
        want = ex.forward(ForwardBatch([ref], [PROMPT]))
        assert torch.equal(got, want) and seq.tokens == PROMPT and all(type(t) is int for t in seq.tokens)
    finally:
        ex.free(seq)
        ex.free(ref)
    assert ex.generate([as_ids(PROMPT), as_ids(PROMPT[:3])], 4) == ex.fresh


def test_an_interrupt_while_reserving_pages_gives_them_back(ex, monkeypatch):
    a, b = ex.new_sequence(), ex.new_sequence()
    alloc, calls = ex.kv.allocator.alloc, []

    def interrupted_on_the_second_call(n):
        calls.append(n)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return alloc(n)

    monkeypatch.setattr(ex.kv.allocator, "alloc", interrupted_on_the_second_call)
    with pytest.raises(KeyboardInterrupt):
        ex.forward(ForwardBatch([a, b], [PROMPT, PROMPT]))
    assert len(calls) == 2 and a.pages == [] and b.pages == [] and a.kv_len == b.kv_len == 0
    monkeypatch.undo()

    def interrupted_in_the_model(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(ex.model, "compute_logits", interrupted_in_the_model)
    with pytest.raises(KeyboardInterrupt):
        ex.forward(ForwardBatch([a, b], [PROMPT, PROMPT]))
    assert a.pages == [] and b.pages == []
    monkeypatch.undo()
    ex.free(a)
    ex.free(b)
    intact(ex)
    assert ex.generate([PROMPT, PROMPT[:3]], 4) == ex.fresh


# --- generate and score arguments ----------------------------------------------------------------

P = [PROMPT]
BAD_GENERATE = [
    (dict(prompts=None), RequestError, "prompts: expected a list of prompts (each a list of token ids), got NoneType"),
    (dict(prompts="hello"), RequestError, "prompts: expected a list of prompts"),
    (dict(prompts=PROMPT), RequestError, "got one flat list of ints; pass a list of prompts"),
    (dict(prompts=[[1.5, 2]]), BatchError, "prompt 0: token ids must be ints, got float 1.5"),
    (dict(prompts=[[]]), BatchError, "prompt 0 is empty"),
    (dict(prompts=[PROMPT, None]), BatchError, "prompt 1: token ids must be a list of ints"),
    (dict(prompts=[[1, 999]]), BatchError, "prompt 0: token id(s) [999] outside the vocabulary [0, 512)"),
    (dict(prompts=[list(range(1, 39))]), BatchError, "exceed the context limit of 40"),
    (dict(max_new_tokens=None), RequestError, "max_new_tokens: None must be an integer >= 1"),
    (dict(max_new_tokens="4"), RequestError, "max_new_tokens: '4' must be an integer >= 1"),
    (dict(max_new_tokens=2.5), RequestError, "max_new_tokens: 2.5 must be an integer >= 1"),
    (dict(max_new_tokens=0), RequestError, "max_new_tokens: 0 must be an integer >= 1"),
    (dict(max_new_tokens=True), RequestError, "max_new_tokens: True must be an integer >= 1"),
    (dict(temperature=float("nan")), RequestError, "temperature: nan must be a finite number"),
    (dict(temperature=float("inf")), RequestError, "temperature: inf must be a finite number"),
    (dict(temperature=-1), RequestError, "temperature: -1 must be >= 0 (0 = greedy)"),
    (dict(temperature="0.5"), RequestError, "temperature: '0.5' must be a finite number"),
    (dict(temperature=1.0, top_p=0), RequestError, "top_p: 0 must be in (0, 1]"),
    (dict(temperature=1.0, top_p=-1), RequestError, "top_p: -1 must be in (0, 1]"),
    (dict(temperature=1.0, top_p=5), RequestError, "top_p: 5 must be in (0, 1]"),
    (dict(top_p=float("nan")), RequestError, "top_p: nan must be a finite number"),
    (dict(seed="x"), RequestError, "seed: 'x' must be an integer in [-2**63, 2**64) or None"),
    (dict(seed=2**70), RequestError, "seed: 1180591620717411303424 must be an integer in [-2**63, 2**64) or None"),
    (dict(stop_token_ids="abc"), BatchError, "stop_token_ids: token ids must be a list of ints"),
    (dict(stop_token_ids=[1.5]), BatchError, "stop_token_ids: token ids must be ints, got float 1.5"),
    (dict(stop_token_ids=[99999]), RequestError, "stop_token_ids: [99999] outside the vocabulary"),
    (dict(max_step_tokens=-1), RequestError, "max_step_tokens: -1 must be an integer >= 1 or None"),
    (dict(max_step_tokens=0), RequestError, "max_step_tokens: 0 must be an integer >= 1 or None"),
    (dict(max_step_tokens=2.5), RequestError, "max_step_tokens: 2.5 must be an integer >= 1 or None"),
    (dict(stats="x"), RequestError, "stats: str must be a StepStats or None"),
]


@pytest.mark.parametrize("kw, error, needle", BAD_GENERATE, ids=[repr(k)[:40] for k, _, _ in BAD_GENERATE])
def test_generate_refuses_bad_arguments(ex, kw, error, needle):
    kw = {"prompts": P, "max_new_tokens": 4, **kw}
    with pytest.raises(error) as e:
        ex.generate(kw.pop("prompts"), kw.pop("max_new_tokens"), **kw)
    assert needle in str(e.value), str(e.value)
    intact(ex)


@pytest.mark.parametrize("kw, needle", [
    (dict(sequences=None), "sequences: expected a list of prompts"),
    (dict(sequences=[[]]), "prompt 0 is empty"),
    (dict(sequences=[[1.0]]), "token ids must be ints"),
    (dict(sequences=P, max_step_tokens=-1), "max_step_tokens: -1 must be an integer >= 1 or None"),
    (dict(sequences=[PROMPT, [1] * 41]), "sequence 1: 41 tokens exceed the context limit of 40 (the model's: "
                                         "model.max_context, else its max_position_embeddings)"),
])
def test_score_refuses_bad_arguments(ex, kw, needle):
    from pieceworks.executor.scheduler import score

    with pytest.raises(RequestError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        score(ex, **kw)
    intact(ex)


def test_legitimate_variants_give_the_right_result(ex):
    assert ex.generate([PROMPT, PROMPT[:3]], 4, stop_token_ids=None) == ex.fresh
    assert ex.generate([PROMPT, PROMPT[:3]], 4, max_step_tokens=1) == ex.fresh  # one token a step: bounded
    assert ex.generate([PROMPT, PROMPT[:3]], np.int64(4), stop_token_ids=np.array([], dtype=np.int64)) == ex.fresh
    first = ex.fresh[0][0]
    assert ex.generate([PROMPT], 4, stop_token_ids={first}) == [[first]]
    assert ex.generate([], 4) == []
    from pieceworks.executor.scheduler import score

    torch.testing.assert_close(score(ex, [np.array(PROMPT)])[0], score(ex, [PROMPT], max_step_tokens=2)[0])
    intact(ex)


# --- non-finite logits ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_fail_the_request_by_name(temperature):
    ex = make()
    fresh = ex.generate([PROMPT, [1, 2, 3]], 3, temperature=temperature, seed=1)
    with torch.no_grad():
        row = ex.model.embed_tokens.weight[300].clone()
        ex.model.embed_tokens.weight[300] = float("inf")  # only prompts holding token 300 see it
    with pytest.raises(NonFiniteLogits, match=r"prompt\(s\) \[1\]: the step's logits hold NaN or inf"):
        ex.generate([PROMPT, [1, 300, 3]], 3, temperature=temperature, seed=1)
    intact(ex)
    with torch.no_grad():
        ex.model.embed_tokens.weight[300] = row
    assert ex.generate([PROMPT, [1, 2, 3]], 3, temperature=temperature, seed=1) == fresh


# --- soak ----------------------------------------------------------------------------------------


def test_soak_refused_and_accepted_requests_on_a_small_pool(ex):
    """120 rounds of random refused and accepted requests (stopped after 20 s on a starved machine): after
    every refusal the executor gives exactly the fresh executor's output, and every page comes back."""
    rng = random.Random(0)
    bad = [kw for kw, _, _ in BAD_GENERATE] + [dict(max_new_tokens=35), dict(prompts=[PROMPT, list(range(1, 12))], max_new_tokens=30)]
    refused = accepted = 0
    deadline = time.monotonic() + 20.0
    for _ in range(120):
        if time.monotonic() > deadline:
            break
        if rng.random() < 0.6:
            kw = {"prompts": P, "max_new_tokens": 4, **rng.choice(bad)}
            seq = ex.new_sequence() if rng.random() < 0.3 else None  # a direct forward caller's refusal too
            with pytest.raises(RequestError):
                if seq is not None:
                    ex.forward(ForwardBatch([seq], [rng.choice([None, [1.5], [600], []])]))
                else:
                    ex.generate(kw.pop("prompts"), kw.pop("max_new_tokens"), **kw)
            if seq is not None:
                assert seq.pages == [] and seq.kv_len == 0
                ex.free(seq)
            intact(ex)
            assert ex.generate([PROMPT, PROMPT[:3]], 4) == ex.fresh
            refused += 1
        else:
            prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(1, 4))]
            out = ex.generate(prompts, rng.randint(1, 4), temperature=rng.choice([0.0, 0.7]), seed=rng.randrange(9))
            assert len(out) == len(prompts) and all(1 <= len(o) <= 4 for o in out)
            accepted += 1
        intact(ex)
    assert refused >= 5 and accepted >= 3, (refused, accepted)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_guard_on_cuda_with_graphs(temperature):
    """The guard under piecewise and full decode graphs, bf16 on the GPU: NonFiniteLogits naming the prompt
    whose logits are not finite, every page back, and then exactly the fresh executor's output."""
    ex = Executor.from_config({"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cuda"},
                               "kv_cache": {"num_tokens": 1024, "page_size": 16}}, progress=False)
    assert ex.decode_graphs is not None and ex.piecewise is not None
    prompts = [PROMPT, [1, 2, 3], list(range(20, 60))]
    fresh = ex.generate(prompts, 8, temperature=temperature, seed=3)
    with torch.no_grad():
        row = ex.model.embed_tokens.weight[300].clone()
        ex.model.embed_tokens.weight[300] = float("inf")
    with pytest.raises(NonFiniteLogits, match=r"prompt\(s\) \[2\]"):
        ex.generate([PROMPT, [1, 2, 3], [20, 300, 40]], 8, temperature=temperature, seed=3)
    intact(ex)
    with torch.no_grad():
        ex.model.embed_tokens.weight[300] = row
    assert ex.generate(prompts, 8, temperature=temperature, seed=3) == fresh


def test_a_context_limit_set_by_the_kv_pool_is_named_so():
    from pieceworks import Executor

    ex = Executor.from_config({"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu"},
                               "kv_cache": {"num_tokens": 32, "page_size": 4}}, progress=False)
    with pytest.raises(BatchError, match=r"^prompt 0: 30 tokens \+ max_new_tokens=5 exceed the context limit of 32 "
                                         r"\(the KV pool's 32 tokens: kv_cache.num_tokens\)$"):
        ex.generate([list(range(30))], 5)
    ex.close()
