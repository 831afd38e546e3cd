"""Tensor parallel on CUDA (NCCL): the distributed path at world size 1, and N ranks on N GPUs.

Run on the H200: `python -m pytest tests/gpu/test_parallel_gpu.py -m gpu -q`. The world-size-1 tests run
on one GPU; the N-rank tests skip with their reason where fewer GPUs are visible (issue 39's machines).
Decode runs in full CUDA graphs and extend in piecewise graphs, with the collectives captured inside.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks import Executor
from pieceworks.config import load_config
from pieceworks.core.batch import ForwardBatch

pytestmark = pytest.mark.gpu

GRAPHS = ["cuda_graph.piecewise.enabled=on", "cuda_graph.piecewise.sizes=[8,16,32]",
          "cuda_graph.decode.enabled=on", "cuda_graph.decode.batch_sizes=[1,2,4]"]
CUDA = ["runtime.device=cuda", "kv_cache.num_tokens=4096", *GRAPHS]
MODELS = {
    "llama": ["model.arch=llama", "model.preset=tiny"],
    "llama-nvfp4": ["model.arch=llama", "model.preset=tiny", "quantization.format=nvfp4"],
    "deepseek": ["model.arch=deepseek_v3", "model.preset=tiny"],
}


def steps(ex: Executor) -> list[torch.Tensor]:
    """An extend (piecewise), two decode steps (full graphs) and a mixed step."""
    a, b, c = ex.new_sequence(), ex.new_sequence(), ex.new_sequence()
    out = [ex.forward(ForwardBatch([a, b], [list(range(1, 12)), [7, 8, 9]])),
           ex.forward(ForwardBatch([a, b], [[10], [11]])),
           ex.forward(ForwardBatch([a, b], [[12], [13]])),
           ex.forward(ForwardBatch([a, c], [[14], [3, 1, 4, 1, 5]]))]
    return [t.float().cpu() for t in out]


def needs_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs, {torch.cuda.device_count() if torch.cuda.is_available() else 0} visible")


@pytest.mark.parametrize("model", list(MODELS))
def test_world_size_one_through_nccl_equals_plain(model):
    """A process group of one (NCCL): collectives captured in the decode and piecewise graphs change
    nothing; bf16 logits are bit-identical to the plain executor's."""
    from pieceworks.executor.distributed import one_rank

    needs_gpus(1)
    overrides = MODELS[model] + CUDA
    ref = steps(Executor.from_config(None, overrides, progress=False))
    with one_rank(Executor, load_config(None, overrides), progress=False, collectives=True) as ex:
        assert ex.decode_graphs is not None and ex.piecewise is not None
        got = steps(ex)
    for i, (r, g) in enumerate(zip(ref, got)):
        assert torch.equal(r, g), f"step {i}: max diff {(r - g).abs().max().item()}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("model, extra", [("llama", []), ("llama-nvfp4", []), ("deepseek", []),
                                          ("deepseek", ["parallel.expert_parallel=true"])],
                         ids=["llama", "llama-nvfp4", "deepseek-tp", "deepseek-ep"])
def test_n_gpus_equal_one(n, model, extra):
    """N ranks on N GPUs (NCCL, graphs on) against one GPU, float32 with the torch reference kernels
    (no kernel differences between the two runs: only the split sums)."""
    needs_gpus(n)
    fp32 = ["runtime.dtype=float32", "backends.attention=torch", "backends.mla=torch", "backends.moe=torch",
            "backends.fp4_gemm=torch"]
    overrides = MODELS[model] + CUDA + fp32
    ref = steps(Executor.from_config(None, overrides, progress=False))
    with Executor.from_config(None, overrides + extra + [f"parallel.tensor_parallel_size={n}"],
                              progress=False) as ex:
        got = steps(ex)
    for i, (r, g) in enumerate(zip(ref, got)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4, msg=f"step {i}")
        assert torch.equal(g.argmax(-1), r.argmax(-1)), f"step {i}: greedy tokens differ"
