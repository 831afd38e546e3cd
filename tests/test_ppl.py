"""The perplexity protocol: which tokens each window feeds and scores."""

from __future__ import annotations

import math

import pytest
import torch

from pieceworks.models.ppl import Window, perplexity, perplexity_from_logits, plan_windows, windows


def test_perplexity_is_exp_mean_nll():
    assert perplexity(0.0, 5) == 1.0
    assert perplexity(10 * math.log(4), 10) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="at least one scored token"):
        perplexity(1.0, 0)


def test_non_overlapping_windows_skip_first_token_of_each():
    assert plan_windows(1000, 512, 512) == [Window(0, 512, 1), Window(512, 1000, 513)]
    assert sum(w.num_scored for w in plan_windows(1000)) == 1000 - 2


def test_single_token_tail_window_is_dropped():
    assert plan_windows(513, 512, 512) == [Window(0, 512, 1)]
    assert plan_windows(514, 512, 512)[-1] == Window(512, 514, 513)
    assert plan_windows(1) == [] and plan_windows(2) == [Window(0, 2, 1)]


@pytest.mark.parametrize("stride", [1, 100, 256, 511])
def test_overlapping_windows_score_every_token_but_the_first_once(stride):
    ws = plan_windows(1000, 512, stride)
    scored = [j for w in ws for j in range(w.first_scored, w.end)]
    assert scored == list(range(1, 1000))
    assert all(w.end - w.start <= 512 and w.first_scored > w.start for w in ws)


def test_bad_window_or_stride():
    with pytest.raises(ValueError, match="window"):
        plan_windows(10, 1, 1)
    with pytest.raises(ValueError, match="stride"):
        plan_windows(10, 4, 5)


def test_chunks_and_logits_follow_the_plan():
    ids = list(range(1030))
    chunks = windows(ids, 512)
    assert [len(c) for c in chunks] == [512, 512, 6] and chunks[1][0] == 512
    vocab = 1100
    # Logits that put all mass on the true next token score ppl 1; uniform logits score ppl vocab.
    sure = [
        torch.full((len(c), vocab), -1e4).index_put_((torch.arange(len(c) - 1), torch.tensor(c[1:])), torch.tensor(0.0))
        for c in chunks
    ]
    assert perplexity_from_logits(sure, chunks) == (pytest.approx(1.0), 1030 - 3)
    flat = [torch.zeros(len(c), vocab) for c in chunks]
    assert perplexity_from_logits(flat, chunks)[0] == pytest.approx(vocab)
    with pytest.raises(ValueError, match="rows"):
        perplexity_from_logits([flat[0][:-1]] + flat[1:], chunks)
