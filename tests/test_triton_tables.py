"""The CPU side of the Triton NVFP4 backends: tile tables, the k32 repack and its decode bit math, split-K
choice, and the MoE block alignment. No triton needed: the kernels themselves are tested on the GPU
(tests/gpu/test_triton_fp4.py)."""

from __future__ import annotations

import json

import pytest
import torch

from pieceworks.backends.base import BackendSpec, parse_options
from pieceworks.backends.fp4_gemm.k32 import (
    SLOT_BITS,
    element_of,
    group_slots,
    pair_scales,
    quad_k_units,
    repack_k32,
    tile_k32,
    unpack_k32,
    unpack_scales_k32,
    unpair_scales,
    untile_k32,
    ungroup_slots,
)
from pieceworks.backends.fp4_gemm.triton import (
    TileConfig,
    TritonFp4GemmBackend,
    TritonTileOptions,
    choose_split_k,
    parse_table,
    select_tile,
)
from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up, interleave_rope_rows
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES, MOE_TILES
from pieceworks.backends.moe.align import moe_align, num_aligned_blocks
from pieceworks.backends.moe.routing import deepseek_route, route, route_supported
from pieceworks.backends.moe.triton import TritonMoEBackend
from pieceworks.config import load_config
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
            assert tile.block_k % 32 == 0 and tile.block_n >= 16
            # 8 x rows only as the n8 operand of an mma.sync with the weights as the A operand
            assert tile.block_m >= 16 or (tile.block_m == 8 and tile.w_as_a and not tile.one_dot)


def test_moe_table_refuses_two_acc(monkeypatch):
    import pieceworks.backends.moe.triton as moe_triton

    rows = [dict(max_m=4, block_m=8, w_as_a=True, two_acc=True), dict(max_m=None)]
    monkeypatch.setattr(moe_triton, "MOE_TILES", rows)
    with pytest.raises(ValueError, match="two_acc is a dense-GEMM option"):
        TritonMoEBackend(BackendSpec())
    monkeypatch.setattr(moe_triton, "MOE_TILES", [dict(rows[0], two_acc=False), dict(max_m=None)])
    assert TritonMoEBackend(BackendSpec()).tile(3).block_m == 8


def test_tile_tables_from_options(tmp_path):
    gemm = [dict(FP4_GEMM_TILES[0], block_n=128), dict(max_m=None, kind="dequant")]
    (tmp_path / "gemm.json").write_text(json.dumps(gemm))
    backend = TritonFp4GemmBackend(BackendSpec(), TritonTileOptions(gemm_tiles=str(tmp_path / "gemm.json")))
    assert [t.block_n for t in backend.table[:1]] == [128] and backend.table[1].kind == "dequant"
    assert backend._plan(1, 4096, 4096)[0].block_n == 128
    # a benchmark's output (an object with a "table" list), as `fp4_gemm.py --sweep` writes it
    (tmp_path / "sweep.json").write_text(json.dumps(dict(rows=[], table=gemm)))
    assert TritonFp4GemmBackend(BackendSpec(), TritonTileOptions(gemm_tiles=str(tmp_path / "sweep.json"))).table \
        == backend.table
    moe = [dict(MOE_TILES[0], block_n=32, num_warps=2), dict(max_m=None, block_m=64, block_n=128, block_k=128)]
    (tmp_path / "moe.json").write_text(json.dumps(dict(table=moe)))
    moe_backend = TritonMoEBackend(BackendSpec(), TritonTileOptions(moe_tiles=str(tmp_path / "moe.json")))
    assert moe_backend.tile(1).block_n == 32 and moe_backend.tile(500).block_m == 64
    # the shipped tables when the options are unset; each backend reads only its own option
    assert TritonFp4GemmBackend(BackendSpec(), TritonTileOptions(moe_tiles=str(tmp_path / "moe.json"))).table \
        == parse_table(FP4_GEMM_TILES)
    assert TritonMoEBackend(BackendSpec()).table == parse_table(MOE_TILES)


def test_tile_table_options_reach_the_backends_through_the_config(tmp_path):
    (tmp_path / "gemm.json").write_text(json.dumps([dict(FP4_GEMM_TILES[0], block_n=128), dict(max_m=None)]))
    cfg = load_config({"model": {"arch": "llama"}}, [f"backends.options.triton.gemm_tiles={tmp_path / 'gemm.json'}"])
    raw = dict(cfg.backends.options["triton"])
    assert parse_options(TritonFp4GemmBackend, raw).gemm_tiles == str(tmp_path / "gemm.json")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['gemm_tile'\]"):
        parse_options(TritonFp4GemmBackend, {"gemm_tile": "x.json"})


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"),
    ("{not json", "is not JSON"),
    ('{"rows": []}', "holds no tile table"),
    ("[]", "holds no tile table"),
    ('[{"max_m": null, "tile_m": 8}]', "unexpected keyword argument 'tile_m'"),
    ('[{"max_m": 64}, {"max_m": 16}, {"max_m": null}]', "out of order"),
    ('[{"max_m": 16}]', "ending with max_m=None"),
    ('[{"max_m": null, "block_k": 100}]', "multiple of 128"),
])
def test_tile_table_option_errors_name_the_option_and_file(tmp_path, content, message):
    path = tmp_path / "tiles.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        TritonFp4GemmBackend(BackendSpec(), TritonTileOptions(gemm_tiles=str(path)))
    assert "backends.options.triton.gemm_tiles" in str(err.value) and str(path) in str(err.value)


def test_moe_tile_table_option_refuses_dense_only_buckets(tmp_path):
    path = tmp_path / "moe.json"
    path.write_text(json.dumps([dict(max_m=4, block_m=8, two_acc=True), dict(max_m=None)]))
    with pytest.raises(ValueError, match=r"backends.options.triton.moe_tiles .*two_acc is a dense-GEMM option"):
        TritonMoEBackend(BackendSpec(), TritonTileOptions(moe_tiles=str(path)))
    path.write_text(json.dumps([dict(max_m=4, block_m=8), dict(max_m=None, kind="dequant")]))
    with pytest.raises(ValueError, match="no dequant or wgmma path"):
        TritonMoEBackend(BackendSpec(), TritonTileOptions(moe_tiles=str(path)))


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="ending with max_m=None"):
        parse_table([dict(max_m=16)])
    with pytest.raises(ValueError, match="out of order"):
        parse_table([dict(max_m=64), dict(max_m=16), dict(max_m=None)])
    with pytest.raises(ValueError, match="multiple of 128"):
        TileConfig(block_k=48)
    with pytest.raises(ValueError, match="kind"):
        TileConfig(kind="autotune")


def test_wgmma_buckets_fall_back_where_the_kernel_cannot_run():
    """The shipped wgmma buckets (M = 17..1024) run the tiles they replaced where the wgmma kernel can't
    (here: x on the CPU): the fused 32- and 64-row tiles, the fused 64x128 tile up to 256 rows with its K
    splits, dequantize + cuBLAS above; the buckets up to 16 rows are not wgmma and stay."""
    backend = TritonFp4GemmBackend(BackendSpec())
    x = torch.zeros(100, 4096, dtype=torch.bfloat16)
    assert select_tile(backend.table, 100).kind == "wgmma"
    tile, split = backend.plan(x, 4096, 4096)
    assert (tile.kind, tile.block_m, tile.block_n, tile.max_m) == ("fused", 64, 128, 256)
    assert split == choose_split_k(tile, 100, 4096, 4096)
    assert backend.plan(torch.zeros(600, 4096, dtype=torch.bfloat16), 4096, 4096)[0].kind == "dequant"
    for m, block_m in ((20, 32), (40, 64)):
        assert select_tile(backend.table, m).kind == "wgmma"
        tile, split = backend.plan(torch.zeros(m, 4096, dtype=torch.bfloat16), 4096, 4096)
        assert (tile.kind, tile.block_m) == ("fused", block_m)
        assert split == choose_split_k(tile, m, 4096, 4096)
    assert backend.plan(torch.zeros(12, 4096, dtype=torch.bfloat16), 4096, 4096)[0] == select_tile(backend.table, 12)


def test_wgmma_splits_keep_every_cta_in_one_round():
    """The wgmma GEMM splits K only as far as one round of CTAs on the SMs holds (a second, partly filled
    round costs a whole one), and sends the tiles of a last round that would leave more than half of the SMs
    idle to a second launch split over K."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    # q/k/v (6144 rows, 48 row blocks) at one 128-token tile: 2 splits (96 CTAs), not 3 (144: two rounds)
    assert cuda_wgmma.choose_split(128, 6144, 4096, 128) == 2
    assert cuda_wgmma.choose_split(128, 4096, 4096, 128) == 4  # 32 row blocks: 128 CTAs
    assert cuda_wgmma.choose_split(128, 4096, 512, 128) == 1  # splits keep at least 8 K tiles
    assert cuda_wgmma.choose_split(512, 28672, 4096, 256) == 1  # the tiles alone fill the SMs
    # gate/up at 512 tokens: 448 tiles = 3 rounds + 52; the last 26 row blocks (52 tiles) in 2 K splits
    assert cuda_wgmma.tail_split(512, 28672, 4096, 256) == (26, 2)
    assert cuda_wgmma.tail_split(1024, 6144, 4096, 256) == (15, 2)  # 192 tiles: 132 + 60
    assert cuda_wgmma.tail_split(1024, 28672, 4096, 256) == (0, 1)  # 896 = 6 x 132 + 104: more than half
    assert cuda_wgmma.tail_split(512, 28672, 1024, 256) == (0, 1)  # 8 K tiles: no room to split
    assert cuda_wgmma.tail_split(128, 4096, 4096, 128) == (0, 1)  # one round
    assert cuda_wgmma.tail_split(512, 28672, 4096, 256, sms=112) == (0, 1)  # 448 = 4 x 112


def test_wgmma_narrow_token_tile_only_where_one_tile_leaves_sms_idle_and_k_loops_are_short():
    """A wgmma bucket's narrow_block_m takes over (with its most stages) where one block_m token tile covers
    M, its grid has fewer CTAs than SMs, and the wide tile's CTAs would run at most 8 K tiles each (after K
    splits), or at most 16 where the fitted wide tile holds 3 stages (208-256 tokens): the H200 A/B's winners
    at M = 144-240 on the benchmark shapes. Past one tile the fitted wide tile stays, whatever the padding or
    the grid. The shipped table names it for M = 129..256."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    narrow, wide = (128, cuda_wgmma.max_stages(128)), (256, 3)
    assert narrow == (128, 5)
    tile = cuda_wgmma.token_tile
    for m in (144, 176, 200, 240, 256):
        assert tile(m, 4096, 4096, 256, 3, 128) == narrow, m  # o: 32 row blocks x 4 splits, 8 K tiles each
        assert tile(m, 7168, 2048, 256, 3, 128) == narrow, m  # expert down: 56 x 2 splits, 8 K tiles
        assert tile(m, 4096, 14336, 256, 3, 128) == wide, m  # down: 32 x 4 splits, 28 K tiles
        assert tile(m, 28672, 4096, 256, 3, 128) == wide, m  # gate/up: 224 row blocks fill the SMs
        # q/k/v (48 x 2 splits, 16 K tiles) and the expert gate/up (32 x 4, 14): narrow only where the fitted
        # wide tile (144 / 176 / 208 / 240 / 256 tokens) holds 3 stages
        expected = narrow if cuda_wgmma.max_stages(cuda_wgmma.fit_token_tile(m, 256)) == 3 else wide
        assert tile(m, 6144, 4096, 256, 3, 128) == expected == tile(m, 4096, 7168, 256, 3, 128), m
    assert tile(144, 6144, 4096, 256, 3, 128) == wide and tile(200, 6144, 4096, 256, 3, 128) == narrow
    assert tile(256, 6144, 4096, 256, 3, 0) == wide  # no narrow tile named
    assert tile(256, 28672, 1024, 256, 3, 128, sms=300) == narrow  # 224 CTAs < 300 SMs, 8 K tiles
    assert tile(256, 28672, 4096, 256, 3, 128, sms=300) == wide  # 224 CTAs, no split fits: 32 K tiles
    for m in (257, 288, 416, 512, 640):  # fewer padded rows (288: 384 against 512) or an idle grid: wide
        for n in (4096, 6144, 28672):
            assert tile(m, n, 4096, 256, 3, 128) == wide, (m, n)
    assert cuda_wgmma.plan(288, 28672, 4096, 256, 3, 128)[:2] == (144, cuda_wgmma.max_stages(144))  # two fitted tiles
    table = parse_table(FP4_GEMM_TILES)
    assert select_tile(table, 200).narrow_block_m == 128 and select_tile(table, 200).block_m == 256
    for m in (100, 300, 768, 800):
        assert select_tile(table, m).narrow_block_m == 0
    with pytest.raises(ValueError, match="narrow_block_m"):
        TileConfig(kind="wgmma", block_m=128, num_stages=5, narrow_block_m=256)
    with pytest.raises(ValueError, match="narrow_block_m"):
        TileConfig(kind="wgmma", block_m=256, num_stages=3, narrow_block_m=96)
    with pytest.raises(ValueError, match="wgmma"):
        TileConfig(kind="fused", narrow_block_m=64)


def test_wgmma_fitted_token_tile_keeps_the_tiles_and_pads_fewer_rows():
    """From 128-token tiles up, a call runs the smallest multiple of 16 that covers M in as many tiles as
    the chosen tile (the same grid, fewer padded rows of tensor work) with the stages that tile fits; M
    that fills its tiles, and smaller tiles, are left as they are."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    fit = cuda_wgmma.fit_token_tile
    assert fit(288, 128) == 96 and fit(288, 256) == 144 and fit(72, 128) == 80 and fit(200, 256) == 208
    assert fit(416, 256) == 208 and fit(700, 256) == 240 and fit(129, 128) == 80
    assert fit(256, 256) == fit(512, 256) == 256 and fit(128, 128) == fit(384, 128) == 128
    assert fit(40, 64) == 64 and fit(20, 32) == 32  # weight-bound tiles stay
    assert fit(10, 128) == 32  # never below 32 tokens
    for m in range(1, 1025):
        for bm in (128, 256):
            f = fit(m, bm)
            assert f % 16 == 0 and 32 <= f <= bm and -(-m // f) == -(-m // bm), (m, bm)
            assert cuda_wgmma.valid_block_m(f)
    assert cuda_wgmma.plan(288, 6144, 4096, 128, 5)[:2] == (96, cuda_wgmma.max_stages(96)) == (96, 6)
    for m in (72, 200, 288, 300, 416, 700, 800):  # splits, tail launch and stream-K: as for the unfitted tile
        for n in (4096, 6144, 28672):
            bm = cuda_wgmma.token_tile(m, n, 4096, 256 if m > 128 else 128, 3 if m > 128 else 5, 128 if m > 128 else 0)[0]
            unfitted = (cuda_wgmma.choose_split(m, n, 4096, bm), cuda_wgmma.tail_split(m, n, 4096, bm),
                        cuda_wgmma.stream_k_ctas(m, n, 4096, bm))
            split, tail, ctas = cuda_wgmma.plan(m, n, 4096, 256 if m > 128 else 128, 3 if m > 128 else 5,
                                                128 if m > 128 else 0)[2:]
            assert split == unfitted[0] and (split > 1 or (tail, ctas) == unfitted[1:]), (m, n)
    assert cuda_wgmma.plan(200, 28672, 4096, 256, 3, 128)[:2] == (208, 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_wgmma.gemm(torch.empty(4, 64, dtype=torch.bfloat16), None, None, None, 64, 64, block_m=72)


def test_wgmma_plan_is_its_parts():
    """cuda_wgmma.plan (what triton_kernels.fp4_gemm launches and fp4_gemm.py records) = token_tile, then
    choose_split, then tail_split and stream_k_ctas where nothing is split."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    assert cuda_wgmma.plan(256, 6144, 4096, 256, 3, 128) == (128, 5, 1, (0, 1), 132)  # 96 CTAs; 2 splits: 192
    assert cuda_wgmma.plan(128, 6144, 4096, 128, 5) == (128, 5, 2, (0, 1), 0)
    assert cuda_wgmma.plan(512, 28672, 4096, 256, 3) == (256, 3, 1, (26, 2), 132)
    assert cuda_wgmma.plan(512, 28672, 4096, 256, 3, sms=112) == (256, 3, 1, (0, 1), 0)


def test_stream_k_where_the_last_round_idles_more_than_partials_cost():
    """Stream-K (one CTA per SM) where the last round of output tiles leaves each SM idle for more than
    STREAM_K_IDLE (5) K tiles; never where the tiles fill whole rounds or K is short."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    assert cuda_wgmma.STREAM_K_IDLE == 5
    assert cuda_wgmma.stream_k_ctas(512, 6144, 4096, 256) == 132  # 96 tiles of 32 K tiles: 8.7 idle
    assert cuda_wgmma.stream_k_ctas(768, 4096, 14336, 256) == 132  # 96 tiles of 112 K tiles: 30.5
    assert cuda_wgmma.stream_k_ctas(1024, 28672, 4096, 256) == 132  # 896 tiles, 7 rounds: 6.8
    assert cuda_wgmma.stream_k_ctas(640, 6144, 4096, 128) == 132  # 240 tiles: 5.8
    assert cuda_wgmma.stream_k_ctas(1024, 7168, 2048, 256) == 0  # 224 tiles of 16 K tiles: 4.8
    assert cuda_wgmma.stream_k_ctas(512, 7168, 2048, 256) == 0  # 112 tiles of 16 K tiles: 2.4
    assert cuda_wgmma.stream_k_ctas(1024, 4096, 4096, 256) == 0  # 128 tiles: 1
    assert cuda_wgmma.stream_k_ctas(1024, 4096, 4096, 256, sms=128) == 0  # whole rounds
    assert cuda_wgmma.stream_k_ctas(32, 28672, 4096, 32) == 132  # 224 tiles: 9.7
    assert cuda_wgmma.stream_k_ctas(32, 128, 512, 32, sms=132) == 0  # 4 iterations: fewer than the SMs


def test_stream_k_option_switches_the_workspace(monkeypatch):
    """`backends.options.triton.stream_k` (default on): on, the backend hands the wgmma kernel a workspace of one
    partial per SM with its counters as the flags; off, none (its calls take splits and tail launches). The
    device checks are stubbed so that the wiring runs on the CPU."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    from pieceworks.backends.fp4_gemm import triton as triton_backend

    monkeypatch.setattr(cuda_wgmma, "device_reason", lambda device: None)
    monkeypatch.setattr(triton_backend, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    spec = BackendSpec.for_device("cpu", fp4_numerics="w4a16")
    assert TritonTileOptions().stream_k is True
    work, flags = TritonFp4GemmBackend(spec).stream_k_workspace(torch.device("cpu"))
    assert work.numel() == cuda_wgmma.workspace_floats(132) == 132 * 128 * 256 and work.dtype == torch.float32
    assert flags.dtype == torch.int32 and not flags.any()
    off = parse_options(TritonFp4GemmBackend, {"stream_k": False})
    assert TritonFp4GemmBackend(spec, off).stream_k_workspace(torch.device("cpu")) is None
    for bad in ("false", 0, None):
        with pytest.raises(ValueError, match="stream_k"):
            TritonTileOptions(stream_k=bad)


def test_wgmma_tiles_are_validated(tmp_path):
    """A wgmma bucket names one of the kernel's token tiles and a stage count that fits shared memory;
    the fused MoE has no wgmma path."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    for bm in cuda_wgmma.BLOCK_MS:
        TileConfig(kind="wgmma", block_m=bm, num_stages=cuda_wgmma.max_stages(bm))
        assert cuda_wgmma.max_stages(bm) * (cuda_wgmma.stage_bytes(bm) + 16) <= cuda_wgmma.MAX_SHARED
    with pytest.raises(ValueError, match=r"block_m in \(32, 64, 128, 256\)"):
        TileConfig(kind="wgmma", block_m=96)
    with pytest.raises(ValueError, match="num_stages 2..3"):
        TileConfig(kind="wgmma", block_m=256, num_stages=4)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps([dict(max_m=4, block_m=8), dict(max_m=None, kind="wgmma", block_m=128)]))
    with pytest.raises(ValueError, match="no dequant or wgmma path"):
        TritonMoEBackend(BackendSpec(), TritonTileOptions(moe_tiles=str(path)))


def test_wgmma_gemm_declines_what_it_cannot_run():
    """Off Hopper, or with x not bf16, `unsupported` says why (the GEMM then dequantizes + matmuls)."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    assert "CUDA devices" in cuda_wgmma.unsupported(torch.zeros(2, 16, dtype=torch.bfloat16))


def test_split_k_choice():
    tile = TileConfig(block_m=16, block_n=64, block_k=256, target_ctas=264, max_split=8)
    # 4096 rows -> 64 tiles: ceil(264 / 64) = 5 splits of 16 iterations (ranges of 3 or 4).
    assert choose_split_k(tile, 1, 4096, 4096) == 5
    # Enough tiles already: no split.
    assert choose_split_k(tile, 1, 28672, 4096) == 1
    # Never more than max_split, never below two iterations per split.
    assert choose_split_k(tile, 1, 64, 14336) == 8
    assert choose_split_k(tile, 1, 64, 512) == 1
    assert choose_split_k(tile, 1, 4096, 6 * 256) == 3
    for n, k in [(4096, 4096), (6144, 14336), (100, 512 * 7), (64, 1024)]:
        split = choose_split_k(tile, 1, n, k)
        assert 1 <= split <= max(1, (k // 256) // 2) and split <= 8
    assert choose_split_k(TileConfig(kind="dequant"), 1, 64, 4096) == 1


@pytest.mark.parametrize("bq", [64, 128, 256])
def test_perm_k_gives_each_quad_thread_whole_groups(bq):
    units = quad_k_units(bq)
    assert sorted(units.tolist()) == list(range(bq))
    # the kernel's reshape/permute of the decoded slots (triton_k32.quad_k) applied to unit indices
    a = bq // 64
    assert torch.equal(torch.arange(bq).reshape(4, a, 2, 4, 2).permute(1, 3, 2, 0, 4).reshape(bq), units)
    pos = torch.arange(bq)
    for t in range(4):  # K positions of MMA fragment thread t: 16b + 8e + 2t + h
        mine = units[(pos // 2) % 4 == t]
        groups = mine // 8
        assert groups.unique().numel() == 2 * a  # whole groups: 8 units each
        assert all(int((groups == g).sum()) == 8 for g in groups.unique())
    with pytest.raises(ValueError, match="runs of 64"):
        quad_k_units(32)


def test_perm_k_tiles_are_validated():
    TileConfig(block_m=8, block_k=256, perm_k=True)
    with pytest.raises(ValueError, match="perm_k"):
        TileConfig(block_m=8, block_k=128, perm_k=True)
    with pytest.raises(ValueError, match="perm_k"):
        TileConfig(block_m=16, block_k=256, one_dot=True, perm_k=True)


def test_split_k_balanced_over_multiprocessors():
    tile = TileConfig(block_m=8, block_n=64, block_k=256, target_ctas=396, max_split=16, balance_waves=True,
                      min_split_iters=4)
    # Llama-3.1-8B qkv, 96 tiles: 4 splits (384 programs, 2.9 per SM of 132) rather than the plain 5
    # (480: 3.6 per SM, so 4 on some and 3 on others).
    assert choose_split_k(tile, 1, 6144, 4096) == 4
    plain = TileConfig(**{**tile.__dict__, "balance_waves": False, "min_split_iters": 2})
    assert choose_split_k(plain, 1, 6144, 4096) == 5
    # down, 64 tiles of 56 iterations: 6 splits (384) over the plain 7 (448) and over 8 (512, as even).
    assert choose_split_k(tile, 1, 4096, 14336) == 6
    # o, 64 tiles of 16 iterations: no split count of at least 3/4 of the target keeps 4 iterations;
    # the plain choice, capped at 16 // 4 splits.
    assert choose_split_k(tile, 1, 4096, 4096) == 4
    # On a device with another SM count the evenness follows it: 96 tiles over 80 SMs.
    assert choose_split_k(tile, 1, 6144, 4096, sms=80) == 4  # 384 / 80 = 4.8 per SM (the most even)
    assert choose_split_k(tile, 1, 6144, 4096, sms=64) == 4  # 6 per SM exactly
    # Enough tiles: never split, balanced or not.
    assert choose_split_k(tile, 1, 28672, 4096) == 1


# --- k32 repack --------------------------------------------------------------------------------------


def scale_rows(s: torch.Tensor, n: int) -> torch.Tensor:
    """Repacked scales in row-major block order, the padding rows dropped."""
    return unpack_scales_k32(s, n)


@pytest.mark.parametrize("n,k", [(1, 16), (3, 32), (5, 48), (8, 4096), (7, 4112), (64, 512), (130, 1008)])
def test_repack_roundtrip_and_padding(n, k):
    packed, scale, _ = random_fp4(n, k, seed=n + k)
    w, s = repack_k32(packed, scale, chunk_rows=3)
    kp = -(-k // 512) * 512
    np_ = -(-n // 64) * 64
    assert w.shape == (np_, kp // 2) and w.dtype == torch.uint8
    assert s.shape == (np_, kp // 16) and s.dtype == torch.float8_e4m3fn
    assert torch.equal(unpack_k32(w, k, n), nvfp4.unpack(packed))
    codes = unpack_k32(w, kp)
    assert not codes[:n, k:].any() and not codes[n:].any()  # K and row padding: zero codes
    s_rows = scale_rows(s, np_)
    assert torch.equal(s_rows[:n, : k // 16].view(torch.uint8), scale.view(torch.uint8))
    assert not s_rows[:n, k // 16 :].float().any() and not s_rows[n:].float().any()


def test_k32_groups_hold_blocks_t_and_t_plus_4():
    """Group t of a 128-element tile: slots 0 / 1 are block t (elements 16 t + 8 j + u), slots 2 / 3 block
    t + 4 (64 + 16 t + 8 (j - 2) + u), so that an x load for one slot, across a quad's four groups (the CUDA
    decode kernel's lanes t = 0..3), stays in one 128-byte line of x; scale pair t is (block t, block t + 4)."""
    seen = set()
    for t in range(4):
        for j in range(4):
            run = [element_of(t, j, u) for u in range(8)]
            assert run == list(range(run[0], run[0] + 8))  # 8 contiguous elements per slot
            assert run[0] // 16 == (t if j < 2 else t + 4)  # one block: the pair's low / high byte
            seen.update(run)
    for j in range(4):
        starts = [element_of(t, j, 0) for t in range(4)]
        assert starts[0] // 64 == (max(starts) + 7) // 64  # the same 64 elements (128 bytes) of x
    assert seen == set(range(128))
    codes = torch.arange(3 * 256, dtype=torch.int32).view(3, 256)
    slots = group_slots(codes)
    assert [int(slots[j][1, 5, u]) for j in range(4) for u in (0, 7)] == [
        256 + 128 + element_of(1, j, u) for j in range(4) for u in (0, 7)]
    assert torch.equal(ungroup_slots(torch.stack(slots, dim=2)), codes)
    blocks = torch.arange(2 * 16, dtype=torch.uint8).view(2, 16)
    paired = pair_scales(blocks)
    assert paired[1].tolist() == [16, 20, 17, 21, 18, 22, 19, 23, 24, 28, 25, 29, 26, 30, 27, 31]
    assert torch.equal(unpair_scales(paired), blocks)


def test_tiled_storage_order():
    """Each 64-row x 128-element tile is contiguous (64 bytes of units, 8 of scales per row), tiles in
    (row block, K block) order: the offsets `triton_k32.tile_row_bases` and the K loop compute."""
    n, kp = 192, 1024
    rows_bytes = torch.arange(n * kp // 2, dtype=torch.int64).remainder(256).to(torch.uint8).view(n, kp // 2)
    assert tile_k32(rows_bytes).shape == (n, kp // 2)
    flat = tile_k32(rows_bytes).flatten()
    for r, u in ((0, 0), (5, 31), (5, 32), (63, 100), (64, 0), (130, 255), (191, 200)):
        base_units = ((r // 64) * (kp // 128) * 64 + r % 64) * 32  # tile_row_bases
        offset = base_units + (u // 32) * 64 * 32 + u % 32  # the K loop: unit u of the row
        byte = 2 * offset
        assert int(flat[byte]) == int(rows_bytes[r, 2 * u]) and int(flat[byte + 1]) == int(rows_bytes[r, 2 * u + 1])
    scales = torch.arange(n * kp // 16, dtype=torch.int64).remainder(251).to(torch.uint8).view(n, kp // 16)
    flat_s = tile_k32(scales.view(torch.float8_e4m3fn)).view(torch.uint8).flatten()
    for r, g in ((0, 0), (7, 3), (7, 4), (100, 31), (191, 17)):  # scale pair g of row r
        base_pairs = ((r // 64) * (kp // 128) * 64 + r % 64) * 4
        offset = base_pairs + (g // 4) * 64 * 4 + g % 4
        assert int(flat_s[2 * offset]) == int(scales[r, 2 * g])
        assert int(flat_s[2 * offset + 1]) == int(scales[r, 2 * g + 1])
    assert torch.equal(untile_k32(tile_k32(rows_bytes)), rows_bytes)
    with pytest.raises(ValueError, match="multiple of 64"):
        tile_k32(rows_bytes[:100])


def test_repack_zeroes_codes_of_zero_scale_blocks():
    packed, scale, _ = random_fp4(4, 64, seed=1)
    scale = scale.clone()
    scale[1, 2] = 0.0
    scale[3, 0] = 0.0
    codes = nvfp4.unpack(packed)
    assert codes[1, 32:48].any() and codes[3, :16].any(), "the test needs nonzero codes there"
    w, _ = repack_k32(packed, scale)
    got = unpack_k32(w, 64, 4)
    expect = codes.clone()
    expect[1, 32:48] = 0
    expect[3, :16] = 0
    assert torch.equal(got, expect)
    # Values are unchanged: the zeroed codes sat under a zero scale.
    values = nvfp4.e2m1_decode(codes) * scale.float().repeat_interleave(16, 1)
    assert torch.equal(nvfp4.e2m1_decode(got) * scale.float().repeat_interleave(16, 1), values)


def test_repack_keeps_leading_dims():
    packed, scale, _ = random_fp4(6 * 4, 64)
    w, s = repack_k32(packed.view(6, 4, 32), scale.view(6, 4, 4))
    flat_w, flat_s = repack_k32(packed, scale)
    assert w.shape == (6, 64, 256) and s.shape == (6, 64, 32)  # each matrix's rows padded to 64
    for e in range(6):
        assert torch.equal(unpack_k32(w[e], 64, 4), unpack_k32(flat_w, 64, 24)[4 * e : 4 * e + 4])
        flat_rows = scale_rows(flat_s, 24)[4 * e : 4 * e + 4]
        assert torch.equal(scale_rows(s[e], 4).view(torch.uint8), flat_rows.view(torch.uint8))


def test_slot_bits_are_a_permutation():
    positions = [p for bits in SLOT_BITS for p in bits]
    assert sorted(positions) == list(range(16))


def _bf16_halves(word: torch.Tensor):
    lo = ((word & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    hi = (((word >> 16) & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    return lo, hi


def scale_multipliers(pairs: torch.Tensor):
    """The PTX scale conversion of triton_k32.py in torch: int16 pairs -> (low, high) bf16 values.

    cvt.rn.f16x2.e4m3x2 (exact), then on the 32-bit pair a right shift by 3 and an OR of 0x70007000."""
    p = pairs.to(torch.int32) & 0xFFFF
    halves = [byte.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).to(torch.int64)
              & 0xFFFF for byte in (p & 0xFF, p >> 8)]
    h = halves[0] | (halves[1] << 16)
    d = (h >> 3) | 0x70007000
    return [(((d >> (16 * i)) & 0xFFFF) << 16).to(torch.int32).view(torch.float32) for i in (0, 1)]


def test_scale_conversion_is_exact_for_every_e4m3():
    # All 127 finite non-negative e4m3 values (0x7F is NaN), subnormals included.
    codes = torch.arange(0, 0x7F, dtype=torch.int32)
    scale = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    lo, hi = scale_multipliers(codes | (codes << 8))
    nonzero = scale != 0
    assert torch.equal(lo[nonzero], scale[nonzero] * 2.0**112)
    assert torch.equal(hi, lo) and torch.isfinite(lo).all()
    # Zero maps to a finite number; the repack zeroes the codes under it.
    assert lo[~nonzero].item() == 2.0**97


def test_scale_conversion_keeps_the_halves_of_a_pair_apart():
    # The shift works on the whole 32-bit pair: every (low, high) combination of finite non-negative e4m3.
    codes = torch.arange(0, 0x7F, dtype=torch.int32)
    lo_c, hi_c = (c.flatten() for c in torch.meshgrid(codes, codes, indexing="ij"))
    lo, hi = scale_multipliers(lo_c | (hi_c << 8))
    for c, mult in ((lo_c, lo), (hi_c, hi)):
        scale = c.to(torch.uint8).view(torch.float8_e4m3fn).float()
        nonzero = scale != 0
        assert torch.equal(mult[nonzero], scale[nonzero] * 2.0**112)
        assert (mult[~nonzero] == 2.0**97).all()


def test_repack_moves_negative_scale_signs_into_the_codes():
    n, k = 8, 512
    packed, scale, _ = random_fp4(n, k, seed=5)
    scale = scale.clone()
    scale[1, 3] = -scale[1, 3].float()
    scale[2, :4] = -scale[2, :4].float()
    scale[3, 0] = -0.0
    w, s = repack_k32(packed, scale)
    assert not (s.view(torch.uint8) & 0x80).any()
    got = nvfp4.e2m1_decode(unpack_k32(w, k, n)) * scale_rows(s, n)[:, : k // 16].float().repeat_interleave(16, 1)
    expect = nvfp4.e2m1_decode(nvfp4.unpack(packed)) * scale.float().repeat_interleave(16, 1)
    assert torch.equal(got, expect)


def test_repack_refuses_nan_scales():
    packed, scale, _ = random_fp4(4, 512, seed=6)
    scale = scale.clone()
    scale[2, 9] = float("nan")
    with pytest.raises(ValueError, match=r"1 of 128 are NaN \(the first at flattened row 2, block 9"):
        repack_k32(packed, scale)


def test_decode_bit_math_matches_reference_dequantize():
    """The PTX decode in triton_k32.py, step by step in torch on 32-bit words of two units: the
    patterns times the scale multipliers are exactly e2m1 * scale * 2^-14."""
    n, k = 16, 512
    packed, scale, _ = random_fp4(n, k, seed=3)
    scale = scale.clone()
    scale[2, 5] = 0.0  # a zero-scale block
    scale[4, 7] = 2.0**-9  # the smallest subnormal
    scale[6, 3] = -scale[6, 3].float()  # a negative scale: the repack moves its sign into the codes
    scale[7, 1] = -0.0
    w, s = repack_k32(packed, scale)
    w, s = untile_k32(w)[:n], untile_k32(s)[:n]  # row-major: the decode does not depend on the storage order
    word = w.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [n, k/8]: units 2q, 2q+1
    full = 0xFFFFFFFF
    patterns = (
        word & 0x81C081C0,
        ((word << 3) & full) & 0x81C081C0,
        ((word << 6) & full) & 0x81C081C0,
        ((((word & 0x6C006C00) >> 7) * 2081) & full) & 0x81C081C0,
    )
    s_a, s_b = scale_multipliers(s.contiguous().view(torch.int16))  # [n, k/32] each: pair g, slots 0/1 and 2/3
    q = torch.arange(k // 8)
    group = (2 * q) // 8
    out = torch.full((n, k), float("nan"))
    for slot, pattern in enumerate(patterns):
        mult = (s_a if slot < 2 else s_b)[:, group]
        for half, value in enumerate(_bf16_halves(pattern)):
            prod = (value * mult).bfloat16().float()
            unit = (2 * q + half) % 8
            element = torch.tensor([128 * (int(g) // 4) + element_of(int(g) % 4, slot, int(u)) for g, u in zip(group, unit)])
            out[:, element] = prod
    expect = nvfp4.e2m1_decode(nvfp4.unpack(packed)) * scale.float().repeat_interleave(16, 1) * 2.0**-14
    assert torch.equal(out, expect)


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
    assert torch.equal(unpack_k32(w.weight, 80, 33), nvfp4.unpack(packed))
    tile, split = backend._plan(1, 33, 96)
    assert tile is select_tile(backend.table, 1) and split >= 1


def test_interleave_gate_up():
    rows = interleave_gate_up(8)
    assert rows.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # gate j, up j side by side
    with pytest.raises(ValueError, match="even row count"):
        interleave_gate_up(7)


def test_gemm_backend_prepare_gate_up_interleaves_rows_on_cpu():
    from pieceworks.backends.fp4_gemm.base import Fp4Weight

    packed, scale, scale_2 = random_fp4(2 * 24, 64, seed=3)
    backend = TritonFp4GemmBackend(BackendSpec())
    w = backend.prepare_gate_up(Fp4Weight(packed, scale, scale_2, torch.ones(())))
    codes = unpack_k32(w.weight, 64, 48)
    ref = nvfp4.unpack(packed)
    assert torch.equal(codes[0::2], ref[:24]) and torch.equal(codes[1::2], ref[24:])
    s = scale_rows(w.weight_scale, 48)
    assert torch.equal(s[0::2, :4], scale[:24]) and torch.equal(s[1::2, :4], scale[24:])


def test_gated_mlp_runs_nvfp4_gate_up_as_one_swiglu_op():
    from pieceworks.core.context import ForwardContext, forward_context
    from pieceworks.backends import fused
    from pieceworks.models.base import GatedMLP
    from pieceworks.quant.linear import Fp4Linear

    mlp = GatedMLP(64, 48, "mlp", lambda name: True)
    proj = mlp.gate_up_proj.proj
    assert isinstance(proj, Fp4Linear) and proj.gate_up
    gen = torch.Generator().manual_seed(0)
    gate_up = Fp4Linear.from_float(torch.randn(96, 64, generator=gen))
    proj.load(gate_up.fp4_weight())
    mlp.down_proj.load(Fp4Linear.from_float(torch.randn(64, 48, generator=gen)).fp4_weight())
    x = torch.randn(5, 64, generator=gen)
    backend = TorchFp4GemmBackend(BackendSpec())
    proj.prepare(backend)
    mlp.down_proj.prepare(backend)
    kernels = type("Kernels", (), {"fp4_gemm": backend})()
    with forward_context(ForwardContext(kernels, None, None)):
        got = mlp(x)
        y = gate_up(x)  # the same weights, never prepared: the plain GEMM
        ref = mlp.down_proj(fused.silu_mul(y[:, :48], y[:, 48:]))
        with pytest.raises(RuntimeError, match="call forward_swiglu"):
            proj(x)
        with pytest.raises(RuntimeError, match="needs a gate/up projection"):
            mlp.down_proj.forward_swiglu(x)
    assert torch.equal(got, ref)


def test_route_supported_shapes():
    """Which routings the Triton kernel takes; the rest go to the torch routing."""
    x = torch.zeros(3, 256)
    bias = torch.zeros(256)
    assert route_supported(x, bias, 8, 8, 4)  # DeepSeek-V3
    assert route_supported(x, torch.empty(0), 8, 1, 1)  # no groups, no bias
    assert route_supported(x.bfloat16(), bias, 8, 8, 8)  # every group kept: no grouping step
    assert not route_supported(torch.zeros(3, 96), torch.zeros(96), 8, 1, 1)  # E not a power of two
    assert not route_supported(torch.zeros(3, 2048), torch.zeros(2048), 8, 1, 1)  # E above 1024
    assert route_supported(x, bias, 32, 8, 1)  # one kept group of 32 experts is enough for top 32 ...
    assert not route_supported(x, bias, 33, 8, 1)  # ... not for 33
    assert not route_supported(x, bias, 8, 6, 4)  # groups not a power of two
    assert not route_supported(x, torch.zeros(128), 8, 8, 4)  # bias of the wrong length
    assert not route_supported(torch.zeros(256, 3).t(), bias[:3], 2, 1, 1)  # strided columns
    assert not route_supported(x.long(), bias, 8, 8, 4)


def test_route_on_cpu_is_the_torch_routing():
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(5, 256, generator=gen), torch.rand(256, generator=gen)
    for got, want in zip(route(logits, bias, 8, 8, 4, True, 2.5), deepseek_route(logits, bias, 8, 8, 4, True, 2.5)):
        assert torch.equal(got, want)


def test_interleave_rope_rows():
    rows = interleave_rope_rows(2, 1, 4)  # q heads 0-1, k head 2 (rope pairs j, j + 2), v head 3
    assert rows.tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="even head_dim"):
        interleave_rope_rows(2, 1, 5)


def test_gemm_backend_prepare_qkv_rope_interleaves_rows_on_cpu():
    from pieceworks.backends.fp4_gemm.base import Fp4Weight

    packed, scale, scale_2 = random_fp4(4 * 8, 64, seed=4)  # 2 q heads, 1 kv head, head_dim 8
    backend = TritonFp4GemmBackend(BackendSpec())
    assert backend.fuses_qkv_rope and backend.qkv_rope_supported(2, 1, 8)
    assert not backend.qkv_rope_supported(2, 1, 96) and not backend.qkv_rope_supported(2, 1, 7)
    w = backend.prepare_qkv_rope(Fp4Weight(packed, scale, scale_2, torch.ones(())), 2, 1, 8)
    rows = interleave_rope_rows(2, 1, 8)
    assert torch.equal(unpack_k32(w.weight, 64, 32), nvfp4.unpack(packed)[rows])
    assert torch.equal(scale_rows(w.weight_scale, 32)[:, :4], scale[rows])


class _RopeFusingTorchBackend(TorchFp4GemmBackend):
    """The torch reference GEMM declared as fusing the rope: it runs the base class's default
    `forward_qkv_rope` (GEMM, then the rope op), so the model takes its fused path on the CPU."""

    fuses_qkv_rope = True


def _qkv_seen(attn, x, cos, sin, fp4_backend):
    """q, k, v as the attention op receives them from `attn` (a LlamaAttention)."""
    from pieceworks.core.context import ForwardContext, forward_context

    seen = {}

    class Attention:
        def forward(self, q, k, v, out, layer_id, scale, kv):
            seen.update(q=q.clone(), k=k.clone(), v=v.clone())
            out.zero_()

    kernels = type("Kernels", (), {"fp4_gemm": fp4_backend, "attention": Attention()})()
    with forward_context(ForwardContext(kernels, None, None)):
        attn(x, cos, sin)
    return seen


def test_llama_attention_runs_nvfp4_qkv_with_the_fused_rope_op():
    from pieceworks.models.llama import LlamaArgs, LlamaAttention
    from pieceworks.quant.linear import Fp4Linear

    a = LlamaArgs.from_hf(dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=1, intermediate_size=96, vocab_size=32))
    gen = torch.Generator().manual_seed(1)
    qkv = Fp4Linear.from_float(torch.randn(128, 64, generator=gen))  # (4 + 2 * 2) heads of 16
    o = Fp4Linear.from_float(torch.randn(64, 64, generator=gen))
    x = torch.randn(3, 64, generator=gen)
    ang = torch.rand(3, 8, generator=gen) * 30
    cos, sin = ang.cos(), ang.sin()
    seen = {}
    for name, backend in (("plain", TorchFp4GemmBackend(BackendSpec())),
                          ("fused", _RopeFusingTorchBackend(BackendSpec()))):
        attn = LlamaAttention(a, 0, "model.layers.0.self_attn", lambda n: True)
        proj = attn.qkv_proj.proj
        assert proj.qkv_heads == (4, 2, 16)
        proj.load(qkv.fp4_weight())
        attn.o_proj.load(o.fp4_weight())
        proj.prepare(backend)
        attn.o_proj.prepare(backend)
        assert proj.rope_fused == (name == "fused")
        seen[name] = _qkv_seen(attn, x, cos, sin, backend)
        if name == "fused":
            with pytest.raises(RuntimeError, match="call forward_qkv_rope"):
                proj(x)
    for key in "qkv":
        assert seen["fused"][key].shape == seen["plain"][key].shape
        assert torch.equal(seen["fused"][key], seen["plain"][key]), key
    with pytest.raises(RuntimeError, match="needs a q/k/v projection"):
        attn.o_proj.forward_qkv_rope(x, cos, sin)


def test_fp4_linear_fuses_the_rope_only_for_supported_heads():
    from pieceworks.quant.linear import Fp4Linear

    backend = TritonFp4GemmBackend(BackendSpec())
    gen = torch.Generator().manual_seed(2)
    for head_dim, fused in ((96, False), (64, True)):
        layer = Fp4Linear.from_float(torch.randn(4 * head_dim, 64, generator=gen))
        layer.qkv_heads = (2, 1, head_dim)
        layer.prepare(backend)
        assert layer.prepared and layer.layout == "k32" and layer.rope_fused == fused
    bad = Fp4Linear.from_float(torch.randn(4 * 64, 64, generator=gen))
    bad.qkv_heads = (3, 1, 64)
    with pytest.raises(ValueError, match="do not give 256 rows"):
        bad.prepare(backend)


def test_model_prepare_names_the_layer_whose_block_scales_are_nan():
    from collections import OrderedDict

    from torch import nn

    from pieceworks.backends.fp4_gemm.base import Fp4Weight
    from pieceworks.models.base import CausalLM
    from pieceworks.quant.linear import Fp4Linear

    packed, scale, scale_2 = random_fp4(8, 512, seed=7)
    scale = scale.clone()
    scale[1, 2] = float("nan")
    layer = Fp4Linear(512, 8)
    layer.load(Fp4Weight(packed, scale, scale_2.float(), torch.tensor(1.0)))
    model = nn.Sequential(OrderedDict(down_proj=layer))

    class Table:
        def instances(self, op):
            return [TritonFp4GemmBackend(BackendSpec())] if op == "fp4_gemm" else []

    with pytest.raises(ValueError, match=r"^down_proj: NVFP4 block scales: 1 of 256 are NaN"):
        CausalLM.prepare(model, Table())
    assert not layer.prepared and layer.layout == "linear" and torch.equal(layer.weight, packed)


def test_moe_prepare_pads_gate_and_up_halves_to_whole_tiles():
    """An intermediate size that is not a multiple of 64: gate rows [0, I), up rows [Ip, Ip + I) of the
    repacked w13 (Ip = I rounded up to 64), zero rows between, so the kernel finds up row j at Ip + j."""
    from pieceworks.backends.moe.base import MoEWeights

    e, h, inter = 2, 128, 48
    quant = [[random_fp4(rows, cols, seed=10 * i + j) for i in range(e)]
             for j, (rows, cols) in enumerate(((inter, h), (inter, h), (h, inter)))]
    stack = [tuple(torch.stack([q[i] for q in mats]) for i in range(3)) for mats in quant]
    (gp, gs, g2), (up, us, u2), (dp, ds, d2) = stack
    ones = torch.ones(e)
    w = MoEWeights(torch.cat([gp, up], 1), torch.cat([gs, us], 1), torch.stack([g2, u2], 1), ones, dp, ds, d2, ones)
    p = TritonMoEBackend(BackendSpec()).prepare(w)
    assert p.w13.shape == (e, 128, 256) and p.w13_scale.shape == (e, 128, 32)
    assert p.w2.shape == (e, 128, 256)  # H = 128 rows; K = I padded to 512
    for i in range(e):
        codes = unpack_k32(p.w13[i], h)
        assert torch.equal(codes[:inter], nvfp4.unpack(gp[i]))
        assert torch.equal(codes[64 : 64 + inter], nvfp4.unpack(up[i]))
        assert not codes[inter:64].any() and not codes[64 + inter :].any()
        s = scale_rows(p.w13_scale[i], 128)
        assert torch.equal(s[64 : 64 + inter, : h // 16].view(torch.uint8), us[i].view(torch.uint8))
        assert not s[inter:64].float().any()
