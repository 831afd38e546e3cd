"""benchmarks/graphs_report.py's target check: the rows of a graphs.py run against docs/benchmarks.md's targets for
piecewise and full extend graphs (CPU, no GPU needed; rows made up around the shape of a real run's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_dir = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_dir))  # the script imports its folder's `common`, as when run
_spec = importlib.util.spec_from_file_location("graphs_report", _dir / "graphs_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def row(T, piecewise, whole, eager=15.0, b2b=None, extend=None, whole_logits=None, plain=None, padded_to=None):
    r = {"T": T, "padded_to": padded_to or T, "eager_ms": eager, "piecewise_ms": piecewise, "whole_graph_ms": whole,
         "piecewise_b2b_ms": piecewise if b2b is None else b2b}
    if extend is not None:
        r.update(extend_graph_b2b_ms=extend, whole_logits_ms=whole_logits)
    if plain is not None:
        r["plain_ms"] = plain
    return r


def verdicts(ext):
    lines = report.targets(ext)
    assert lines[0].startswith("Targets")
    return [line.split(": ", 1)[1].split(" ")[0] for line in lines[1:]]


def test_a_run_within_every_target_says_yes():
    ext = [row(16, 6.03, 5.71, b2b=5.95, extend=6.41, whole_logits=6.10, plain=13.0),
           row(256, 8.59, 8.58, extend=8.50, whole_logits=8.94),
           row(512, 13.98, 13.96, extend=13.40, whole_logits=14.69),
           row("256 + 32 x 1", 10.77, 10.52, padded_to=288)]
    assert verdicts(ext) == ["yes"] * 5
    assert "16: 0.32 ms" in report.targets(ext)[1] and "512: 0.1%" in report.targets(ext)[1]


@pytest.mark.parametrize("bad, target", [
    (row(64, 6.90, 6.35, b2b=6.60), 0),                         # 0.55 ms over at T <= 256 (alternated)
    (row(512, 14.50, 14.00, b2b=14.10), 0),                     # 3.6% over beyond 256
    (row(64, 6.40, 6.35, b2b=6.90), 1),                         # back to back only
    (row(128, 6.80, 6.45, extend=7.40, whole_logits=6.83), 2),  # the extend graph 0.57 ms over
    (row(16, 6.03, 5.71, plain=9.0), 3),                        # eager 1.67x plain
    (row(2048, 52.0, 51.5, eager=51.9), 4),                     # piecewise slower than eager
])
def test_each_target_fails_on_its_own_row(bad, target):
    ext = [row(16, 6.03, 5.71, extend=6.41, whole_logits=6.10, plain=13.0), bad]
    got = verdicts(ext)
    assert got[target] == "no" and all(v == "yes" for i, v in enumerate(got) if i != target), got


def test_targets_without_their_rows_are_not_measured():
    assert verdicts([{"T": 16, "padded_to": 16, "eager_ms": 30.0}]) == ["not"] * 5
    assert report.targets([])[1].endswith("not measured")


def test_a_row_timed_in_alternation_only_leaves_back_to_back_unmeasured():
    r = row(64, 6.40, 6.35)
    del r["piecewise_b2b_ms"]
    assert verdicts([r])[:2] == ["yes", "not"]


def test_the_extend_table_shows_the_plan_host_time_where_timed():
    info = {"date": "d", "device": "cpu", "torch": "t", "backends": {}, "piecewise": None, "decode_graphs": None}
    planned, unplanned = row(16, 6.03, 5.71), row(64, 6.40, 6.35)
    planned["plan_us"] = 123.4
    table = report.render(info, [planned, unplanned], [])
    assert "attention plan, host us" in table
    cells = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines()
             if line.startswith(("| 16 ", "| 64 "))}
    assert cells["| 16"][7] == "123" and cells["| 64"][7] == "-"


def test_the_extend_graph_table_shows_the_gpu_side_gap_and_host_times_where_timed():
    info = {"date": "d", "device": "cuda", "torch": "t", "backends": {}, "piecewise": None, "decode_graphs": None,
            "extend_graphs": {"sizes": [16, 64], "max_seqs": 64, "capture_s": 1.0, "pool_bytes": 0}}
    timed, untimed = row(16, 6.03, 5.71, extend=6.41, whole_logits=6.10), row(64, 6.40, 6.35, extend=6.9,
                                                                               whole_logits=6.5)
    for r in (timed, untimed):
        r["piecewise_logits_b2b_ms"] = r["piecewise_ms"]
    timed.update(extend_graph_gpu_ms=6.25, whole_logits_gpu_ms=6.05, extend_graph_host_us=181.4,
                 whole_logits_host_us=22.6)
    table = report.render(info, [timed, untimed], [])
    assert "extend graph - whole, GPU time with the host ahead (ms)" in table
    cells = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines()
             if line.startswith(("| 16 ", "| 64 ")) and line.count(" | ") == 7}
    assert cells["| 16"][5] == "0.310" and cells["| 16"][6] == "0.200" and cells["| 16"][7].rstrip(" |") == "181 / 23"
    assert cells["| 64"][6] == "nan" and cells["| 64"][7].rstrip(" |") == "nan / nan"
