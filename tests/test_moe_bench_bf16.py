"""benchmarks/moe.py --bf16: its bf16 grouped-GEMM expert path (the baseline the NVFP4 MoE is compared with)
against a per-token loop over the routed experts, on CPU with a small layer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_dir = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_dir))  # the script imports its folder's `common`, as when run
_spec = importlib.util.spec_from_file_location("moe_script", _dir / "moe.py")
moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_bf16_experts_match_a_loop_over_the_routed_experts():
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, topk = 6, 64, 32, 9, 3
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).div(8).to(torch.bfloat16)  # [E, N, K]
    w2 = torch.randn(experts, hidden, inter, generator=gen).div(8).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    ids[0] = ids[1]  # an expert routed twice in a row; expert 5 left out of every token below
    ids[ids == 5] = 4
    weights = torch.rand(tokens, topk, generator=gen)
    got = moe.bf16_experts(x, weights, ids, w13.transpose(1, 2), w2.transpose(1, 2))
    ref = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for s in range(topk):
            e = int(ids[t, s])
            h = x[t].float() @ w13[e].float().t()
            ref[t] += float(weights[t, s]) * (torch.nn.functional.silu(h[:inter]) * h[inter:]) @ w2[e].float().t()
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert (got.float() - ref).norm() / ref.norm() < 2e-2
