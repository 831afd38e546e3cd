"""`pieceworks.testing.checks.decisive_argmax_flips` (the GPU graph tests' greedy check) on hand-made logits."""

from __future__ import annotations

import torch

from pieceworks.testing.checks import decisive_argmax_flips


def test_flips_at_near_ties_pass_and_decisive_flips_are_named():
    step = 2.0**-5  # bf16's spacing at logits in [4, 8)
    ref = torch.tensor([[5.0, 5.0, 1.0],               # a tie
                        [5.0, 5.0 - step, 1.0],        # one step apart
                        [5.0, 5.0 - 4 * step, 1.0],    # four steps: still a near tie at ulps=4
                        [5.0, 5.0 - 5 * step, 1.0],    # five steps: decisive
                        [1.0, 5.0, 2.0]])              # decisive, and not flipped
    got = torch.tensor([[4.9, 5.1, 1.0]] * 4 + [[1.0, 5.0, 2.0]])  # argmax 1 everywhere
    assert decisive_argmax_flips(got, ref) == [(3, 5 * step)]
    assert decisive_argmax_flips(got, ref, ulps=5) == []
    assert decisive_argmax_flips(got, ref, ulps=0) == [(1, step), (2, 4 * step), (3, 5 * step)]
    assert decisive_argmax_flips(ref, ref, ulps=0) == []
    # the spacing follows the magnitude: at logits in [0.5, 1) a step is 2 ** -8
    small = torch.tensor([[0.75, 0.75 - 5 * 2.0**-8]])
    assert decisive_argmax_flips(torch.tensor([[0.0, 1.0]]), small) == [(0, 5 * 2.0**-8)]
    assert decisive_argmax_flips(torch.tensor([[0.0, 1.0]]), small.to(torch.bfloat16)) == [(0, 5 * 2.0**-8)]
