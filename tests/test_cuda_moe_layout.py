"""The CUDA fused MoE's preparation on the CPU: expert repacking, refusals, registration (its kernels run in
tests/gpu/test_cuda_moe.py)."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.fp4_gemm import r16c64
from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up
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
    from pieceworks.backends.moe.cuda_experts import one_token_blocks

    sorted_ids, num_post = one_token_blocks(3, torch.device("cpu"))
    assert sorted_ids.tolist() == [0] + [3] * 7 + [1] + [3] * 7 + [2] + [3] * 7
    assert sorted_ids.dtype == torch.int32 and num_post.tolist() == [24]
    assert one_token_blocks(3, torch.device("cpu"))[0] is sorted_ids  # built once: fixed addresses


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
    with pytest.raises(ValueError, match="layout"):
        cuda_kernels.moe_gemm(x, codes, scales, torch.ones(4, 2), 32, ids, eids, post, 6, 2, out, layout="k64")


# --- the kernel's MoE modes on the Triton MoE's k32 experts (moe.triton's decode path) ------------------------


def _triton_prepared(experts, hidden, inter, seed):
    from pieceworks.backends.moe.triton import TritonMoEBackend

    w = _weights(experts, hidden, inter, seed)
    return w, TritonMoEBackend(BackendSpec(device="cuda", capability=(9, 0))).prepare(w)


def _lane_rows(flat, sflat, idx):
    """The codes (32, slot-major: slot j of unit u at 8 j + u) and scale pair a lane reads at U4 / u16 index idx."""
    from pieceworks.backends.fp4_gemm.k32 import decode_slots

    vec = flat[16 * idx : 16 * idx + 16].to(torch.int32)
    slots = decode_slots(vec[0::2] | (vec[1::2] << 8))
    return torch.stack(slots).flatten(), sflat[2 * idx : 2 * idx + 2]


def _group_elements(kb, t):
    """The elements of K that `_lane_rows`' 32 codes are, for group t of K block kb (`k32.element_of`), and its
    two blocks (scale pair: block t, block t + 4)."""
    from pieceworks.backends.fp4_gemm.k32 import element_of

    elements = torch.tensor([128 * kb + element_of(t, j, u) for j in range(4) for u in range(8)])
    return elements, torch.tensor([8 * kb + t, 8 * kb + t + 4])


@pytest.mark.parametrize("inter", [64, 80])  # 80: each half padded to 128 rows
def test_k32_gate_up_halves_addressing(inter):
    """MOE 1 with SwiGLU on k32 (cuda_decode_kernel.py, HALVES), followed in torch on the Triton MoE's prepared
    experts: expert e starts at U4 e * gridDim.x * nchunks * 64; lane (g, t) of CTA b reads K block kb of its
    row g at ((b >> 3) * nchunks + kb) * 256 + (8 (b & 7) + g) * 4 + t and of its row g + 8 (gridDim.x >> 3)
    * nchunks * 256 further: gate row 8 b + g and up row 8 b + g of the checkpoint (zero past I), so the
    epilogue's rows j and j + 8 are output column 8 b + j's gate and up."""
    from pieceworks.backends.moe.cuda_kernels import expert_geometry

    hidden = 576  # Kp = 1024: K blocks 4.5 .. 7 are padding
    w, p = _triton_prepared(3, hidden, inter, 4)
    rg, nchunks, kp = expert_geometry(p.w13, "k32")
    ip = -(-inter // 64) * 64
    assert (rg, nchunks, kp) == (2 * ip // 16, 8, 1024) and rg % 8 == 0
    ref = torch.nn.functional.pad(nvfp4.unpack(w.w13), (0, kp - hidden))  # [E, 2I, Kp]
    ref_s = torch.nn.functional.pad(w.w13_scale.view(torch.uint8), (0, (kp - hidden) // 16))
    flat, sflat = p.w13.reshape(-1), p.w13_scale.view(torch.uint8).reshape(-1)
    for e in range(3):
        for b in range(rg):
            for kb in (0, 3, 4, nchunks - 1):
                for g in range(8):
                    for t in range(4):
                        idx = e * rg * nchunks * 64 + ((b >> 3) * nchunks + kb) * 256 + (8 * (b & 7) + g) * 4 + t
                        col = 8 * b + g
                        for half, row in ((0, col), (1, inter + col)):
                            codes, pair = _lane_rows(flat, sflat, idx + half * (rg >> 3) * nchunks * 256)
                            elements, blocks = _group_elements(kb, t)
                            want = ref[e, row, elements] if col < inter else torch.zeros(32, dtype=torch.uint8)
                            assert torch.equal(codes.to(torch.uint8), want), (e, b, kb, g, t, half)
                            want_s = ref_s[e, row, blocks] if col < inter else torch.zeros(2, dtype=torch.uint8)
                            assert torch.equal(pair, want_s)


def test_k32_down_expert_offsets():
    """MOE 1 (down) and MOE 2 on k32: expert e's rows at U4 e * gridDim.x * nchunks * 64, then the dense k32
    addressing (tests/test_cuda_fp4_layout.py) within the expert."""
    from pieceworks.backends.moe.cuda_kernels import expert_geometry

    w, p = _triton_prepared(3, 128, 192, 5)  # down: N 128 (2 row blocks), K 192 -> Kp 512
    rg, nchunks, kp = expert_geometry(p.w2, "k32")
    assert (rg, nchunks, kp) == (8, 4, 512)
    ref = torch.nn.functional.pad(nvfp4.unpack(w.w2), (0, kp - 192))
    flat, sflat = p.w2.reshape(-1), p.w2_scale.view(torch.uint8).reshape(-1)
    for e in range(3):
        for b in range(rg):
            for kb in range(nchunks):
                for g in range(8):
                    for t in range(4):
                        idx = e * rg * nchunks * 64 + ((b >> 2) * nchunks + kb) * 256 + (16 * (b & 3) + g) * 4 + t
                        for half in (0, 1):
                            codes, _ = _lane_rows(flat, sflat, idx + 32 * half)
                            row = 64 * (b >> 2) + 16 * (b & 3) + g + 8 * half
                            assert torch.equal(codes.to(torch.uint8), ref[e, row, _group_elements(kb, t)[0]])


def test_k32_wrappers_and_triton_moe_option():
    """Runs on the CPU: the k32 launches' checks, and moe.triton's option for its CUDA decode path."""
    from pieceworks.backends.base import parse_options
    from pieceworks.backends.fp4_gemm.triton import TritonTileOptions
    from pieceworks.backends.moe import cuda_kernels
    from pieceworks.backends.moe.triton import TritonMoEBackend

    _, p = _triton_prepared(4, 128, 64, 6)  # w13 [4, 128, 256] (Kp 512), w2 [4, 128, 256]
    ids, post = torch.zeros(16, dtype=torch.int32), torch.tensor([16], dtype=torch.int32)
    eids = torch.zeros(2, dtype=torch.int32)
    out = torch.zeros(6, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be bf16 \[rows, 512\]"):  # x not padded to Kp
        cuda_kernels.moe_gemm(torch.zeros(3, 128, dtype=torch.bfloat16), p.w13, p.w13_scale, p.w13_scale_2, 128,
                              ids, eids, post, 6, 2, out, layout="k32")
    x = torch.zeros(3, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="both halves"):  # n must cover both halves
        cuda_kernels.moe_gemm(x, p.w13, p.w13_scale, p.w13_scale_2, 64, ids, eids, post, 6, 2, out, layout="k32")
    with pytest.raises(ValueError, match="k32 experts are"):  # r16c64-shaped codes
        cuda_kernels.moe_gemm(x, torch.zeros(4, 2, 2, 512, dtype=torch.uint8), p.w13_scale, p.w13_scale_2, 128,
                              ids, eids, post, 6, 2, out, layout="k32")
    with pytest.raises(ValueError, match=r"h must be bf16 \[top_k, 512\]"):
        cuda_kernels.moe_down_one_token(torch.zeros(2, 64, dtype=torch.bfloat16), p.w2, p.w2_scale,
                                        p.w2_scale_2, 128, eids, torch.ones(2), out[:1], 2, layout="k32")
    assert TritonTileOptions().cuda_moe_max_t == 128
    assert parse_options(TritonMoEBackend, {"cuda_moe_max_t": 0}).cuda_moe_max_t == 0
    for bad in (-1, 1025, True, 2.0, "8"):
        with pytest.raises(ValueError, match="cuda_moe_max_t"):
            TritonTileOptions(cuda_moe_max_t=bad)


def test_moe_register_cap_only_where_it_adds_resident_ctas():
    """`resident_cap_moe`: a cap (MINB) only where the registers ptxas picks hold fewer CTAs per SM than the grid
    needs and a 64-register cap (32 / warps per SM) would give."""
    from pieceworks.backends.moe.cuda_kernels import resident_cap_moe

    class Run:  # the occupancy calculator's answer for a kernel compiled without a cap
        def __init__(self, blocks):
            self.blocks = blocks

        def resident_blocks(self, threads):
            return self.blocks

    assert resident_cap_moe(Run(14), 2, 2048, 132) == 16  # 72 registers: 1848 of 2048 resident -> capped
    assert resident_cap_moe(Run(18), 2, 2048, 132) == 0  # 56 registers: all resident already
    assert resident_cap_moe(Run(14), 2, 8192, 132) == 16  # never all resident: 16 per SM instead of 14
    assert resident_cap_moe(Run(16), 2, 8192, 132) == 0  # 63 registers: the cap would add none
    assert resident_cap_moe(Run(14), 2, 1000, 132) == 0  # 8 per SM needed, 14 held
    assert resident_cap_moe(Run(3), 8, 448, 132) == 4  # 8-warp CTAs: at most 4 per SM under the cap


def test_triton_moe_sends_decode_steps_to_the_cuda_path(monkeypatch):
    """moe.triton's `experts`: T <= cuda_moe_max_t goes to `grouped_experts(..., "k32")` where the CUDA decode
    kernel runs; larger T, an explicit tile (sweeps), option 0, or a reason (here: the CPU) go to the Triton
    kernels. Both paths stubbed: this checks the choice, the GPU tests check the kernels."""
    import sys
    import types

    from pieceworks.backends import moe as moe_pkg
    from pieceworks.backends.fp4_gemm.triton import TritonTileOptions
    from pieceworks.backends.moe import cuda_experts, triton as moe_triton

    calls = []
    monkeypatch.setattr(cuda_experts, "grouped_experts", lambda x, tw, ids, w, layout: calls.append(("cuda", layout)))
    fake = types.SimpleNamespace(align_gpu=lambda ids, e, bm, nb: (None, None, None),
                                 fused_moe=lambda *a: calls.append(("triton", a[-1].block_m)))
    monkeypatch.setitem(sys.modules, "pieceworks.backends.moe.triton_kernels", fake)  # no triton needed
    monkeypatch.setattr(moe_pkg, "triton_kernels", fake, raising=False)
    _, p = _triton_prepared(4, 128, 64, 7)
    spec = BackendSpec(device="cuda", capability=(9, 0))

    def run(tokens, max_t, reason=None, tile=None):
        monkeypatch.setattr(moe_triton, "cuda_decode_reason", lambda x: reason)
        backend = moe_triton.TritonMoEBackend(spec, TritonTileOptions(cuda_moe_max_t=max_t))
        calls.clear()
        x = torch.zeros(tokens, 128, dtype=torch.bfloat16)
        backend.experts(x, torch.ones(tokens, 2), torch.zeros(tokens, 2, dtype=torch.int32), p, tile)
        return calls[0][0]

    assert run(4, 4) == "cuda" and calls[0][1] == "k32"
    assert run(5, 4) == "triton"
    assert run(1, 0) == "triton"
    assert run(1, 128, reason="the CUDA decode kernel runs on CUDA devices, not cpu") == "triton"
    tile = moe_triton.TritonMoEBackend(spec).tile(1)
    assert run(1, 128, tile=tile) == "triton" and calls[0][1] == tile.block_m


def test_grouped_experts_without_tokens_launches_nothing():
    """Zero tokens: an empty result before any import of the kernels or launch (a grid with no blocks fails)."""
    from pieceworks.backends.moe.cuda_experts import grouped_experts

    _, p = _triton_prepared(2, 128, 64, 8)
    x = torch.zeros(0, 128, dtype=torch.bfloat16)
    y = grouped_experts(x, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32), p, "k32")
    assert y.shape == (0, 128) and y.dtype == torch.bfloat16
