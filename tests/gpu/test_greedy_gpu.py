"""`cuda_graph.greedy_token_ids` on CUDA float32 logits (the Triton kernels of `executor/greedy_kernel.py`)
against torch's argmax / isfinite, eager and inside a CUDA graph, at the batch sizes and vocabularies of
the decode graphs."""

from __future__ import annotations

import math

import pytest
import torch

from pieceworks.executor.cuda_graph import greedy_kernel_supported, greedy_token_ids

pytestmark = pytest.mark.gpu


def reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(logits).all(-1), logits.argmax(-1), -1)


def logits_with_traps(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, vocab, device="cuda", generator=gen)
    top = x.max() + 1
    x[0, vocab - 1] = x[0, vocab // 3] = top  # a tie across chunks: the first index
    if rows > 1:
        x[1] = torch.randint(-2, 2, (vocab,), device="cuda", generator=gen).float()  # ties everywhere
    if rows > 2:
        x[2, 5] = math.nan
    if rows > 3:
        x[3, vocab - 1] = -math.inf
    if rows > 4:
        x[4, 0] = math.inf
    return x


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 64, 256])
@pytest.mark.parametrize("vocab", [1000, 32000, 128256, 129280])
def test_greedy_ids_equal_torch(rows, vocab):
    pytest.importorskip("triton", reason="triton is not importable here")
    x = logits_with_traps(rows, vocab, rows * 7 + vocab)
    assert greedy_kernel_supported(x)
    assert torch.equal(greedy_token_ids(x), reference(x))


def test_greedy_ids_in_a_cuda_graph():
    """Captured after one eager call (as the decode graphs' warm-up): replays follow new logits."""
    pytest.importorskip("triton", reason="triton is not importable here")
    x = logits_with_traps(8, 128256, 1)
    greedy_token_ids(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = greedy_token_ids(x)
    for seed in (2, 3):
        x.copy_(logits_with_traps(8, 128256, seed))
        graph.replay()
        assert torch.equal(ids, reference(x))
