"""The Engine when a step fails past its forward pass (sampling raised): the completions the step fed finish with
"error", the others go on with the tokens they would have had, and no page stays held."""

from __future__ import annotations

import pytest

from pieceworks import SamplingParams

try:
    from tests.test_engine import drained, make, PROMPTS
except ImportError:  # tests/ on sys.path
    from test_engine import drained, make, PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.mark.parametrize(("async_steps", "method"), [(False, "sample"), (True, "sample_ids")])
def test_a_step_whose_sampling_raises_fails_only_the_completions_it_fed(async_steps, method):
    reference = [o.token_ids for o in make().generate(PROMPTS, GREEDY)]
    eng = make(scheduler={"async_steps": async_steps, "max_num_batched_tokens": 32})
    real, calls = getattr(eng.sampler, method), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("transient")
        return real(*args, **kwargs)

    setattr(eng.sampler, method, flaky)
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    final, raised = {}, 0
    while eng.has_unfinished():
        try:
            outs = eng.step()
        except RuntimeError as exc:
            assert str(exc) == "transient"
            raised += 1
            continue
        final.update({o.request_id: o for o in outs if o.finished})
    assert raised == 1
    failed = [i for i, rid in enumerate(ids) if final[rid].finish_reason == "error"]
    assert failed, "the failed step's completions went on"
    for i, rid in enumerate(ids):
        out = final[rid]
        if i in failed:
            assert "the step failed after its forward pass: RuntimeError: transient" in out.error, out.error
            assert list(out.token_ids) == reference[i][: len(out.token_ids)]
        else:  # never another row's logits
            assert out.finish_reason == "length" and list(out.token_ids) == reference[i], i
    drained(eng)


@pytest.mark.parametrize("async_steps", [False, True])
def test_finished_and_aborted_completions_give_their_penalty_rows_back(async_steps):
    """Without a collection of the request's reference cycle (its group), only the engine's release frees them."""
    import gc

    eng = make(scheduler={"async_steps": async_steps})
    table = eng.sampler._table
    params = SamplingParams(temperature=0.8, max_tokens=4, presence_penalty=0.5, seed=1)
    gc.collect()
    gc.disable()
    try:
        for i in range(40):
            eng.generate([PROMPTS[i % len(PROMPTS)]], params)
        rid = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=50, repetition_penalty=1.2))
        eng.step()
        eng.step()
        eng.abort(rid)
        eng.step()
        held = table.counts.shape[0] - 1 - len(table.free)
    finally:
        gc.enable()
    assert held == 0 and table.counts.shape[0] <= 2, (held, table.counts.shape[0])
    drained(eng)


def test_a_bias_that_overflows_under_a_penalty_or_temperature_still_samples_its_token():
    """Each value is within float32, their product is not: the sampled token stays the biased one (not token 0
    of a NaN softmax)."""
    eng = make()
    p = list(range(10, 20))
    out = eng.generate([p], SamplingParams(max_tokens=4, logit_bias={7: 3.4e38}, repetition_penalty=0.5, seed=1))
    assert list(out[0].token_ids) == [7] * 4, out[0].token_ids
    out = eng.generate([p], SamplingParams(max_tokens=4, logit_bias={7: 3e38, 9: 3e38}, temperature=1e-5, seed=1))
    assert set(out[0].token_ids) <= {7, 9}, out[0].token_ids
    # past the negative limit: the allowed ids' -inf is held at -3.4e38, so the masked ids (token 0 among them)
    # stay out, sampled or greedy (a repetition penalty multiplies the prompt's negative logits)
    for extra in ({"temperature": 0.5}, {"temperature": 0, "repetition_penalty": 3e38}):
        out = eng.generate([p], SamplingParams(max_tokens=4, allowed_token_ids=[13, 14], seed=1,
                                               logit_bias={13: -3e38, 14: -3e38}, **extra))
        assert set(out[0].token_ids) <= {13, 14}, (extra, out[0].token_ids)
    drained(eng)


def test_a_drafting_step_whose_sampling_raises_fails_only_the_completions_it_fed():
    """The speculative step feeds a row's drafts too: its rows' KV runs past their tokens by the drafts."""
    prompts = [[23, 43] * 10, [5, 6, 7] * 6, PROMPTS[0]]
    spec = {"speculative": {"method": "ngram"}}
    reference = [o.token_ids for o in make(**spec).generate(prompts, GREEDY)]
    eng = make(**spec)
    real, real_step, inside, drafted = eng.sampler.sample, eng.speculator.step, [False], []

    def flaky(*args, **kwargs):
        if inside[0] and not drafted:  # in the first step that fed drafts
            drafted.append(True)
            raise RuntimeError("transient")
        return real(*args, **kwargs)

    def step(*args, **kwargs):
        inside[0] = True
        try:
            return real_step(*args, **kwargs)
        finally:
            inside[0] = False

    eng.sampler.sample, eng.speculator.step = flaky, step
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    final = {}
    while eng.has_unfinished():
        try:
            final.update({o.request_id: o for o in eng.step() if o.finished})
        except RuntimeError as exc:
            assert str(exc) == "transient"
    assert drafted, "no step fed drafts"
    failed = [i for i, rid in enumerate(ids) if final[rid].finish_reason == "error"]
    assert failed
    for i, rid in enumerate(ids):
        out = final[rid]
        assert list(out.token_ids) == (reference[i][: len(out.token_ids)] if i in failed else reference[i]), i
    drained(eng)
