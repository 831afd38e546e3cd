"""The CPU side of the Triton NVFP4 backends: tile tables, the k32 repack and its decode bit math, split-K
choice, and the MoE block alignment. No triton needed: the kernels themselves are tested on the GPU
(tests/gpu/test_triton_fp4.py)."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends.base import BackendSpec
from pieceworks.backends.fp4_gemm.triton import (
    SLOT_BITS,
    TileConfig,
    TritonFp4GemmBackend,
    choose_split_k,
    parse_table,
    repack_k32,
    select_tile,
    unpack_k32,
)
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES, MOE_TILES
from pieceworks.backends.moe.triton import TritonMoEBackend, moe_align, num_aligned_blocks
from pieceworks.quant import nvfp4


def random_fp4(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 4
    return nvfp4.quantize_weight(w)


# --- tile tables ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [FP4_GEMM_TILES, MOE_TILES], ids=["fp4_gemm", "moe"])
def test_shipped_tables_parse_and_cover_every_m(rows):
    table = parse_table(rows)
    for m in (1, 2, 4, 16, 17, 64, 65, 256, 1000, 4096, 16384, 10**6):
        tile = select_tile(table, m)
        assert tile.max_m is None or m <= tile.max_m
        earlier = [t for t in table if t.max_m is not None and t.max_m < (tile.max_m or 10**9)]
        assert all(m > t.max_m for t in earlier), "a smaller bucket should have been taken"
        if tile.kind == "fused":
            assert tile.block_k % 32 == 0 and tile.block_m >= 16 and tile.block_n >= 16


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="ending with max_m=None"):
        parse_table([dict(max_m=16)])
    with pytest.raises(ValueError, match="out of order"):
        parse_table([dict(max_m=64), dict(max_m=16), dict(max_m=None)])
    with pytest.raises(ValueError, match="multiple of 32"):
        TileConfig(block_k=48)
    with pytest.raises(ValueError, match="kind"):
        TileConfig(kind="autotune")


def test_split_k_choice():
    tile = TileConfig(block_m=16, block_n=64, block_k=256, target_ctas=264, max_split=8)
    # 4096 rows -> 64 tiles: split 16 iterations into 4 (divides evenly, ~264 programs).
    assert choose_split_k(tile, 1, 4096, 4096) == 4
    # Enough tiles already: no split.
    assert choose_split_k(tile, 1, 28672, 4096) == 1
    # Never more than max_split, never below two iterations per split.
    assert choose_split_k(tile, 1, 64, 14336) == 8
    assert choose_split_k(tile, 1, 64, 512) == 1
    # Splits are equal: 14 iterations and 5 wanted -> 2 (the largest divisor up to 5).
    assert choose_split_k(tile, 1, 4096, 14 * 256) == 2
    for n, k in [(4096, 4096), (6144, 14336), (100, 512 * 7)]:
        split = choose_split_k(tile, 1, n, k)
        assert (k // 256) % split == 0
    assert choose_split_k(TileConfig(kind="dequant"), 1, 64, 4096) == 1


# --- k32 repack --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 16), (3, 32), (5, 48), (8, 4096), (7, 4112)])
def test_repack_roundtrip_and_padding(n, k):
    packed, scale, _ = random_fp4(n, k, seed=n + k)
    w, s = repack_k32(packed, scale, chunk_rows=3)
    kp = -(-k // 512) * 512
    assert w.shape == (n, kp // 2) and w.dtype == torch.uint8
    assert s.shape == (n, kp // 16) and s.dtype == torch.float8_e4m3fn
    assert torch.equal(unpack_k32(w, k), nvfp4.unpack(packed))
    assert torch.equal(unpack_k32(w, kp)[:, k:], torch.zeros(n, kp - k, dtype=torch.uint8))
    assert torch.equal(s[:, : k // 16].view(torch.uint8), scale.view(torch.uint8))
    assert not s[:, k // 16 :].float().any()


def test_repack_keeps_leading_dims():
    packed, scale, _ = random_fp4(6 * 4, 64)
    w, s = repack_k32(packed.view(6, 4, 32), scale.view(6, 4, 4))
    flat_w, flat_s = repack_k32(packed, scale)
    assert torch.equal(w.view(24, -1), flat_w)
    assert torch.equal(s.view(24, -1).view(torch.uint8), flat_s.view(torch.uint8))


def test_slot_bits_are_a_permutation():
    positions = [p for bits in SLOT_BITS for p in bits]
    assert sorted(positions) == list(range(16))


def _bf16_halves(word: torch.Tensor):
    lo = ((word & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    hi = (((word >> 16) & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    return lo, hi


def test_decode_bit_math_matches_reference_dequantize():
    """The PTX decode in triton_kernels.py, step by step in torch on 32-bit words of two units: the
    patterns times bf16(scale * 2^119) are exactly e2m1 * scale * 2^-7."""
    n, k = 16, 512
    packed, scale, _ = random_fp4(n, k, seed=3)
    w, s = repack_k32(packed, scale)
    word = w.view(torch.int32).long() & 0xFFFFFFFF  # [n, k/8]: units 2q, 2q+1
    full = 0xFFFFFFFF
    patterns = (
        word & 0x81C081C0,
        ((word << 3) & full) & 0x81C081C0,
        ((word << 6) & full) & 0x81C081C0,
        (((word << 1) & full) & 0x80008000) | ((word >> 3) & 0x01800180) | ((word >> 7) & 0x00400040),
    )
    big = (s.float() * 2.0**119).bfloat16().float()
    assert torch.isfinite(big).all()
    q = torch.arange(k // 8)
    group = (2 * q) // 8
    out = torch.full((n, k), float("nan"))
    for slot, pattern in enumerate(patterns):
        for half, value in enumerate(_bf16_halves(pattern)):
            prod = (value * big[:, 2 * group + slot // 2]).bfloat16().float()
            out[:, group * 32 + 8 * slot + (2 * q + half) % 8] = prod
    expect = nvfp4.e2m1_decode(nvfp4.unpack(packed)) * scale.float().repeat_interleave(16, 1) * 2.0**-7
    assert torch.equal(out, expect)


def test_extreme_scales_stay_finite_and_exact():
    # Largest e4m3 scale (448) and the smallest subnormal (2^-9): 2^119 * s fits bf16 exactly.
    s = torch.tensor([448.0, 2.0**-9, 1.0]).to(torch.float8_e4m3fn).float()
    big = (s * 2.0**119).bfloat16().float()
    assert torch.isfinite(big).all() and torch.equal(big, s * 2.0**119)


# --- MoE alignment -----------------------------------------------------------------------------------


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int):
    sorted_ids, expert_ids, num_post = moe_align(ids, num_experts, block_m)
    pairs = ids.numel()
    blocks = num_aligned_blocks(pairs, num_experts, block_m)
    assert sorted_ids.shape == (blocks * block_m,) and expert_ids.shape == (blocks,)
    used = int(num_post)
    assert used % block_m == 0 and used <= blocks * block_m
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < pairs]
    assert torch.equal(real.sort().values, torch.arange(pairs, dtype=torch.int32)), "each pair once"
    assert bool((sorted_ids[used:] == pairs).all()), "rows past num_post are padding"
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < pairs].long()
        assert len(rows) > 0, "no empty block inside the used range"
        assert bool((flat[rows] == expert_ids[b]).all()), "one expert per block"
        assert bool((rows[1:] > rows[:-1]).all()), "pairs of an expert in flat order"
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    return sorted_ids, expert_ids, num_post


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 8, 256, 16), (5, 3, 8, 4), (64, 8, 256, 16),
                                                         (300, 8, 256, 64), (7, 2, 4, 16)])
def test_align_random_routing(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    check_alignment(ids, experts, block_m)


def test_align_all_tokens_to_one_expert():
    ids = torch.full((100, 1), 3)
    sorted_ids, expert_ids, num_post = check_alignment(ids, 8, 16)
    assert int(num_post) == 112
    assert bool((expert_ids[:7] == 3).all())


def test_align_grid_bound():
    # Worst cases for the static grid: every pair its own expert, or pairs spread evenly.
    for pairs, experts, bm in [(8, 256, 16), (512, 256, 16), (4096, 8, 64), (1, 1, 128)]:
        ids = torch.arange(pairs) % experts
        check_alignment(ids.view(-1, 1), experts, bm)


# --- backend declarations ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", [TritonFp4GemmBackend, TritonMoEBackend])
def test_backend_requirements(backend):
    hopper = BackendSpec(device="cuda", capability=(9, 0), modules=frozenset({"triton"}))
    assert backend.check(hopper) == []
    assert any("compute capability" in r for r in backend.check(
        BackendSpec(device="cuda", capability=(7, 5), modules=frozenset({"triton"}))))
    assert any("triton" in r for r in backend.check(
        BackendSpec(device="cuda", capability=(9, 0), modules=frozenset())))
    assert backend.check(BackendSpec(device="cpu", modules=frozenset({"triton"})))
    assert backend.priority > 0 and backend.name == "triton" and backend.numerics == ("w4a16",)


def test_gemm_backend_prepare_repacks_on_cpu():
    packed, scale, scale_2 = random_fp4(33, 80)
    from pieceworks.backends.fp4_gemm.base import Fp4Weight

    backend = TritonFp4GemmBackend(BackendSpec())
    w = backend.prepare(Fp4Weight(packed, scale, scale_2, torch.ones(())))
    assert backend.weight_layout == "k32"
    assert torch.equal(unpack_k32(w.weight, 80), nvfp4.unpack(packed))
    tile, split = backend._plan(1, 33, 96)
    assert tile is select_tile(backend.table, 1) and split >= 1
