"""benchmarks/serving.py's split of the serving time into steps that compute prompt tokens and decode-only steps
(`StepLog`): run end to end on the tiny model on the CPU, the prompt tokens it counts must be the prompt tokens the
engine computed (all of them, less the prefix cache's hits), whether prompts arrive whole or in chunks beside decode
rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_dir = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(_dir))
_spec = importlib.util.spec_from_file_location("serving_script", _dir / "serving.py")
serving = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serving)

BASE = ["model.arch=llama", "model.preset=tiny", "runtime.device=cpu", "kv_cache.num_tokens=4096"]


def run(tmp_path, monkeypatch, *argv: str) -> dict:
    out = tmp_path / "serving.json"
    monkeypatch.setattr(sys, "argv", ["serving.py", *argv, "--out", str(out)])
    serving.main()
    return json.loads(out.read_text())["serving"]


@pytest.mark.parametrize("extra", [[], ["scheduler.max_num_batched_tokens=32"]], ids=["whole", "chunked"])
def test_prompt_tokens_and_steps_add_up(tmp_path, monkeypatch, capsys, extra):
    res = run(tmp_path, monkeypatch, *BASE, *extra, "--num-requests", "6", "--input-len", "20", "60",
              "--output-len", "5")
    ph = res["phases"]
    assert ph["prompt_tokens_computed"] == res["prefix_cache_queried_tokens"] - res["prefix_cache_hit_tokens"] > 0
    assert ph["prompt_steps"] + ph["decode_steps"] == res["num_steps"]
    assert ph["decode_steps"] > 0 and 0 < ph["decode_rows_mean"] <= 6
    if extra:  # 32 tokens a step: the prompts (120 tokens at least) take several steps
        assert ph["prompt_steps"] >= 4
    else:  # each prompt whole in one step; the engine's loop thread may start a step before all six have arrived
        assert 1 <= ph["prompt_steps"] <= 6
    assert 0 < ph["prompt_steps_s"] and 0 < ph["decode_steps_s"]
    assert "steps computing prompt tokens" in capsys.readouterr().out


def test_prefix_cache_hits_are_not_counted_as_computed(tmp_path, monkeypatch):
    res = run(tmp_path, monkeypatch, *BASE, "--num-requests", "3", "--input-len", "8", "16", "--output-len", "3",
              "--shared-prefix", "64", "--max-concurrency", "1")
    ph = res["phases"]
    assert res["prefix_cache_hit_tokens"] > 0
    assert ph["prompt_tokens_computed"] == res["prefix_cache_queried_tokens"] - res["prefix_cache_hit_tokens"]
    # one request at a time: each computes its prompt in one step, then decodes alone
    assert ph["prompt_steps"] == 3 and ph["decode_rows_mean"] == 1.0
