"""benchmarks/fp4_gemm.py --sweep --sweep-m ...: the buckets it does not sweep keep the shipped table's
tiles over their rows, whatever bounds the shipped table uses (CPU, no GPU needed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pieceworks.backends.fp4_gemm.triton import parse_table, select_tile
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

_dir = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_dir))  # the script imports its folder's `common`, as when run
_spec = importlib.util.spec_from_file_location("fp4_gemm_script", _dir / "fp4_gemm.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def test_unswept_buckets_keep_the_shipped_tiles_row_for_row():
    table, lo = [], 0
    for _, max_m in script.BUCKETS:
        table += script.shipped_buckets(FP4_GEMM_TILES, lo, max_m)
        lo = max_m
    assert [t["max_m"] for t in table][-1] is None
    parsed, shipped = parse_table(table), parse_table(FP4_GEMM_TILES)
    for m in (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 1024, 1025, 5000):
        got, want = select_tile(parsed, m), select_tile(shipped, m)
        assert got.kind == want.kind and got.block_m == want.block_m and got.num_stages == want.num_stages, m


def test_a_bucket_inside_a_shipped_one_is_bounded_at_its_own_rows():
    shipped = [dict(max_m=64, kind="fused"), dict(max_m=None, kind="dequant")]
    assert script.shipped_buckets(shipped, 16, 32) == [dict(max_m=32, kind="fused")]
    assert script.shipped_buckets(shipped, 32, 256) == [dict(max_m=64, kind="fused"), dict(max_m=256, kind="dequant")]
    assert script.shipped_buckets(shipped, 1024, None) == [dict(max_m=None, kind="dequant")]


def test_every_sweep_candidate_is_a_valid_tile():
    """Each bucket's candidates build (a tile the table validation refuses would stop the sweep midway), and
    the buckets above 16 rows try the wgmma kernel's token tiles."""
    from pieceworks.backends.fp4_gemm.triton import TileConfig

    for m_tune, _ in script.BUCKETS:
        tiles = [TileConfig(**c) for c in script.candidates(m_tune)]
        assert any(t.kind == "wgmma" for t in tiles) == (m_tune > 16), m_tune
