"""The CUDA fused MoE's preparation on the CPU: expert repacking, refusals, registration (its kernels run in
tests/gpu/test_cuda_moe.py)."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.fp4_gemm import r16c64
from pieceworks.backends.fp4_gemm.triton import interleave_gate_up
from pieceworks.backends.moe.cuda import CudaMoEBackend, repack_experts
from pieceworks.quant import nvfp4
from pieceworks.testing import scenarios as S


def _weights(experts=3, hidden=128, inter=64, seed=0):
    return S.random_moe_weights(experts, hidden, inter, True, torch.bfloat16, torch.Generator().manual_seed(seed),
                                torch.device("cpu"))


def test_prepare_repacks_each_expert_with_gate_and_up_interleaved():
    w = _weights()
    p = CudaMoEBackend(BackendSpec(device="cuda", capability=(9, 0))).prepare(w)
    rows = interleave_gate_up(w.w13.shape[1])
    for e in range(w.w13.shape[0]):
        codes, scales = r16c64.repack_decode(w.w13[e][rows], w.w13_scale[e][rows])
        assert torch.equal(p.w13[e], codes) and torch.equal(p.w13_scale[e], scales)
        codes, scales = r16c64.repack_decode(w.w2[e], w.w2_scale[e])
        assert torch.equal(p.w2[e], codes) and torch.equal(p.w2_scale[e], scales)
    assert p.w13.shape == (3, 128 // 16, 128 // 64, 512) and p.w2.shape == (3, 128 // 16, 64 // 64, 512)
    assert p.w13_scale_2.shape == (3, 2) and p.w2_scale_2.shape == (3,)
    # the kernel's gate / up global scales: unchanged per expert
    assert torch.equal(p.w13_scale_2, w.w13_scale_2.float())
    codes, _ = r16c64.unpack_decode(p.w13[1], p.w13_scale[1], 128, 128)
    plain = nvfp4.unpack(w.w13[1])
    assert torch.equal(codes[0::2], plain[:64]) and torch.equal(codes[1::2], plain[64:])  # gate j, up j


def test_repack_experts_without_rows_is_the_per_expert_repack():
    w = _weights(experts=2, hidden=64, inter=64, seed=2)
    codes, scales = repack_experts(w.w2, w.w2_scale)
    for e in range(2):
        c, s = r16c64.repack_decode(w.w2[e], w.w2_scale[e])
        assert torch.equal(codes[e], c) and torch.equal(scales[e], s)


def test_refusals_and_requirements():
    backend = CudaMoEBackend(BackendSpec(device="cuda", capability=(9, 0)))
    with pytest.raises(ValueError, match="multiples of 64"):
        backend.prepare(_weights(hidden=128, inter=48))
    with pytest.raises(ValueError, match="multiples of 64"):
        backend.prepare(_weights(hidden=96, inter=64))
    bf16 = S.random_moe_weights(2, 64, 64, False, torch.bfloat16, torch.Generator().manual_seed(1),
                                torch.device("cpu"))
    with pytest.raises(ValueError, match="NVFP4"):
        backend.prepare(bf16)
    facts = ModelFacts(arch="deepseek_v3", dtype=torch.bfloat16, fp4=True, moe_experts=8, moe_quant="nvfp4")
    assert any("cuda" in r for r in CudaMoEBackend.check(BackendSpec(device="cpu", model=facts)))
    old = ModelFacts(arch="deepseek_v3", dtype=torch.float16, fp4=True, moe_experts=8, moe_quant="nvfp4")
    reasons = CudaMoEBackend.check(BackendSpec(device="cuda", capability=(8, 0), model=old))
    assert any("9.0" in r for r in reasons) and any("bf16" in r for r in reasons)


def test_selected_by_config_beside_the_cuda_gemm_and_sharing_its_options():
    """`backends.moe: cuda` with `backends.options.cuda` set for fp4_gemm.cuda: the shared options parse."""
    from pieceworks.backends.base import parse_options

    opts = parse_options(CudaMoEBackend, {"fuse_norm": True, "decode_max_m": 32})
    assert CudaMoEBackend(BackendSpec(device="cuda", capability=(9, 0)), opts).options.decode_max_m == 32


def test_one_token_blocks():
    """A one-token step's blocks: pair b alone in block b (padding id top_k), num_post covering them all."""
    backend = CudaMoEBackend(BackendSpec(device="cuda", capability=(9, 0)))
    sorted_ids, num_post = backend._one_token_blocks(3, torch.device("cpu"))
    assert sorted_ids.tolist() == [0] + [3] * 7 + [1] + [3] * 7 + [2] + [3] * 7
    assert sorted_ids.dtype == torch.int32 and num_post.tolist() == [24]
    assert backend._one_token_blocks(3, torch.device("cpu"))[0] is sorted_ids  # built once: fixed addresses


def test_kernel_wrappers_refuse_bad_arguments_before_any_launch():
    """Runs on the CPU: the grouped GEMM and the one-token down launch check their arguments first."""
    from pieceworks.backends.moe import cuda_kernels

    codes = torch.zeros(4, 2, 2, 512, dtype=torch.uint8)  # 4 experts, 32 rows, K 128
    scales = torch.zeros(4, 2, 2, 64, dtype=torch.uint8)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    ids, post = torch.zeros(16, dtype=torch.int32), torch.tensor([16], dtype=torch.int32)
    eids = torch.zeros(2, dtype=torch.int32)
    out = torch.zeros(6, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        cuda_kernels.moe_gemm(torch.zeros(3, 96, dtype=torch.bfloat16), codes, scales, torch.ones(4, 2), 32, ids,
                             eids, post, 6, 2, out)
    with pytest.raises(ValueError, match="gscale"):
        cuda_kernels.moe_gemm(x, codes, scales, torch.ones(4), 32, ids, eids, post, 6, 2, out)  # SwiGLU: [E, 2]
    with pytest.raises(ValueError, match="8 pair ids per block"):
        cuda_kernels.moe_gemm(x, codes, scales, torch.ones(4, 2), 32, ids[:12], eids, post, 6, 2, out)
    with pytest.raises(ValueError, match="int32 or int64"):
        cuda_kernels.moe_gemm(x, codes, scales, torch.ones(4, 2), 32, ids, eids.float(), post, 6, 2, out)
    h, w = torch.zeros(2, 128, dtype=torch.bfloat16), torch.ones(2)
    one = torch.zeros(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of top_k"):
        cuda_kernels.moe_down_one_token(h, codes, scales, torch.ones(4), 32, eids, w, one, warps=3)
    with pytest.raises(ValueError, match="topk_ids"):
        cuda_kernels.moe_down_one_token(h, codes, scales, torch.ones(4), 32, eids[:1], w, one, warps=2)
    with pytest.raises(ValueError, match="topk_weights"):
        cuda_kernels.moe_down_one_token(h, codes, scales, torch.ones(4, 2), 32, eids, w, one, warps=2)
