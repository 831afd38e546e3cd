"""The Engine on the GPU, under piecewise and full decode graphs: greedy tokens equal Executor.generate's,
with and without prefix caching (shared pages read by extend steps with a cached prefix and by decode
graph replays), and under preemption. float32 weights, so that a different batch composition (another
GEMM tiling) can't flip a near-tie argmax of the random model: the test is about the engine's pages,
not about bf16 batch invariance.

Run on the H200: `python -m pytest tests/gpu/test_engine_gpu.py -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def make(prefix_caching: bool, num_tokens: int = 8192) -> Engine:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = {"model": {"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4},
                     "max_context": 1024},
           "quantization": {"format": "none"}, "runtime": {"device": "cuda", "dtype": "float32"},
           "kv_cache": {"num_tokens": num_tokens, "page_size": 16, "prefix_caching": prefix_caching}}
    return Engine.from_config(cfg, progress=False)


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 128000, (100,), generator=g).tolist()
    return [system + torch.randint(0, 128000, (n,), generator=g).tolist() for n in (7, 40, 129, 3, 60, 18)]


def test_engine_greedy_with_and_without_prefix_cache():
    ps = prompts(0)
    params = SamplingParams(temperature=0, max_tokens=24)
    off = make(False)
    want = off.executor.generate(ps, 24)
    assert [o.token_ids for o in off.generate(ps, params)] == want
    del off
    on = make(True)
    on.generate(ps[:1], params)  # caches the shared 100-token prefix
    outs = on.generate(ps, params)
    assert on.stats()["prefix_cache_hit_tokens"] > 0 and all(o.num_cached_tokens >= 96 for o in outs)
    assert [o.token_ids for o in outs] == want


def test_engine_preemption_on_gpu():
    ps = [p[:40] for p in prompts(1)] * 4
    params = SamplingParams(temperature=0, max_tokens=48)
    want = [o.token_ids for o in make(True).generate(ps, params)]
    small = make(True, num_tokens=24 * 16)  # 24 pages for 24 sequences of up to 6 pages
    assert [o.token_ids for o in small.generate(ps, params)] == want
    assert small.stats()["num_preemptions"] > 0
