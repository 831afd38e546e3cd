"""SamplingParams: vLLM's defaults, and every field's validation (good values kept, bad ones refused
with a RequestError naming the field and the value)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from pieceworks.engine.params import SamplingParams
from pieceworks.errors import RequestError


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (16, 1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens) == (None, None, False, 0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logprobs, p.n, p.logit_bias) == (None, 1, None)
    assert not p.greedy and not p.uses_penalties


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0


GOOD = {
    "max_tokens": [None, 1, 4096, np.int64(7), torch.tensor(3)],
    "temperature": [0, 0.0, 1e-6, 0.7, 2, 100.0, np.float32(0.5), torch.tensor(0.25)],
    "top_p": [1.0, 0.5, 1e-9, 1, np.float64(0.9)],
    "top_k": [-1, 0, 1, 50, np.int32(5)],
    "min_p": [0.0, 0.05, 1.0, 0, 1],
    "seed": [None, 0, -1, 2**64 - 1, -(2**63), np.int64(42)],
    "ignore_eos": [False, True, np.bool_(True)],
    "include_stop_str_in_output": [False, True],
    "skip_special_tokens": [True, False, np.bool_(False)],
    "min_tokens": [0, 3, 16],
    "presence_penalty": [-2.0, 0.0, 1.5, 2, -2],
    "frequency_penalty": [-2, -0.5, 0.0, 2.0],
    "repetition_penalty": [1e-3, 1.0, 1.3, 10],
    "logprobs": [None, 0, 1, 20, np.int16(5)],
    "prompt_logprobs": [None, 0, 3, 20],
    "n": [1, 2, 64, 65536],
}

BAD = {
    "max_tokens": [0, -1, 1.0, True, "16", torch.tensor([1, 2])],
    "temperature": [-0.1, -1e-9, math.inf, math.nan, True, "1", None, torch.tensor([1.0]), 1e39],
    "top_p": [0, 0.0, -0.5, 1.01, math.nan, False, None, 1e-50],
    "top_k": [-2, -100, 1.0, 2.5, True, None],
    "min_p": [-0.01, 1.01, math.inf, True, None, 1e-40],
    "seed": [1.0, "7", True, 2**64, -(2**63) - 1],
    "ignore_eos": [1, 0, "yes", None],
    "include_stop_str_in_output": [1, "no", None],
    "skip_special_tokens": [0, "yes"],
    "min_tokens": [-1, 17, 1.0, True],
    "presence_penalty": [2.01, -2.5, math.nan, True, -1e-45],
    "frequency_penalty": [3, -2.0001, math.inf, None],
    "repetition_penalty": [0, 0.0, -1.0, math.inf, True, 1e-50, 1e39],
    "logprobs": [-1, 21, 1.5, True],
    "prompt_logprobs": [-1, 21, 2.0, True, "3"],
    "n": [0, -3, 1.0, True, None, 65537, 10**9],
}


@pytest.mark.parametrize("field", sorted(GOOD))
def test_good_values_are_kept_as_plain_python(field):
    for value in GOOD[field]:
        p = SamplingParams(**{field: value})
        got = getattr(p, field)
        want = value.item() if hasattr(value, "item") else value
        assert got == want, (field, value, got)
        assert type(got) in (type(None), int, float, bool), (field, value, type(got))


@pytest.mark.parametrize("field", sorted(BAD))
def test_bad_values_name_field_and_value(field):
    for value in BAD[field]:
        with pytest.raises(RequestError) as err:
            SamplingParams(**{field: value})
        msg = str(err.value)
        assert f"SamplingParams.{field}" in msg, msg
        shown = value.item() if isinstance(value, torch.Tensor) and value.ndim == 0 else value
        assert repr(shown) in msg or isinstance(value, torch.Tensor), msg


def test_values_float32_cannot_hold_are_refused_for_that_reason():
    """The sampler runs in float32: temperature 1e39 (inf there) or repetition_penalty 1e-50 (0 there) would
    sample token 0 every step; a temperature below float32's range is greedy, and stays allowed."""
    for kw in ({"temperature": 1e39}, {"repetition_penalty": 1e-50}, {"top_p": 1e-40}):
        with pytest.raises(RequestError, match="float32"):
            SamplingParams(**kw)
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(repetition_penalty=1e-30).uses_penalties


def test_bool_is_not_an_int_anywhere():
    for field in ("max_tokens", "top_k", "min_tokens", "logprobs", "n", "seed", "temperature", "top_p"):
        with pytest.raises(RequestError, match=field):
            SamplingParams(**{field: True})


def test_min_tokens_bounded_by_max_tokens():
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000
    with pytest.raises(RequestError, match=r"min_tokens=6 .*max_tokens \(5\)"):
        SamplingParams(max_tokens=5, min_tokens=6)


def test_stop_strings():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=[]).stop == []
    for bad in ([""], ["ok", ""], [1], "".join([]), 5, {"a"}):
        with pytest.raises(RequestError, match="SamplingParams.stop"):
            SamplingParams(stop=bad)


def test_stop_token_ids():
    assert SamplingParams(stop_token_ids=[0, 2, 7]).stop_token_ids == [0, 2, 7]
    assert SamplingParams(stop_token_ids=(3,)).stop_token_ids == [3]
    got = SamplingParams(stop_token_ids=np.array([4, 5])).stop_token_ids
    assert got == [4, 5] and all(type(i) is int for i in got)
    assert SamplingParams(stop_token_ids=torch.tensor([9])).stop_token_ids == [9]
    for bad in ([-1], [1.0], [True], "12", 3, [None]):
        with pytest.raises(RequestError, match="SamplingParams.stop_token_ids"):
            SamplingParams(stop_token_ids=bad)


def test_logit_bias():
    got = SamplingParams(logit_bias={5: -100, np.int64(7): 2.5, 0: torch.tensor(1.0)}).logit_bias
    assert got == {5: -100.0, 7: 2.5, 0: 1.0}
    assert all(type(k) is int and type(v) is float for k, v in got.items())
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ([(1, 2.0)], "{1: 2}", {-1: 1.0}, {1.0: 1.0}, {"3": 1.0}, {True: 1.0}, {2: math.inf},
                {2: math.nan}, {2: "1"}, {2: None}, {2: 1e39}):
        with pytest.raises(RequestError, match="SamplingParams.logit_bias"):
            SamplingParams(logit_bias=bad)


def test_allowed_token_ids():
    assert SamplingParams(allowed_token_ids=[3, 0, 9]).allowed_token_ids == [3, 0, 9]
    got = SamplingParams(allowed_token_ids=np.array([4, 5])).allowed_token_ids
    assert got == [4, 5] and all(type(i) is int for i in got)
    assert SamplingParams().allowed_token_ids is None
    for bad in ([], [-1], [1.0], [True], "12", 3, [None]):
        with pytest.raises(RequestError, match="SamplingParams.allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below vLLM's 1e-5: argmax, not an overflowing divide
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(top_k=2).greedy
    assert SamplingParams(presence_penalty=0.1).uses_penalties
    assert SamplingParams(frequency_penalty=-0.1).uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert not SamplingParams(repetition_penalty=1.0).uses_penalties
