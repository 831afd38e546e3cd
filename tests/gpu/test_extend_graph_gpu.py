"""Full graphs for extend and mixed steps on the GPU (`cuda_graph.extend`, attention.triton's extend kernel): an
executor replaying them gives the logits of the same executor's piecewise steps (both pad a step to the same
sizes, so every layer runs the same kernels; only the lm_head GEMM sees max_seqs rows in the graph against the
step's sequences piecewise), wherever the top two logits are apart the same argmax. bf16 (attention.triton's
kernels). Run on the H200: `python -m pytest tests/gpu/test_extend_graph_gpu.py -m gpu -q`."""

from __future__ import annotations

import pytest
import torch

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch

pytestmark = pytest.mark.gpu


def config(extend: bool) -> dict:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return {"model": {"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4},
                      "max_context": 1024},
            "quantization": {"format": "none"}, "runtime": {"device": "cuda", "dtype": "bfloat16"},
            "kv_cache": {"num_tokens": 8192, "page_size": 16},
            "backends": {"attention": {"decode": "triton", "extend": "triton_all"}},
            "cuda_graph": {"piecewise": {"sizes": [16, 64, 256]},
                           "extend": {"enabled": "on" if extend else "off", "sizes": [16, 64, 256], "max_seqs": 8}}}


def test_extend_graphs_give_the_piecewise_logits():
    exs = [Executor.from_config(config(e), progress=False) for e in (False, True)]
    assert exs[0].extend_graphs is None and exs[1].extend_graphs is not None
    calls = []
    run = exs[1].extend_graphs.run
    exs[1].extend_graphs.run = lambda *a: calls.append(sum(map(len, a[2]))) or run(*a)
    g = torch.Generator().manual_seed(0)
    seqs = [[ex.new_sequence() for _ in range(6)] for ex in exs]
    steps = [([0], [100]), ([1, 2, 3], [5, 40, 1]), ([0, 1, 4], [30, 1, 200]), ([5, 2, 3, 0], [1, 1, 1, 9]),
             ([4], [7])]
    for idx, lens in steps:
        toks = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in lens]
        out = [ex.forward(ForwardBatch([s[i] for i in idx], toks)) for ex, s in zip(exs, seqs)]
        assert torch.isfinite(out[1]).all()
        err = float((out[1] - out[0]).norm() / out[0].norm())
        assert err < 5e-3, (idx, lens, err)
        top2 = out[0].topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05
        assert torch.equal(out[1].argmax(-1)[clear], out[0].argmax(-1)[clear]), (idx, lens)
    assert calls == [100, 46, 231, 12, 7]


def test_extend_graphs_give_every_tokens_logits_where_asked():
    """Speculative-verification-like steps (4 tokens per sequence over cached prefixes, every row's logits of the
    drafting sequences) and a short prompt's every-token logits: through the extend graphs where the bucket computes
    that many rows (max_seqs 8 here), piecewise past it; the same logits either way."""
    exs = [Executor.from_config(config(e), progress=False) for e in (False, True)]
    calls = []
    run = exs[1].extend_graphs.run
    exs[1].extend_graphs.run = lambda *a: calls.append(sum(map(len, a[2]))) or run(*a)
    g = torch.Generator().manual_seed(1)
    seqs = [[ex.new_sequence() for _ in range(3)] for ex in exs]
    steps = [([0, 1, 2], [40, 9, 70], False), ([0, 1], [4, 4], True), ([0, 1, 2], [3, 1, 4], [True, False, True]),
             ([2], [7], True), ([1], [30], True)]
    for idx, lens, every in steps:
        toks = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in lens]
        out = [ex.forward(ForwardBatch([s[i] for i in idx], toks, every)) for ex, s in zip(exs, seqs)]
        assert out[0].shape == out[1].shape and torch.isfinite(out[1]).all()
        err = float((out[1] - out[0]).norm() / out[0].norm())
        assert err < 5e-3, (idx, lens, err)
    assert calls == [119, 8, 8, 7]  # the 30-token step's 30 rows: more than its bucket's 8
