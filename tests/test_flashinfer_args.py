"""FlashInfer, TRT-LLM and mm_fp4 backends on a machine without a GPU: everything that prepares kernel
arguments is pure torch and is checked here against the scenarios and the NVFP4 reference codec; the
backends' reasons and the registry's piecewise fallback use hand-built specs (capability overrides).
Tests that need FlashInfer's own helpers run only where it is importable."""

from __future__ import annotations

import ast
import importlib.util
import logging
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pieceworks.backends.attention.triton import TritonDecodeAttentionBackend
from pieceworks.backends.attention.flashinfer import (
    FlashInferAttentionBackend,
    FlashInferOptions,
    paged_kv_indices,
    qo_indptr,
    resolve_decode_tensor_cores,
    resolve_variant,
    step_lengths,
)
from pieceworks.backends.base import BackendSpec, ModelFacts, parse_options
from pieceworks.backends.fp4_gemm.base import Fp4Weight
from pieceworks.backends.fp4_gemm.flashinfer import (
    FlashInferCudnnFp4GemmBackend,
    FlashInferCutlassFp4GemmBackend,
    FlashInferTrtllmFp4GemmBackend,
    fp4_quantize_activation,
    mm_fp4_alpha,
    mm_fp4_layout,
    require_fp4_quantize,
)
from pieceworks.backends.mla.flashinfer import FlashInferMLABackend, mla_plan_args
from pieceworks.backends.mla.torch import attend_latent
from pieceworks.backends.mla.trtllm import TrtllmMLABackend, token_rows
from pieceworks.backends.moe.base import MoEWeights
from pieceworks.backends.moe.flashinfer import (
    FlashInferCutlassMoEBackend,
    FlashInferTrtllmMoEBackend,
    cutlass_moe_layout,
    shared_gate_up_scale,
    trtllm_moe_layout,
    up_gate,
)
from pieceworks.backends.moe.routing import deepseek_route
from pieceworks.backends.registry import Registry, SelectionError
from pieceworks.config import load_config
from pieceworks.core.batch import ForwardMode, GraphMode, StepMetadata
from pieceworks.quant import nvfp4
from pieceworks.testing import scenarios as S

E, D, M = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED
EAGER, FULL, PW = GraphMode.EAGER, GraphMode.FULL, GraphMode.PIECEWISE
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not importable here")
CPU = torch.device("cpu")


def _meta(sc: S.Scenario) -> StepMetadata:
    return S.attention_case(sc, 4, 2, 16, torch.float32, CPU).meta


def _full_meta(seq_lens: list[int], bs: int, page_size: int, width: int, seed: int = 0) -> StepMetadata:
    """A FULL decode step as the graph runner builds it: static [bs, width] table, padded rows on page 0."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.zeros(bs, width, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        table[i] = torch.randperm(200, generator=gen)[:width].to(torch.int32) + 1
    return StepMetadata(
        mode=D, graph_mode=FULL, extend_lens=[1] * len(seq_lens), prefix_lens=[n - 1 for n in seq_lens],
        page_size=page_size, page_table=table, slot_mapping=torch.zeros(bs, dtype=torch.int64),
        positions=torch.zeros(bs, dtype=torch.int64), graph_batch_size=bs,
    )


# ---------------------------------------------------------------- page table -> FlashInfer CSR
@pytest.mark.parametrize("sc", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
def test_paged_kv_indices_match_the_page_table(sc):
    meta = _meta(sc)
    kv = paged_kv_indices(meta.page_table, meta.seq_lens, meta.page_size)
    ps, pos = meta.page_size, 0
    assert kv.indptr.dtype == kv.indices.dtype == kv.last_page_len.dtype == torch.int32
    assert kv.indptr[0] == 0 and len(kv.indptr) == meta.num_seqs + 1
    for i, n in enumerate(meta.seq_lens):
        pages = math.ceil(n / ps)
        assert kv.indptr[i + 1] - kv.indptr[i] == pages
        assert kv.indices[pos : pos + pages].tolist() == meta.page_table[i, :pages].tolist()
        assert kv.last_page_len[i] == n - (pages - 1) * ps and 1 <= kv.last_page_len[i] <= ps
        pos += pages
    assert kv.kv_lens.tolist() == meta.seq_lens and pos == len(kv.indices)


def test_paged_kv_indices_edges():
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    kv = paged_kv_indices(table, [16, 1, 5], 4)  # exactly full rows, one token, one over a page
    assert kv.indptr.tolist() == [0, 4, 5, 7]
    assert kv.indices.tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert kv.last_page_len.tolist() == [4, 1, 1]
    with pytest.raises(ValueError, match="needs 5 pages"):
        paged_kv_indices(table, [17, 1, 1], 4)
    with pytest.raises(ValueError, match="3 rows for 2 sequences"):
        paged_kv_indices(table, [1, 1], 4)


@pytest.mark.parametrize("sc", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
def test_paged_kv_indices_from_page_lists_match(sc):
    """Building the CSR arrays from the host page lists (what FULL decode and prepared steps pass)
    gives what gathering from the device table gives; the table itself is not read."""
    meta = _meta(sc)
    ref = paged_kv_indices(meta.page_table, meta.seq_lens, meta.page_size)
    lists = [row.tolist() for row in meta.page_table]
    poisoned = torch.full_like(meta.page_table, -7)
    kv = paged_kv_indices(poisoned, meta.seq_lens, meta.page_size, page_lists=lists)
    for name in ("indptr", "indices", "last_page_len", "kv_lens"):
        assert torch.equal(getattr(kv, name), getattr(ref, name)), name
        assert getattr(kv, name).dtype == torch.int32, name
    short = [row[:1] for row in lists]
    if any(-(-n // meta.page_size) > 1 for n in meta.seq_lens):
        with pytest.raises(ValueError, match="page list holds 1"):
            paged_kv_indices(poisoned, meta.seq_lens, meta.page_size, page_lists=short)


def test_full_graph_steps_are_padded_to_the_graph_batch():
    meta = _full_meta([9, 3, 17], bs=8, page_size=4, width=6)
    qo, kv_lens = step_lengths(meta)
    assert qo == [1] * 8 and kv_lens == [9, 3, 17] + [1] * 5
    kv = paged_kv_indices(meta.page_table, kv_lens, meta.page_size)
    assert kv.indptr.tolist() == [0, 3, 4, 9, 10, 11, 12, 13, 14]
    assert kv.indices[9:].tolist() == [0] * 5  # the padding rows read the reserved page
    assert qo_indptr(qo).tolist() == list(range(9)) and qo_indptr(qo).dtype == torch.int32
    eager = replace(meta, graph_mode=EAGER, graph_batch_size=None, _cache={})
    assert step_lengths(eager) == ([1, 1, 1], [9, 3, 17])


# ---------------------------------------------------------------- MLA plan arguments
@pytest.mark.parametrize("sc", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
def test_mla_plan_args(sc):
    meta = _meta(sc)
    args = mla_plan_args(meta, 0.125, 16, 512, 64, torch.bfloat16)
    csr = args.pop("csr")
    assert csr["qo_indptr"].tolist() == meta.qo_indptr()
    assert csr["kv_len_arr"].tolist() == meta.seq_lens
    ref = paged_kv_indices(meta.page_table, meta.seq_lens, meta.page_size)
    assert torch.equal(csr["kv_indptr"], ref.indptr) and torch.equal(csr["kv_indices"], ref.indices)
    assert all(t.dtype == torch.int32 for t in csr.values())
    assert args == dict(num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=sc.page_size,
                        causal=sc.mode is not D, sm_scale=0.125, q_data_type=torch.bfloat16,
                        kv_data_type=torch.bfloat16, query_layout="split", kv_cache_layout="packed")


def test_mla_plan_args_full_graph():
    args = mla_plan_args(_full_meta([5, 33], bs=4, page_size=16, width=4), 1.0, 128, 512, 64, torch.bfloat16)
    assert args["csr"]["qo_indptr"].tolist() == [0, 1, 2, 3, 4]
    assert args["csr"]["kv_len_arr"].tolist() == [5, 33, 1, 1]
    assert args["csr"]["kv_indptr"].tolist() == [0, 1, 4, 5, 6] and not args["causal"]


# ---------------------------------------------------------------- TRT-LLM MLA: one decode row per token
def test_token_rows():
    seq, lens = token_rows([1, 3, 2], [4, 0, 7])
    assert seq.tolist() == [0, 1, 1, 1, 2, 2]
    assert lens.tolist() == [5, 1, 2, 3, 8, 9] and lens.dtype == torch.int32


@pytest.mark.parametrize("sc", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
def test_token_rows_reproduce_causal_attention(sc):
    """Dense-mask decode over each row's own prefix (what the kernel computes) is causal attention."""
    case = S.mla_case(sc, 2, 64, 16, torch.float32, CPU)
    meta, cache, i = case.meta, case.pool.latent_cache(0), case.inputs
    flat = cache.view(-1, cache.shape[-1])
    flat.index_copy_(0, meta.slot_mapping, torch.cat([i["c_kv"], i["k_pe"]], -1))  # the backend's KV write
    seq, lens = token_rows(meta.extend_lens, meta.prefix_lens)
    tables = meta.page_table.index_select(0, seq)
    out = []
    for r, n in enumerate(lens.tolist()):
        entries = cache[tables[r, : math.ceil(n / meta.page_size)].long()].flatten(0, 1)[:n]
        out.append(attend_latent(i["q_nope"][r : r + 1], i["q_pe"][r : r + 1], entries, i["scale"], n - 1))
    torch.testing.assert_close(torch.cat(out).double(), case.expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- mm_fp4
def _fp4_linear(n: int, k: int, seed: int = 0) -> Fp4Weight:
    return Fp4Weight(*S.random_fp4_weight(n, k, torch.Generator().manual_seed(seed), CPU))


def test_mm_fp4_alpha_and_global_scale():
    w = _fp4_linear(48, 64)
    prepared = mm_fp4_layout(w)
    assert prepared.weight_scale_2.shape == (1,) and prepared.weight_scale_2.dtype == torch.float32
    torch.testing.assert_close(prepared.weight_scale_2, (w.input_scale * w.weight_scale_2).reshape(1))
    torch.testing.assert_close(prepared.input_scale, (1 / w.input_scale).reshape(1))
    assert mm_fp4_alpha(torch.tensor(0.5), torch.tensor(3.0)).item() == 1.5


@pytest.mark.parametrize("shape", list(S.GEMM_SHAPES.values()), ids=list(S.GEMM_SHAPES))
def test_mm_fp4_layout_swizzles_scales_128x4(shape):
    _, k, n = shape
    w = _fp4_linear(n, k)
    prepared = mm_fp4_layout(w)
    assert torch.equal(prepared.weight, w.weight)
    assert prepared.weight_scale.dtype == torch.float8_e4m3fn
    assert prepared.weight_scale.shape == (math.ceil(n / 128) * 128, math.ceil(k // 16 / 4) * 4)
    assert torch.equal(prepared.weight_scale.view(torch.uint8), nvfp4.swizzle_128x4(w.weight_scale).view(torch.uint8))
    back = nvfp4.unswizzle_128x4(prepared.weight_scale, n, k // 16)
    assert torch.equal(back.view(torch.uint8), w.weight_scale.view(torch.uint8))


@pytest.mark.parametrize("shape", list(S.GEMM_SHAPES.values()), ids=list(S.GEMM_SHAPES))
def test_mm_fp4_scale_conventions_reproduce_w4a4(shape):
    """mm_fp4's math on the prepared tensors: alpha * (codes_x * sf_x) @ (codes_w * sf_w).T, with x
    quantized by the global scale prepare stored, equals the dense w4a4 reference."""
    m, k, n = shape
    w = _fp4_linear(n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    p = mm_fp4_layout(w)
    codes, sf, _ = nvfp4.quantize_activation(x, 1 / p.input_scale[0])
    xq = nvfp4.dequantize(codes, sf, torch.tensor(1.0)).double()
    wq = nvfp4.dequantize(p.weight, nvfp4.unswizzle_128x4(p.weight_scale, n, k // 16), torch.tensor(1.0)).double()
    y = p.weight_scale_2.double() * (xq @ wq.t())
    torch.testing.assert_close(y, S.dense_fp4_gemm(x, *w, "w4a4"), rtol=1e-5, atol=1e-6)


def test_mm_fp4_trtllm_layout_permutes_weight_and_scale_rows_together():
    w = _fp4_linear(256, 64)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3))
    p = mm_fp4_layout(w, perm)
    assert torch.equal(p.weight, w.weight[perm])
    back = nvfp4.unswizzle_128x4(p.weight_scale, 256, 4)
    assert torch.equal(back.view(torch.uint8), w.weight_scale[perm].view(torch.uint8))


@needs_flashinfer
def test_trtllm_row_permutation_is_flashinfers_shuffle():
    from flashinfer.utils import get_shuffle_matrix_a_row_indices, get_shuffle_matrix_sf_a_row_indices

    from pieceworks.backends.fp4_gemm.flashinfer import trtllm_row_permutation

    perm = trtllm_row_permutation(256)
    assert torch.equal(perm, get_shuffle_matrix_a_row_indices(torch.zeros(256, 32, dtype=torch.uint8), 128))
    assert torch.equal(perm, get_shuffle_matrix_sf_a_row_indices(torch.zeros(256, 4, dtype=torch.uint8), 128))


def test_fp4_quantize_guard_refuses_below_sm100():
    for cap in [(9, 0), (8, 9), (8, 0), None]:
        with pytest.raises(RuntimeError, match="uninitialised memory"):
            require_fp4_quantize(cap)
    for cap in [(10, 0), (10, 3), (12, 0)]:
        require_fp4_quantize(cap)
    x, gs = torch.randn(4, 32, dtype=torch.bfloat16), torch.ones(1)
    with pytest.raises(RuntimeError, match=r"this device: 9\.0"):
        fp4_quantize_activation(x, gs, capability=(9, 0))
    with pytest.raises(RuntimeError, match="no GPU"):
        fp4_quantize_activation(x, gs)  # a CPU tensor has no capability


def _callee(call: ast.Call) -> str:
    return getattr(call.func, "attr", getattr(call.func, "id", ""))


def test_fp4_quantize_is_only_called_behind_the_guard():
    """Structure: the one call of flashinfer's fp4_quantize in the package is in the guarded function,
    after the guard."""
    root = Path(__import__("pieceworks").__file__).parent
    calls = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and _callee(node) == "fp4_quantize":
                    calls.append((path.name, fn.name, node.lineno, fn))
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        assert "fp4_quantize" not in imported, f"{path} imports fp4_quantize directly"
    assert [(f, n) for f, n, _, _ in calls] == [("flashinfer.py", "fp4_quantize_activation")]
    _, _, line, fn = calls[0]
    guard = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and _callee(n) == "require_fp4_quantize"]
    assert guard and min(guard) < line


# ---------------------------------------------------------------- fused MoE
def _moe_weights(experts=4, hidden=64, inter=32, seed=0) -> MoEWeights:
    """NVFP4 experts as ModelOpt exports them: gate and up share weight_scale_2 and input_scale."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    q13 = [nvfp4.quantize_weight(w13[e]) for e in range(experts)]
    q2 = [nvfp4.quantize_weight(w2[e]) for e in range(experts)]
    return MoEWeights(
        torch.stack([q[0] for q in q13]), torch.stack([q[1] for q in q13]),
        torch.stack([torch.stack([q[2], q[2]]) for q in q13]), torch.full((experts,), 2.0 / 2688),
        torch.stack([q[0] for q in q2]), torch.stack([q[1] for q in q2]), torch.stack([q[2] for q in q2]),
        torch.full((experts,), 0.5 / 2688),
    )


def test_up_gate_swaps_halves():
    t = torch.arange(2 * 3 * 4).view(2, 6, 2)  # [E, 2I, .] with I = 3
    assert torch.equal(up_gate(t)[:, :3], t[:, 3:]) and torch.equal(up_gate(t)[:, 3:], t[:, :3])


def test_moe_scales_and_shared_gate_up_scale():
    w = _moe_weights()
    p = cutlass_moe_layout(w)
    in1, in2 = w.w13_input_scale.max(), w.w2_input_scale.max()
    torch.testing.assert_close(p.w13_scale_2, in1 * w.w13_scale_2[:, 0])
    torch.testing.assert_close(p.w2_scale_2, in2 * w.w2_scale_2)
    torch.testing.assert_close(p.w13_input_scale, (1 / in1).reshape(1))
    torch.testing.assert_close(p.w2_input_scale, (1 / in2).reshape(1))
    bad = w.w13_scale_2.clone()
    bad[2, 1] *= 2
    with pytest.raises(ValueError, match=r"experts \[2\] have different weight_scale_2"):
        shared_gate_up_scale(bad)


def test_cutlass_moe_layout_shapes():
    w = _moe_weights(experts=3, hidden=64, inter=48)
    p = cutlass_moe_layout(w)
    assert torch.equal(p.w13, up_gate(w.w13)) and p.w13.is_contiguous()
    assert p.w13_scale.shape == (3, 128, 4) and p.w2_scale.shape == (3, 128, 4)
    for e in range(3):
        back = nvfp4.unswizzle_128x4(p.w13_scale[e], 96, 4).view(torch.uint8)
        assert torch.equal(back, up_gate(w.w13_scale)[e].view(torch.uint8))
        assert torch.equal(nvfp4.unswizzle_128x4(p.w2_scale[e], 64, 3).view(torch.uint8), w.w2_scale[e].view(torch.uint8))
    assert p.w13.view(torch.long).shape == (3, 96, 4)  # the kernel reads packed int64 weights
    assert p.w13_scale.view(torch.int32).shape == (3, 128, 1)


def _emulate_fused_moe(p: MoEWeights, x, logits, bias, args, hidden, inter):
    """What FlashInfer's NVFP4 fused MoE computes from the prepared tensors: x quantized once with the
    shared global scale, GEMM1 = [up; gate] scaled by alpha1, silu(gate) * up, quantized with the second
    global scale, GEMM2 scaled by alpha2, routing-weighted sum."""
    weights, ids = deepseek_route(logits, bias, *args)
    one = torch.tensor(1.0)
    xc, xs, _ = nvfp4.quantize_activation(x, 1 / p.w13_input_scale[0])
    xq = nvfp4.dequantize(xc, xs, one).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            w1 = nvfp4.dequantize(p.w13[e], nvfp4.unswizzle_128x4(p.w13_scale[e], 2 * inter, hidden // 16), one)
            g1 = p.w13_scale_2[e].double() * (xq[t] @ w1.double().t())
            h = (F.silu(g1[inter:]) * g1[:inter]).float()
            hc, hs, _ = nvfp4.quantize_activation(h[None], 1 / p.w2_input_scale[0])
            w2 = nvfp4.dequantize(p.w2[e], nvfp4.unswizzle_128x4(p.w2_scale[e], hidden, inter // 16), one)
            y = p.w2_scale_2[e].double() * (nvfp4.dequantize(hc, hs, one).double() @ w2.double().t())
            out[t] += weights[t, slot].double() * y[0]
    return out


def test_cutlass_moe_layout_reproduces_the_reference():
    hidden, inter = 64, 32
    w = _moe_weights(experts=8, hidden=hidden, inter=inter)
    gen = torch.Generator().manual_seed(5)
    x, logits = torch.randn(5, hidden, generator=gen), torch.randn(5, 8, generator=gen)
    bias = torch.rand(8, generator=gen) * 0.1
    args = (3, 4, 2, True, 2.5)
    got = _emulate_fused_moe(cutlass_moe_layout(w), x, logits, bias, args, hidden, inter)
    ref = S.dense_moe(x, logits, bias, w, *args, numerics="w4a4")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_trtllm_moe_layout_is_the_cutlass_layout_with_rows_permuted():
    w = _moe_weights(experts=2, hidden=128, inter=64)
    gen = torch.Generator().manual_seed(9)
    perm13, perm2 = torch.randperm(128, generator=gen), torch.randperm(128, generator=gen)
    c, t = cutlass_moe_layout(w), trtllm_moe_layout(w, perm13, perm2)
    assert torch.equal(t.w13, c.w13[:, perm13]) and torch.equal(t.w2, c.w2[:, perm2])
    assert t.w13_scale.shape == (2, 128, 8) and t.w2_scale.shape == (2, 128, 4)
    for e in range(2):
        back13 = nvfp4.unswizzle_128x4(t.w13_scale[e], 128, 8).view(torch.uint8)
        assert torch.equal(back13, up_gate(w.w13_scale)[e][perm13].view(torch.uint8))
        back2 = nvfp4.unswizzle_128x4(t.w2_scale[e], 128, 4).view(torch.uint8)
        assert torch.equal(back2, w.w2_scale[e][perm2].view(torch.uint8))
    torch.testing.assert_close(t.w13_scale_2[0], c.w13_scale_2 * c.w2_input_scale)  # output1_scale_scalar
    torch.testing.assert_close(t.w13_scale_2[1], c.w13_scale_2)  # output1_scale_gate_scalar
    torch.testing.assert_close(t.w2_scale_2, c.w2_scale_2)  # output2_scale_scalar


@needs_flashinfer
def test_trtllm_moe_permutations_are_flashinfers():
    from flashinfer.fused_moe.core import _maybe_get_cached_w3_w1_permute_indices, get_w2_permute_indices_with_cache

    from pieceworks.backends.moe.flashinfer import trtllm_moe_permutations

    perm13, perm2 = trtllm_moe_permutations(256, 128)
    w13, w2 = torch.zeros(256, 64, dtype=torch.uint8), torch.zeros(128, 64, dtype=torch.uint8)
    assert torch.equal(perm13, _maybe_get_cached_w3_w1_permute_indices({}, w13, 128))
    assert torch.equal(perm13, _maybe_get_cached_w3_w1_permute_indices({}, w13[:, :8], 128, num_elts_per_sf=16))
    assert torch.equal(perm2, get_w2_permute_indices_with_cache({}, w2, 128))


def test_moe_backends_refuse_unquantized_or_misshaped_experts():
    spec = BackendSpec(device="cuda", capability=(10, 0), modules=frozenset({"flashinfer"}))
    with pytest.raises(ValueError, match="serves NVFP4 experts"):
        FlashInferCutlassMoEBackend(spec).prepare(S.random_moe_weights(4, 64, 32, False, torch.bfloat16,
                                                                        torch.Generator(), CPU))
    with pytest.raises(ValueError, match="multiples of 128"):
        FlashInferTrtllmMoEBackend(spec).prepare(_moe_weights(hidden=64, inter=32))


# ---------------------------------------------------------------- declarations and reasons
ALL = [FlashInferAttentionBackend, FlashInferMLABackend, TrtllmMLABackend, FlashInferCutlassFp4GemmBackend,
       FlashInferCudnnFp4GemmBackend, FlashInferTrtllmFp4GemmBackend, FlashInferCutlassMoEBackend,
       FlashInferTrtllmMoEBackend]
BLACKWELL = {TrtllmMLABackend: "10.x", FlashInferTrtllmFp4GemmBackend: "10.x", FlashInferTrtllmMoEBackend: "10.x",
             FlashInferCutlassFp4GemmBackend: "10.x or 11.x or 12.x",
             FlashInferCudnnFp4GemmBackend: "10.x or 11.x or 12.x",
             FlashInferCutlassMoEBackend: "10.x or 11.x or 12.x"}
DSV3 = ModelFacts(arch="deepseek_v3", dtype=torch.bfloat16, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
                  page_size=64, fp4=True, moe_experts=8, moe_quant="nvfp4")
LLAMA = ModelFacts(dtype=torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.key())
def test_reasons_without_a_gpu(cls):
    reasons = cls.check(BackendSpec(device="cpu", model=DSV3, modules=frozenset()))
    assert "needs device cuda (this run: cpu)" in reasons
    assert any("module 'flashinfer' is not importable" in r for r in reasons)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.key())
def test_reasons_on_hopper(cls):
    model = LLAMA if cls.op == "attention" else DSV3
    reasons = cls.check(BackendSpec(device="cuda", capability=(9, 0), model=model, modules=frozenset({"flashinfer"})))
    if cls in BLACKWELL:
        assert f"needs compute capability {BLACKWELL[cls]} (this GPU: 9.0)" in reasons
    else:
        assert reasons == []  # FlashInfer attention and MLA serve the H200


def test_model_dependent_reasons():
    cuda = dict(device="cuda", capability=(10, 0), modules=frozenset({"flashinfer"}))
    assert TrtllmMLABackend.check(BackendSpec(**cuda, model=DSV3)) == []
    r = TrtllmMLABackend.check(BackendSpec(**cuda, model=replace(DSV3, page_size=16)))
    assert r == ["TRT-LLM MLA needs page_size 32 or 64 (kv_cache page size: 16)"]

    def reasons(cls, model, **change):
        return " ".join(cls.check(BackendSpec(**cuda, model=replace(model, **change))))

    assert "64 < num_heads < 128" in reasons(TrtllmMLABackend, DSV3, num_heads=96)
    assert "at most 128 heads" in reasons(FlashInferMLABackend, DSV3, num_heads=192)
    assert reasons(FlashInferMLABackend, DSV3, num_heads=20) == ""  # planned at 32 (planned_heads)
    assert "head_dim 64, 128 or 256" in reasons(FlashInferAttentionBackend, LLAMA, head_dim=96)
    assert "no sliding-window attention" in reasons(TritonDecodeAttentionBackend, LLAMA, sliding_windows=(0, 512))
    assert reasons(FlashInferAttentionBackend, LLAMA, sliding_windows=(0, 0)) == ""
    assert "no soft-capped attention scores" in reasons(TritonDecodeAttentionBackend, LLAMA, attn_logit_softcap=50.0)
    assert reasons(FlashInferAttentionBackend, LLAMA, sliding_windows=(0, 512), attn_logit_softcap=50.0) == ""
    w4a16 = BackendSpec(**cuda, model=DSV3, fp4_numerics="w4a16")
    assert any("implements w4a4 numerics" in x for x in FlashInferCutlassFp4GemmBackend.check(w4a16))
    assert "float32" in reasons(FlashInferTrtllmFp4GemmBackend, DSV3, dtype=torch.float32)


def test_declarations():
    assert TrtllmMLABackend.graph_modes == {EAGER, FULL}
    assert FlashInferMLABackend.graph_modes == set(GraphMode) == FlashInferAttentionBackend.graph_modes
    assert TrtllmMLABackend.forward_modes == {E, D, M}
    assert {c.numerics for c in ALL if c.op in ("fp4_gemm", "moe")} == {("w4a4",)}
    assert FlashInferTrtllmFp4GemmBackend.weight_layout != FlashInferCutlassFp4GemmBackend.weight_layout
    assert [c.name for c in ALL if c.op == "fp4_gemm"] == ["cutlass", "cudnn", "trtllm"]


def test_variant_option():
    assert resolve_variant("auto", (9, 0)) == "fa3" and resolve_variant("auto", (10, 0)) == "fa2"
    assert resolve_variant("fa2", (9, 0)) == "fa2" and resolve_variant("auto", (8, 0)) == "fa2"
    with pytest.raises(ValueError, match="fa3 needs a Hopper"):
        resolve_variant("fa3", (10, 0))
    # an FP8 KV cache: fa3 reads one only with FP8 queries, so auto is fa2 and fa3 named is refused
    assert resolve_variant("auto", (9, 0), kv_fp8=True) == "fa2"
    with pytest.raises(ValueError, match="fa3 kernels read an FP8 KV cache only with FP8 queries"):
        resolve_variant("fa3", (9, 0), kv_fp8=True)
    with pytest.raises(ValueError, match="use auto, fa2 or fa3"):
        FlashInferOptions(variant="fa4")
    with pytest.raises(ValueError, match="decode_tensor_cores"):
        FlashInferOptions(decode_tensor_cores="no")
    assert parse_options(FlashInferMLABackend, {"decode_tensor_cores": False}).decode_tensor_cores is False
    assert FlashInferOptions().decode_tensor_cores == "auto"
    gqa4 = replace(LLAMA, num_heads=32, num_kv_heads=8)
    gqa8 = replace(LLAMA, num_heads=64, num_kv_heads=8)
    assert resolve_decode_tensor_cores("auto", gqa4) is False and resolve_decode_tensor_cores("auto", gqa8) is True
    assert resolve_decode_tensor_cores(True, gqa4) is True and resolve_decode_tensor_cores(False, gqa8) is False
    assert parse_options(FlashInferMLABackend, {"variant": "fa2"}) == FlashInferOptions("fa2")
    spec = BackendSpec(device="cuda", capability=(9, 0), model=LLAMA, modules=frozenset({"flashinfer"}))
    assert FlashInferAttentionBackend(spec).variant == "fa3"  # building a backend touches no GPU
    assert FlashInferAttentionBackend(spec, FlashInferOptions("fa2")).variant == "fa2"


# ---------------------------------------------------------------- registry: the piecewise fallback
def _resolve(spec, overrides=(), ops=("mla",)):
    cfg = load_config({"model": {"arch": "deepseek_v3"}}, list(overrides))
    return Registry(autoload=False).load().resolve(cfg.backends, spec, ops)


def test_trtllm_mla_pinned_falls_back_to_flashinfer_mla_under_piecewise_graphs(caplog):
    spec = BackendSpec(device="cuda", capability=(10, 0), model=DSV3, modules=frozenset({"flashinfer"}))
    with caplog.at_level(logging.INFO, logger="pieceworks.registry"):
        table = _resolve(spec, ["backends.mla=trtllm"])
    assert table.get("mla", E, EAGER).name == "trtllm"
    assert table.get("mla", D, EAGER).name == "trtllm"
    assert table.get("mla", D, FULL).name == "trtllm"
    for mode in (E, M):
        assert table.get("mla", mode, PW).name == "flashinfer"
        decision = next(d for d in table.decisions if (d.forward_mode, d.graph_mode) == (mode, PW))
        assert decision.fallback_from == "trtllm" and decision.chosen == "flashinfer"
        assert "not safe in piecewise CUDA graphs" in decision.note
    assert "mla extend under piecewise graphs: flashinfer instead of trtllm" in caplog.text
    assert table.get("mla", E, EAGER) is table.get("mla", D, FULL)  # one instance serves every entry


def test_auto_mla_on_blackwell_and_hopper():
    blackwell = BackendSpec(device="cuda", capability=(10, 0), model=DSV3, modules=frozenset({"flashinfer"}))
    table = _resolve(blackwell)
    assert {table.get("mla", m, g).name for m, g in [(E, EAGER), (E, PW), (D, FULL)]} == {"flashinfer"}
    table = _resolve(blackwell, ["backends.mla.decode=trtllm", "backends.mla.extend=flashinfer"])
    assert table.get("mla", D, FULL).name == "trtllm" and table.get("mla", E, PW).name == "flashinfer"
    hopper = replace(blackwell, capability=(9, 0))
    with pytest.raises(SelectionError, match=r"needs compute capability 10\.x \(this GPU: 9\.0\)"):
        _resolve(hopper, ["backends.mla=trtllm"])
    assert _resolve(hopper).get("mla", D, FULL).name == "flashinfer"


def test_auto_attention_for_windowed_and_soft_capped_models():
    """On the H200, `auto` decodes on Triton's attention (prio 110) and extends on FlashInfer; a model with sliding
    windows or soft caps, which Triton's kernel does not declare, decodes on FlashInfer too, not the torch reference;
    GLM-4.7-Flash's 20 MLA heads stay on FlashInfer MLA."""
    hopper = BackendSpec(device="cuda", capability=(9, 0), model=LLAMA, modules=frozenset({"flashinfer", "triton"}))
    assert _resolve(hopper, ops=("attention",)).get("attention", D, FULL).name == "triton"
    for change in ({"sliding_windows": (512, 0)}, {"attn_logit_softcap": 50.0}):
        table = _resolve(replace(hopper, model=replace(LLAMA, **change)), ops=("attention",))
        assert {table.get("attention", m, g).name for m, g in [(D, FULL), (D, EAGER), (E, PW), (M, EAGER)]} == {
            "flashinfer"}, change
    glm = replace(hopper, model=replace(DSV3, num_heads=20))
    assert _resolve(glm).get("mla", D, FULL).name == "flashinfer"


def test_auto_fp4_and_moe_choices():
    ops = ("fp4_gemm", "moe")
    blackwell = BackendSpec(device="cuda", capability=(10, 0), model=DSV3, modules=frozenset({"flashinfer"}))
    table = _resolve(blackwell, ops=ops)
    assert table.get("fp4_gemm", D, FULL).name == "cutlass" and table.get("moe", E, PW).name == "trtllm"
    hopper = _resolve(replace(blackwell, capability=(9, 0)), ops=ops)
    assert hopper.get("fp4_gemm", D, FULL).name != "cutlass" and hopper.get("moe", D, FULL).name == "torch"


def test_kv_write_rows_cpu_path_matches_index_copy():
    from pieceworks.backends.kv_write import write_rows

    g = torch.Generator().manual_seed(0)
    pool = torch.zeros(2, 32, 12)
    qkv = torch.randn(5, 36, generator=g)
    k, v = qkv[:, 12:24], qkv[:, 24:]
    slots = torch.tensor([4, 0, 31, 7, 9])
    write_rows(pool[0], k, pool[1], v, slots)
    assert torch.equal(pool[0, slots], k) and torch.equal(pool[1, slots], v)
    assert int((pool != 0).any(-1).sum()) == 10
    lat = torch.zeros(16, 10)
    write_rows(lat[:, :8], qkv[:3, :8], lat[:, 8:], qkv[:3, 8:10].to(torch.float64), torch.tensor([1, 2, 3]))
    assert torch.equal(lat[1:4], qkv[:3, :10])


def test_kv_bind_rows_writes_each_steps_slots_and_checks_their_count():
    """A bound write (a layer's rows, new slots every step) writes where each call's slots say, and
    refuses slots of another length; on CPU it is index_copy_, and the CUDA kernel says why not."""
    from pieceworks.backends import kv_write_cuda
    from pieceworks.backends.kv_write import bind_rows

    pool = torch.zeros(2, 16, 8)
    k, v = torch.randn(3, 8), torch.randn(3, 8)
    write = bind_rows(pool[0], k, pool[1], v, torch.zeros(3, dtype=torch.int64))
    for slots in ([1, 2, 3], [9, 4, 15]):
        write(torch.tensor(slots))
        assert torch.equal(pool[0, slots], k) and torch.equal(pool[1, slots], v)
    assert int((pool != 0).any(-1).sum()) == 12
    with pytest.raises(ValueError, match="2 slots for 3 new K/V rows"):
        write(torch.tensor([5, 6]))
    assert kv_write_cuda.unsupported(pool[0], k, pool[1], v) == "needs an sm_90+ CUDA device"


def test_nvrtc_arguments_are_packed_by_type():
    import ctypes

    from pieceworks.backends.nvrtc import _pack

    t = torch.zeros(4)
    tmap = (ctypes.c_ubyte * 128)(*range(128))  # a by-value struct (the wgmma GEMM's CUtensorMap)
    params, ptrs = _pack([t, 7, 0.5, tmap])
    assert params[0].value == t.data_ptr() and params[1].value == 7 and params[2].value == 0.5
    assert params[3] is tmap
    assert [ptrs[i] for i in range(4)] == [ctypes.addressof(p) for p in params]
    with pytest.raises(TypeError, match="kernel argument of type str"):
        _pack(["x"])


def test_plan_copy_guard_waits_for_the_same_wrappers_previous_plan(monkeypatch):
    """Before a wrapper plans again, the host waits for the event recorded after its previous plan
    (the pinned schedule buffer's copy); other wrappers' events are not waited on; none in a capture."""
    from pieceworks.backends.attention.flashinfer_fast import PlanCopyGuard

    log = []

    class FakeEvent:
        def __init__(self):
            self.id = len([e for e in log if e[0] == "new"])
            log.append(("new", self.id))

        def record(self):
            log.append(("record", self.id))

        def synchronize(self):
            log.append(("wait", self.id))

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    guard, a, b = PlanCopyGuard(), object(), object()
    guard.before(a)  # first plan: nothing to wait for
    guard.after(a, "cuda")
    guard.before(b)
    guard.after(b, "cuda")
    guard.before(a)
    guard.after(a, "cuda")
    assert log == [("new", 0), ("record", 0), ("new", 1), ("record", 1), ("wait", 0), ("record", 0)]
    guard.after(object(), "cpu")  # CPU plans record nothing
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    guard.after(b, "cuda")
    assert len(log) == 6


def test_triton_decode_attention_splits_and_reasons():
    from pieceworks.backends.attention.triton import TritonDecodeAttentionBackend, num_splits

    assert num_splits(1, 8) == 16 and num_splits(8, 8) == 8 and num_splits(32, 8) == 2 and num_splits(64, 8) == 1
    assert ForwardMode.DECODE in TritonDecodeAttentionBackend.forward_modes
    assert ForwardMode.EXTEND not in TritonDecodeAttentionBackend.forward_modes
    cuda = dict(device="cuda", capability=(9, 0), modules=frozenset({"triton"}))
    ok = ModelFacts(dtype=torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128)
    assert TritonDecodeAttentionBackend.check(BackendSpec(**cuda, model=ok)) == []
    bad = " ".join(TritonDecodeAttentionBackend.check(BackendSpec(**cuda, model=replace(ok, head_dim=96, num_kv_heads=5))))
    assert "head_dim" in bad and "multiple" in bad
    assert "device cuda" in " ".join(TritonDecodeAttentionBackend.check(BackendSpec(device="cpu", model=ok)))
    fp8 = replace(ok, kv_fp8=True)  # the quantizing write's e4m3 type: sm_89 and newer
    assert TritonDecodeAttentionBackend.check(BackendSpec(**cuda, model=fp8)) == []
    ampere = TritonDecodeAttentionBackend.check(BackendSpec(**{**cuda, "capability": (8, 0)}, model=fp8))
    assert ampere == ["quantizes the FP8 KV cache's new rows through Triton's e4m3 type, which needs sm_89 or newer"]


def test_triton_decode_attention_plan_buffers():
    """FULL-graph plans keep one buffer set per batch size at fixed addresses; eager plans of any batch
    size share one set, grown only when a step needs more (and big enough for counters and partials).
    No plan copies sequence lengths: the kernel reads the step's positions."""
    from types import SimpleNamespace

    from pieceworks.backends.attention.triton import TritonDecodeAttentionBackend, num_splits

    facts = ModelFacts(dtype=torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128)
    backend = TritonDecodeAttentionBackend(BackendSpec(device="cpu", model=facts))

    def plan(n, graph=None):
        backend.plan(SimpleNamespace(mode=D, graph_batch_size=graph, num_seqs=n, seq_lens=list(range(5, 5 + n)),
                                     extend_lens=[1] * n, device=torch.device("cpu")))
        return backend._bufs

    first = plan(3, graph=4)
    assert first[:2] == (num_splits(4, 8), 4)  # the graph's batch, padding rows included
    again = plan(2, graph=4)
    assert again is first  # same buffers, same addresses: nothing to refill (lengths come from positions)
    for n in [1, 8, 10, 64, 3, 200, 7]:
        splits, batch, part_o, part_lse, counters = plan(n)
        assert splits == num_splits(n, 8) and batch == n
        assert counters.numel() >= n * 8 and int(counters.abs().sum()) == 0
        assert part_lse.numel() >= n * splits * 8 * 16 and part_o.numel() == part_lse.numel() * 128
    assert backend._eager_bufs[0] == 200  # grown to the largest batch, never shrunk
    with pytest.raises(ValueError, match="decode steps only"):
        backend.plan(SimpleNamespace(mode=E, graph_batch_size=None, num_seqs=1, seq_lens=[3],
                                     device=torch.device("cpu")))


def test_attention_forward_keeps_views_of_replayed_tensors_only():
    """Between piecewise replays a layer's q/k/v/out are the same graph outputs on every step of a size:
    the views the backend cuts of them are kept across steps (and redone when the planned row count
    changes); fresh tensors are never kept. K/V land at each step's slots, padded rows of out end zero."""
    from types import SimpleNamespace

    from pieceworks.core.batch import mark_replayed

    spec = BackendSpec(device="cuda", capability=(9, 0), model=LLAMA, modules=frozenset({"flashinfer"}))
    backend = FlashInferAttentionBackend(spec)
    cache = torch.zeros(2, 4, 16, 8, 128)  # K and V: [pages, page_size, Hkv, D]
    kv = SimpleNamespace(k_cache=lambda layer: cache[0], v_cache=lambda layer: cache[1], fp8=False,
                         scales=[(1.0, 1.0)] * 4)
    backend._wrapper = SimpleNamespace(run=lambda q, kv_caches, out: out.copy_(q * 2))
    gen = torch.Generator().manual_seed(0)
    replayed = [mark_replayed(torch.zeros(4, h, 128)) for h in (32, 8, 8, 32)]  # q, k, v, out of a size-4 piece
    kept = []
    for rows, slots, fresh in ((3, [5, 6, 7, 0], False), (3, [9, 10, 11, 0], False), (2, [20, 21, 0, 0], False),
                               (4, [30, 31, 32, 33], True)):
        q, k, v, out = [torch.empty(t.shape) for t in replayed] if fresh else replayed
        for t in (q, k, v, out):
            t.copy_(torch.randn(t.shape, generator=gen))
        backend._meta = SimpleNamespace(slot_mapping=torch.tensor(slots))
        backend._rows = rows
        backend.forward(q, k, v, out, 0, LLAMA.head_dim**-0.5, kv)
        flat_k, flat_v = cache[0].view(-1, 8, 128), cache[1].view(-1, 8, 128)
        assert torch.equal(flat_k[slots[:rows]], k[:rows]) and torch.equal(flat_v[slots[:rows]], v[:rows])
        assert torch.equal(out[:rows], q[:rows] * 2) and not out[rows:].any()
        assert backend._bound[0][0] is replayed[0] and backend._bound[0][5] == (2 if fresh else rows)
        kept.append(backend._bound[0])
    assert kept[0] is kept[1] and kept[2] is not kept[1] and kept[3] is kept[2]  # rebuilt only for new rows


def test_attention_forward_on_an_fp8_pool_quantizes_and_passes_each_layers_scales():
    """An FP8 pool: plans name e4m3 K/V (fa2 under auto), the step's K/V are stored as quantize_kv with the
    layer's scales, and run() gets that layer's k_scale / v_scale (none where they are 1.0: FastRun's case)."""
    from types import SimpleNamespace

    from pieceworks.core.kv import KV_FP8, KVLayout, quantize_kv
    from pieceworks.executor.kv_cache import KVPool

    spec = BackendSpec(device="cuda", capability=(9, 0), model=replace(LLAMA, kv_fp8=True),
                       modules=frozenset({"flashinfer"}))
    backend = FlashInferAttentionBackend(spec)
    assert backend.variant == "fa2" and backend._plan_args(16)[1]["kv_data_type"] == KV_FP8
    pool = KVPool(KVLayout("gqa", 2, 8, 128), 4, 16, KV_FP8, "cpu", scales=[(0.5, 0.25), (1.0, 1.0)])
    calls = []
    backend._wrapper = SimpleNamespace(run=lambda q, kv_caches, out, **kw: calls.append(kw) or out.copy_(q))
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 32, 128, generator=gen), torch.randn(2, 8, 128, generator=gen), torch.randn(2, 8, 128)
    backend._meta, backend._rows = SimpleNamespace(slot_mapping=torch.tensor([5, 6])), 2
    for layer, (ks, vs) in enumerate(pool.scales):
        backend.forward(q, k, v, torch.empty_like(q), layer, LLAMA.head_dim**-0.5, pool)
        assert calls[-1] == ({} if (ks, vs) == (1.0, 1.0) else {"k_scale": ks, "v_scale": vs})
        stored_k, stored_v = pool.k_cache(layer).view(-1, 8, 128)[5:7], pool.v_cache(layer).view(-1, 8, 128)[5:7]
        assert torch.equal(stored_k.view(torch.uint8), quantize_kv(k, ks).view(torch.uint8))
        assert torch.equal(stored_v.view(torch.uint8), quantize_kv(v, vs).view(torch.uint8))


def test_mla_auto_variant_takes_fa2_where_fa3_lacks_the_latent_width():
    """On Hopper `auto` is fa3, but fa3's MLA kernels take kv_lora_rank 128 / 256 / 512 only: another width
    runs fa2 under auto, and an explicit fa3 is refused with the fix in the message."""
    spec = BackendSpec(device="cuda", capability=(9, 0), model=replace(DSV3, kv_lora_rank=384),
                       modules=frozenset({"flashinfer"}))
    assert FlashInferMLABackend(spec, parse_options(FlashInferMLABackend, {})).variant == "fa2"
    with pytest.raises(ValueError, match="variant=fa2"):
        FlashInferMLABackend(spec, parse_options(FlashInferMLABackend, {"variant": "fa3"}))
    dsv3 = replace(spec, model=DSV3)
    assert FlashInferMLABackend(dsv3, parse_options(FlashInferMLABackend, {})).variant == "fa3"


def test_flashinfer_plans_each_sliding_window_in_a_lane_of_its_own():
    """FlashInfer plans one window per wrapper (`window_left` = W - 1): the layers of a second window value run
    in a lane with wrappers of its own, planned with the step; soft caps go into every plan; the lanes share
    the workspace; a model without windows keeps one lane and plans as before."""
    from types import SimpleNamespace

    class Wrapper:
        def __init__(self, name):
            self.name, self.plans, self.ran = name, [], []

        def plan(self, *args, **kw):
            self.plans.append((args, kw))

        def run(self, q, kv_caches, out):
            self.ran.append(q.shape[0])
            out.copy_(q * len(self.name))

    gemma = replace(LLAMA, sliding_windows=(512, 0, 512, 4096), attn_logit_softcap=50.0)
    spec = BackendSpec(device="cuda", capability=(9, 0), model=gemma, modules=frozenset({"flashinfer"}))
    root = FlashInferAttentionBackend(spec)
    assert root._window == 0 and sorted(root._lanes) == [512, 4096]
    assert root._lane_of == {0: root._lanes[512], 2: root._lanes[512], 3: root._lanes[4096]}
    lanes = {0: root, 512: root._lanes[512], 4096: root._lanes[4096]}
    for w, lane in lanes.items():
        lane._decode = Wrapper("x" * (1 + len(str(w))))  # run() scales q by the name's length: 2, 4, 5
        assert lane._ws(CPU) is root._ws(CPU)
    meta = StepMetadata(mode=D, graph_mode=EAGER, extend_lens=[1, 1], prefix_lens=[20, 40], page_size=16,
                        page_table=torch.tensor([[1, 2, 0], [3, 4, 5]], dtype=torch.int32),
                        slot_mapping=torch.tensor([20 + 16, 40 + 80]), positions=torch.tensor([20, 40]),
                        page_lists=[[1, 2], [3, 4, 5]])
    root.plan(meta)
    for w, lane in lanes.items():
        (args, kw), = lane._decode.plans
        assert args[3:] == (32, 8, 128, 16) and kw["logits_soft_cap"] == 50.0
        assert kw.get("window_left", -1) == (w - 1 if w else -1)
    cache = torch.zeros(2, 8, 16, 8, 128)
    kv = SimpleNamespace(k_cache=lambda layer: cache[0], v_cache=lambda layer: cache[1], fp8=False,
                         scales=[(1.0, 1.0)] * 4)
    q, k, v = torch.randn(2, 32, 128), torch.randn(2, 8, 128), torch.randn(2, 8, 128)
    for layer, factor in enumerate((4, 2, 4, 5)):
        out = torch.empty_like(q)
        root.forward(q, k, v, out, layer, 128**-0.5, kv)
        assert torch.equal(out, q * factor), layer
    assert [len(lane._decode.ran) for lane in lanes.values()] == [1, 2, 1]
    # long sequences: each windowed lane plans the pages from its window's first one on; the full lane all of them
    meta = replace(meta, prefix_lens=[1000, 5000], page_lists=[list(range(1, 64)), list(range(64, 377))], _cache={},
                   page_table=torch.zeros(2, 313, dtype=torch.int32))
    for lane in lanes.values():
        lane._decode.plans.clear()
    root.plan(meta)
    for w, lane in lanes.items():
        (args, kw), = lane._decode.plans
        drop = [max(0, p - w + 1) // 16 if w else 0 for p in (1000, 5000)]
        counts = [-(-(p + 1 - 16 * d) // 16) for p, d in zip((1000, 5000), drop)]
        assert args[0].tolist() == [0, counts[0], sum(counts)], w
        assert args[1].tolist() == meta.page_lists[0][drop[0]:][: counts[0]] + meta.page_lists[1][drop[1]:], w
        assert args[2].tolist() == [(1001 - 1) % 16 + 1, (5001 - 1) % 16 + 1]  # the last page's tokens: unchanged
    assert lanes[512]._meta.prefix_lens == [1000 - 16 * 30, 5000 - 16 * 280] and root._meta is meta
    # windows only: the lanes plan the step as it came, not as the first lane's window cut it
    spec = BackendSpec(device="cuda", capability=(9, 0), model=replace(gemma, sliding_windows=(512, 4096)),
                       modules=frozenset({"flashinfer"}))
    root = FlashInferAttentionBackend(spec)
    root._decode, root._lanes[4096]._decode = Wrapper("a"), Wrapper("b")
    root.plan(meta)
    assert root._meta.prefix_lens == [520, 520] and root._lanes[4096]._meta.prefix_lens == [1000, 5000 - 16 * 56]
    plain = FlashInferAttentionBackend(BackendSpec(device="cuda", capability=(9, 0), model=LLAMA,
                                                   modules=frozenset({"flashinfer"})))
    assert plain._lanes == {} and plain._window == 0
    assert set(plain._plan_args(16)[1]) == {"q_data_type", "kv_data_type", "sm_scale"}


def test_flashinfer_mla_pads_heads_to_a_count_it_plans():
    """FlashInfer's MLA plans take head counts dividing 64, or 128: GLM-4.7-Flash's 20 heads (10 per rank under
    tensor parallel 2) are planned at 32 (16), the queries padded with zero heads, the real heads' output kept
    and padded rows of out zeroed."""
    from types import SimpleNamespace

    from pieceworks.backends.mla.flashinfer import planned_heads

    assert [planned_heads(h) for h in (1, 3, 4, 10, 16, 20, 33, 64, 65, 96, 128)] == [
        1, 4, 4, 16, 16, 32, 64, 64, 128, 128, 128]
    spec = BackendSpec(device="cuda", capability=(9, 0), model=replace(DSV3, num_heads=20),
                       modules=frozenset({"flashinfer"}))
    backend = FlashInferMLABackend(spec, parse_options(FlashInferMLABackend, {}))
    seen = {}

    def run(query, kv_cache, out):
        seen["q"] = query
        out.copy_(query[0] * 2)

    backend._wrapper = SimpleNamespace(run=run)
    backend._rows, backend._sm_scale = 3, 0.125
    backend._meta = SimpleNamespace(slot_mapping=torch.tensor([1, 2, 3, 0]))
    cache = torch.zeros(2, 16, 576)
    kv = SimpleNamespace(latent_cache=lambda layer: cache)
    q_nope, q_pe = torch.randn(4, 20, 512), torch.randn(4, 20, 64)
    c_kv, k_pe = torch.randn(4, 512), torch.randn(4, 64)
    out = torch.full((4, 20, 512), float("nan"))
    backend.forward(q_nope, q_pe, c_kv, k_pe, out, 0, 0.125, kv)
    qn, qp = seen["q"]
    assert qn.shape == (3, 32, 512) and qp.shape == (3, 32, 64)
    assert torch.equal(qn[:, :20], q_nope[:3]) and not qn[:, 20:].any() and not qp[:, 20:].any()
    assert torch.equal(out[:3], q_nope[:3] * 2) and not out[3:].any()
    assert torch.equal(cache.view(-1, 576)[[1, 2, 3]], torch.cat([c_kv, k_pe], -1)[:3])


@pytest.mark.parametrize("sc", S.ATTENTION_SCENARIOS, ids=lambda s: s.name)
def test_window_view_leaves_the_windowed_attention_unchanged(sc):
    """`window_view` drops each sequence's pages wholly before its window and shortens its KV length by as many
    tokens: attention with the queries aligned to the end of the shorter KV (as FlashInfer's kernels align them)
    equals attention over the whole sequence, for windows shorter and longer than the prefix."""
    from pieceworks.backends.attention.flashinfer import window_view
    from pieceworks.backends.attention.torch import attend

    case = S.attention_case(sc, 4, 2, 16, torch.float32, CPU)
    kc, vc = case.pool.k_cache(0), case.pool.v_cache(0)
    meta, (q, k, v) = case.meta, (case.inputs[n] for n in "qkv")
    kc.view(-1, 2, 16)[meta.slot_mapping] = k  # the step's own K/V, as a backend writes them first
    vc.view(-1, 2, 16)[meta.slot_mapping] = v
    cut = 0
    assert meta.seq_lens_tensor().tolist() == meta.seq_lens  # cached on the step: a view must not share it
    for window in (1, 3, 17, 40, 5000):
        view = window_view(meta, window)
        assert view.seq_lens_tensor().tolist() == view.seq_lens
        lo = 0
        for i, n in enumerate(meta.extend_lens):
            rows = slice(lo, lo + n)
            lo += n
            got = []
            for m in (meta, view):
                p, pages = m.prefix_lens[i], m.page_lists[i]
                keys, vals = kc[pages].flatten(0, 1)[: p + n], vc[pages].flatten(0, 1)[: p + n]
                got.append(attend(q[rows], keys, vals, 0.25, p, window))
            torch.testing.assert_close(got[1], got[0], rtol=1e-6, atol=1e-6)
            cut += meta.prefix_lens[i] - view.prefix_lens[i]
            ps = meta.page_size
            assert meta.prefix_lens[i] - view.prefix_lens[i] == max(0, meta.prefix_lens[i] - window + 1) // ps * ps
    assert cut > 0 or max(meta.prefix_lens) < meta.page_size
