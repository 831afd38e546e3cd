"""Piecewise, full decode and full extend CUDA graphs vs eager on the GPU, at real widths with few layers.

Run on the H200: `python -m pytest tests/gpu -m gpu -q`. Eager references come from the same executor
with its graph runners switched off, so weights and KV pool are shared.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.testing.checks import decisive_argmax_flips

pytestmark = pytest.mark.gpu

MODELS = {
    "llama-bf16": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4}}, "none"),
    "llama-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4}}, "nvfp4"),
    "deepseek-nvfp4": ({"arch": "deepseek_v3", "preset": "deepseek-v3",
                        "sizes": {"num_hidden_layers": 3, "first_k_dense_replace": 1}}, "nvfp4"),
    # DeepSeek-V2's group_limited_greedy routing (routed in the model, the op handed the answer) under V3's layers
    "deepseek-v2-nvfp4": ({"arch": "deepseek_v3", "preset": "deepseek-v3", "sizes": {
        "num_hidden_layers": 2, "first_k_dense_replace": 1, "model_type": "deepseek_v2",
        "topk_method": "group_limited_greedy", "norm_topk_prob": False}}, "nvfp4"),
    # DeepSeek-V2-Lite's shapes: 16 MLA heads without q LoRA, 64 experts of 1408 columns, 6 per token
    "deepseek-v2-lite-nvfp4": ({"arch": "deepseek_v3", "preset": "deepseek-v2-lite",
                                "sizes": {"num_hidden_layers": 2}}, "nvfp4"),
    # GLM-4.7-Flash's layers: 20 MLA heads (q LoRA, qk_nope 192, v 256; FlashInfer plans 32, the queries padded),
    # 64 experts of 1536 columns, 4 per token
    "glm4-moe-lite-nvfp4": ({"arch": "deepseek_v3", "preset": "glm-4.7-flash", "sizes": {"num_hidden_layers": 2}},
                            "nvfp4"),
    "deepseek-bf16": ({"arch": "deepseek_v3", "preset": "deepseek-v3",
                       "sizes": {"num_hidden_layers": 2, "first_k_dense_replace": 1}}, "none"),
    # Llama's layers with Qwen3's q/k norms and with Qwen2's q/k/v biases: the q/k/v GEMM without the rope epilogue
    "qwen3-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4,
                                                                          "model_type": "qwen3"}}, "nvfp4"),
    "qwen2-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4,
                                                                          "model_type": "qwen2"}}, "nvfp4"),
    # Phi-4-mini's rope: longrope's short factors over the 96 of 128 dimensions its partial_rotary_factor rotates
    "phi4-mini-rope-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 4, "model_type": "phi3", "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0 + i / 16 for i in range(48)], "long_factor": [4.0] * 48}}}, "nvfp4"),
    # SmolLM3's NoPE layers (here every 2nd): their q/k/v GEMM takes no rope epilogue, the others' may
    "smollm3-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 4, "model_type": "smollm3", "no_rope_layer_interval": 2}}, "nvfp4"),
    # GLM-4's q/k/v biases, interleaved rope over half of each head, sandwich norms
    "glm4-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4, "model_type": "glm4",
                                                                         "partial_rotary_factor": 0.5}}, "nvfp4"),
    # OLMo 2's post-norm blocks, q / k normalized over the whole projection
    "olmo2-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4,
                                                                          "model_type": "olmo2"}}, "nvfp4"),
    # Granite 3-style scalars (the attention's softmax scale among them) on the unfused block path
    "granite-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 4, "model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125, "logits_scaling": 16.0}}, "nvfp4"),
    # Qwen3-30B-A3B's experts (128, top 8, 768 columns) under Llama-3.1-8B-shaped attention
    "qwen3-moe-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 2, "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True}}, "nvfp4"),
    # Qwen1.5-MoE-A2.7B's experts (60, top 4, 1408 columns) and gated shared expert (5632 columns)
    "qwen2-moe-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 2, "model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}}, "nvfp4"),
    # GLM-4.5-Air's layers (q/k/v biases, half of each head rotated, 128 sigmoid-routed experts of 1408 columns with a
    # shared expert after a dense layer)
    "glm4-moe-nvfp4": ({"arch": "llama", "preset": "glm-4.5-air", "sizes": {"num_hidden_layers": 2}}, "nvfp4"),
    # ERNIE-4.5-21B-A3B's experts (64, top 6, 1536 columns, two shared) chosen with a correction bias, interleaved rope
    "ernie-moe-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 2, "model_type": "ernie4_5_moe", "moe_num_experts": 64, "moe_k": 6,
        "moe_intermediate_size": 1536, "moe_num_shared_experts": 2}}, "nvfp4"),
    # Gemma 3 1B's layers: 512-token sliding windows in 5 of every 6 layers (here layer 0 of 2), head_dim 256, GeGLU;
    # FlashInfer plans the windowed layer in a lane of its own
    "gemma3-nvfp4": ({"arch": "llama", "preset": "gemma-3-1b", "sizes": {"num_hidden_layers": 2,
                                                                          "sliding_window_pattern": 2}}, "nvfp4"),
    # Mistral 7B v0.1's window in every layer, here 64 tokens (the script's sequences run to 150): one windowed lane
    "mistral-window-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 2, "model_type": "mistral", "sliding_window": 64}}, "nvfp4"),
    # OLMo 3's layers: OLMo 2's blocks with a window (here 64 tokens) in 3 of 4 layers, their own rope
    "olmo3-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 4, "model_type": "olmo3",
                                                                          "sliding_window": 64}}, "nvfp4"),
    # EXAONE 4's layers: post-norm blocks, per-head q/k norms, a 64-token window in 3 of 4 layers, the 4th without rope
    "exaone4-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 4, "model_type": "exaone4", "sliding_window": 64}}, "nvfp4"),
    # Gemma 2 2B's layers: soft-capped attention scores and logits, a 4096-token window in layer 0
    "gemma2-nvfp4": ({"arch": "llama", "preset": "gemma-2-2b", "sizes": {"num_hidden_layers": 2}}, "nvfp4"),
    # Mixtral-8x7B's experts (8, top 2, 14336 columns: the preset's intermediate_size) in every layer
    "mixtral-nvfp4": ({"arch": "llama", "preset": "llama-3.1-8b", "sizes": {
        "num_hidden_layers": 2, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}},
                      "nvfp4"),
}
ATTENTION = ["torch", "flashinfer"]


def build(name: str, attention: str | dict, flashinfer_options: dict | None = None,
          backends: dict | None = None, kv_cache: dict | None = None) -> Executor:
    model, fmt = MODELS[name]
    op = "mla" if model["arch"] == "deepseek_v3" else "attention"
    if attention == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not importable here")
    cfg = {
        "model": {**model, "max_context": 1024},
        "quantization": {"format": fmt},
        "runtime": {"device": "cuda", "dtype": "bfloat16"},
        "kv_cache": {"num_tokens": 8192, "page_size": 16, **(kv_cache or {})},
        "backends": {op: attention, "options": {"flashinfer": {"variant": "fa2", **(flashinfer_options or {})}},
                     **(backends or {})},
        "cuda_graph": {"piecewise": {"enabled": "on", "max_tokens": 128, "sizes": [8, 16, 32, 64, 128]},
                       "decode": {"enabled": "on", "batch_sizes": [1, 2, 4, 8]}},
    }
    return Executor.from_config(cfg, progress=False)


@contextlib.contextmanager
def eager(ex: Executor):
    saved = ex.piecewise, ex.decode_graphs, ex.extend_graphs
    ex.piecewise = ex.decode_graphs = ex.extend_graphs = None
    try:
        yield ex
    finally:
        ex.piecewise, ex.decode_graphs, ex.extend_graphs = saved


def toks(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def script(vocab: int):
    """Steps over several sequences: extends of many sizes (padding, above max_tokens), prefixes,
    mixed batches and decode batches of changing size, so graphs replay over a changing KV cache."""
    t = lambda n, s: toks(n, s, vocab)  # noqa: E731
    steps = [[(0, t(5, 1))], [(1, t(16, 2)), (2, t(3, 3))], [(0, t(37, 4))], [(3, t(150, 5))],
             [(0, [7]), (1, [8]), (2, [9])], [(0, [1]), (1, [2]), (2, [3]), (3, [4])],
             [(4, t(61, 6)), (0, [5])], [(2, t(12, 7)), (1, [6]), (3, [7])]]
    for k in range(12):  # decode with a batch that grows and shrinks
        live = [0, 1, 2, 3, 4][: 1 + k % 5]
        steps.append([(i, [(k * 7 + i) % vocab]) for i in live])
    return steps


def run(ex: Executor, steps, all_logits: bool = True) -> list[torch.Tensor]:
    seqs, out = {}, []
    for step in steps:
        for i, _ in step:
            seqs.setdefault(i, ex.new_sequence())
        batch = ForwardBatch([seqs[i] for i, _ in step], [t for _, t in step], return_all_logits=all_logits)
        out.append(ex.forward(batch).float())
    for s in seqs.values():
        ex.free(s)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("name", list(MODELS))
def test_graphs_match_eager(name, attention):
    check_graphs_match_eager(build(name, attention), name)


def test_graphs_match_eager_tensor_core_decode():
    """The default for Llama's 4 query heads per KV head is FlashInfer's CUDA-core decode kernel (the
    tests above); this runs the tensor-core one. The CUDA-core kernel hung this test before
    PlanCopyGuard: consecutive eager decode plans of one wrapper rewrote its pinned schedule buffer
    under a pending copy."""
    pytest.importorskip("flashinfer", reason="flashinfer is not importable here")
    check_graphs_match_eager(build("llama-bf16", "flashinfer", {"decode_tensor_cores": True}), "llama-bf16")


def test_graphs_match_eager_triton_decode_attention():
    """attention.triton (decode only) in full decode graphs and eagerly, FlashInfer for extend steps."""
    pytest.importorskip("flashinfer", reason="flashinfer is not importable here")
    ex = build("llama-bf16", {"decode": "triton", "extend": "flashinfer"})
    assert type(ex.table.step(ForwardMode.DECODE, GraphMode.FULL).attention).__name__ == "TritonDecodeAttentionBackend"
    check_graphs_match_eager(ex, "llama-bf16")


FP8_ATTENTION = {"flashinfer": "flashinfer", "triton-decode": {"decode": "triton", "extend": "flashinfer"},
                 "torch": "torch"}


@pytest.mark.parametrize("attention", list(FP8_ATTENTION))
def test_graphs_match_eager_fp8_kv(attention, monkeypatch):
    """An FP8 KV pool with per-layer scales other than 1.0 (put on the loaded model, where a checkpoint's go) in
    piecewise and full graphs and eagerly; eager logits stay near the model-dtype pool's."""
    from pieceworks.models import loader

    load = loader.load_model

    def with_scales(*args, **kwargs):
        model = load(*args, **kwargs)
        model.kv_scales = [(0.05 + 0.01 * i, 0.04 + 0.01 * i) for i in range(len(model.layers))]
        return model

    monkeypatch.setattr(loader, "load_model", with_scales)
    ex = build("llama-nvfp4", FP8_ATTENTION[attention], kv_cache={"dtype": "fp8"})
    assert ex.kv.dtype == torch.float8_e4m3fn and ex.kv.k_scale(1) == pytest.approx(0.06)
    steps = script(ex.vocab_size)[:6]
    with eager(ex):
        fp8 = run(ex, steps)
    check_graphs_match_eager(ex, "llama-nvfp4")
    monkeypatch.setattr(loader, "load_model", load)
    with eager(build("llama-nvfp4", FP8_ATTENTION[attention])) as ref:
        errs = [rel(a, b) for a, b in zip(fp8, run(ref, steps))]
    print(f"fp8 / model-dtype pool, relative logit error per step: {errs}")
    # e4m3 rounding of K/V (3 mantissa bits) moves these random-weight logits by 0.07-0.11 (H100, torch
    # reference); a scale left out or applied twice moves scores or outputs by factors of 10-25
    assert max(errs) < 0.2, errs


def test_graphs_match_eager_cuda_moe_and_gemm():
    """DeepSeek-V3-shaped NVFP4 layers on pieceworks' CUDA kernels (moe.cuda, fp4_gemm.cuda) in piecewise
    and full graphs and eagerly."""
    pytest.importorskip("flashinfer", reason="flashinfer is not importable here")
    ex = build("deepseek-nvfp4", "flashinfer", backends={"moe": "cuda", "fp4_gemm": "cuda"})
    step = ex.table.step(ForwardMode.DECODE, GraphMode.FULL)
    assert type(step.moe).__name__ == "CudaMoEBackend" and type(step.fp4_gemm).__name__ == "CudaFp4GemmBackend"
    check_graphs_match_eager(ex, "deepseek-nvfp4")


@pytest.mark.parametrize("attention", ATTENTION)
def test_recorded_piecewise_replays_match_eager(attention):
    """Steps that all pad to one capture size (32) over changing sequences, prefixes and a mixed batch:
    none goes through the traced code, every one runs the program recorded at capture (piece replays and
    attention calls, one program per capture size); every step matches eager."""
    ex = build("llama-bf16", attention)
    try:
        v = ex.vocab_size
        steps = [[(0, toks(30, 1, v))], [(1, toks(25, 2, v))], [(0, toks(20, 3, v)), (1, [5])],
                 [(2, toks(32, 4, v))], [(1, toks(17, 5, v)), (0, toks(9, 6, v))]]
        traced, real = [], ex.piecewise._run
        ex.piecewise._run = lambda size: traced.append(size) or real(size)
        graphed = run(ex, steps)
        ex.piecewise._run = real
        assert traced == [] and sorted(ex.piecewise.programs) == ex.piecewise.sizes
        with eager(ex):
            ref = run(ex, steps)
        errs = [rel(g, r) for g, r in zip(graphed, ref)]
        assert max(errs) < 2e-2, errs
        flips = {i: f for i, (g, r) in enumerate(zip(graphed, ref)) if (f := decisive_argmax_flips(g, r))}
        assert not flips, f"greedy tokens differ beyond near ties (step: [(row, eager margin)]): {flips}"
    finally:
        del ex
        torch.cuda.empty_cache()


def check_graphs_match_eager(ex: Executor, name: str) -> None:
    try:
        steps = script(ex.vocab_size)
        modes = []
        orig = ex._graph_mode
        ex._graph_mode = lambda *a: modes.append(orig(*a)) or modes[-1]
        graphed = run(ex, steps)
        ex._graph_mode = orig
        assert {GraphMode.PIECEWISE, GraphMode.FULL, GraphMode.EAGER} <= set(modes)
        with eager(ex):
            ref = run(ex, steps)
        assert_near_eager(graphed, ref, moe=bool(ex.model.expert_blocks()))
        assert ex.piecewise.backend.num_compiles == 1
        assert ex.kv.allocator.num_free == ex.kv.allocator.capacity
    finally:
        del ex
        torch.cuda.empty_cache()


def assert_near_eager(graphed: list[torch.Tensor], ref: list[torch.Tensor], moe: bool) -> None:
    errs = [rel(g, r) for g, r in zip(graphed, ref)]
    # GEMMs tile a padded batch differently from the unpadded one (last-bit differences), and full extend graphs
    # run attention.triton_all where eager steps run FlashInfer or torch. In a dense model that is all; in an MoE
    # model such a difference can flip a near-tied expert choice of random weights, which moves that token's logits
    # and those of the rows that attend to it further (H200: Mixtral 0.18 in a 37-row step, 0.44 in a 2-row one):
    # there, most steps must still be tight and none as far off as unrelated logits (about 1.4). Where the logits
    # are this close (dense), greedy tokens differ only at near ties (`decisive_argmax_flips`).
    if not moe:
        assert max(errs) < 2e-2, errs
        flips = {i: f for i, (g, r) in enumerate(zip(graphed, ref)) if (f := decisive_argmax_flips(g, r))}
        assert not flips, f"greedy tokens differ beyond near ties (step: [(row, eager margin)]): {flips}"
    else:
        assert sum(e < 5e-2 for e in errs) >= 0.9 * len(errs) and max(errs) < 1.0, str(errs)
        # Over all rows of the script at least 90% keep eager's greedy token (per step would be too coarse: one
        # flip in a 5-row decode step is 80%; the H200 saw 96-100% in every MoE case).
        same = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(graphed, ref))
        rows = sum(len(r) for r in ref)
        assert same >= 0.9 * rows, f"{same} of {rows} rows keep eager's greedy token; per step {errs}"


# GQA models whose (extend, FULL) entries the registry fills (attention.triton_all): cuda_graph.extend's auto
# builds full extend graphs for them; windowed, soft-capped and MLA models have none.
EXTEND_GRAPH_MODELS = ["llama-bf16", "llama-nvfp4", "qwen3-nvfp4", "qwen2-nvfp4", "phi4-mini-rope-nvfp4",
                       "smollm3-nvfp4", "glm4-nvfp4", "olmo2-nvfp4", "granite-nvfp4", "qwen3-moe-nvfp4"]


@pytest.mark.parametrize("name", EXTEND_GRAPH_MODELS)
def test_full_extend_graphs_match_eager(name):
    """The script's steps with each sequence's last logits only (as the Engine asks): extend and mixed steps go
    through the full extend graphs (`cuda_graph.extend`, on by default), decode steps through the decode graphs;
    the logits stay near eager's (FlashInfer)."""
    ex = build(name, "flashinfer")
    try:
        assert ex.extend_graphs is not None, ex.table.graph_unavailable
        assert ex.table.step(ForwardMode.EXTEND, GraphMode.FULL).attention.name == "triton_all"
        assert ex.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE).attention.name == "flashinfer"
        steps, calls = script(ex.vocab_size), []
        real = ex.extend_graphs.run
        ex.extend_graphs.run = lambda *a: calls.append(sum(map(len, a[2]))) or real(*a)
        graphed = run(ex, steps, all_logits=False)
        ex.extend_graphs.run = real
        # every extend and mixed step of the script but the 5-token one, which piecewise pads less (8 against 16)
        assert calls == [19, 37, 150, 62, 14], calls
        with eager(ex):
            ref = run(ex, steps, all_logits=False)
        assert_near_eager(graphed, ref, moe=bool(ex.model.expert_blocks()))
        assert ex.kv.allocator.num_free == ex.kv.allocator.capacity
    finally:
        del ex
        torch.cuda.empty_cache()


def test_no_full_extend_graphs_where_no_backend_is_safe_there():
    """A windowed model (attention.triton_all serves no windows) and an MLA one: auto builds none, and says why."""
    for name in ("mistral-window-nvfp4", "deepseek-nvfp4"):
        ex = build(name, "flashinfer")
        assert ex.extend_graphs is None and not ex.table.graph_mode_ok(ForwardMode.EXTEND, GraphMode.FULL), name
        del ex
        torch.cuda.empty_cache()


def test_greedy_generation_identical_under_graphs():
    ex = build("llama-bf16", "torch")
    prompts = [toks(n, n, ex.vocab_size) for n in (5, 40, 90, 130)]
    graphed = ex.generate(prompts, 16)
    with eager(ex):
        ref = ex.generate(prompts, 16)
    same = sum(g == r for g, r in zip(graphed, ref))
    assert same >= 3, (graphed, ref)


def test_in_graph_greedy_ids_equal_the_eager_argmax_of_the_logits():
    """Every decode replay leaves `Executor.greedy_ids`, computed inside the graph: equal to
    `greedy_token_ids` (and argmax) of the logits the step returned, for every bucket, padded or not.
    (tests/gpu/test_engine_gpu.py checks the Engine's greedy tokens, which it takes from these ids,
    against Executor.generate's eager argmax.)"""
    from pieceworks.executor.cuda_graph import greedy_token_ids

    ex = build("llama-bf16", "torch")
    seqs = [ex.new_sequence() for _ in range(8)]
    for i, s in enumerate(seqs):
        ex.forward(ForwardBatch([s], [toks(9 + i, i, ex.vocab_size)]))
    for k, n in enumerate((1, 2, 3, 5, 8, 7, 4)):  # exact buckets and padded ones
        logits = ex.forward(ForwardBatch(seqs[:n], [[(k * 31 + i) % ex.vocab_size] for i in range(n)]))
        assert ex.greedy_ids is not None and ex.greedy_ids.shape == (n,)
        assert torch.equal(ex.greedy_ids, greedy_token_ids(logits))
        assert torch.equal(ex.greedy_ids, logits.argmax(-1))
    for s in seqs:
        ex.free(s)
