"""The Python examples in README.md and docs/ run as printed (on the CPU, with the demo model), so the first code
a user copies works. docs/plugins.md's example backend has its own test (test_conformance_suite.py)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

try:  # `python -m pytest` puts the repository root on sys.path, plain `pytest` puts tests/
    from tests.helpers.smollm2_files import smollm2_dir
except ImportError:
    from helpers.smollm2_files import smollm2_dir

ROOT = Path(__file__).resolve().parents[1]


def blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)


def run_block(code: str, doc: str, monkeypatch) -> tuple[dict, list[tuple]]:
    """The example run; its namespace and what it printed (each print's arguments: stdout may carry log lines of
    handlers that other tests installed)."""
    smollm2_dir()  # skips without the demo model
    monkeypatch.chdir(ROOT)  # the examples name configs/ relative to the repository root
    printed: list[tuple] = []
    namespace: dict = {"__name__": "snippet", "print": lambda *args, **kw: printed.append(args)}
    exec(compile(code, doc, "exec"), namespace)
    return namespace, printed


def test_readme_engine_example(monkeypatch):
    code = blocks("README.md")[0]
    ns, printed = run_block(code, "README.md", monkeypatch)
    engine = ns["engine"]
    try:
        ((text, reason),) = printed
        assert reason in ("stop", "length") and text.strip(), (text, reason)
        from pieceworks import AsyncEngine

        async def drive() -> None:
            aengine = AsyncEngine(engine)
            try:
                await ns["stream"](aengine, "Once upon a time")
            finally:
                aengine.shutdown()

        printed.clear()
        asyncio.run(drive())
        assert "".join(args[0] for args in printed).strip(), printed  # the streamed deltas
    finally:
        engine.close()


def test_readme_tensor_parallel_example_names_a_config_that_loads():
    """The two-GPU example can't run here: its config and override load, and the code compiles."""
    code = blocks("README.md")[1]
    compile(code, "README.md", "exec")
    path, overrides = re.search(r'Executor\.from_config\("([^"]+)", \[(.*?)\]\)', code).groups()
    from pieceworks.config import load_config

    cfg = load_config(ROOT / path, [o.strip().strip('"') for o in overrides.split(",")])
    assert cfg.parallel.tensor_parallel_size == 2


def test_sampling_structured_outputs_example(monkeypatch):
    pytest.importorskip("llguidance")
    (code,) = blocks("docs/sampling.md")
    ns, printed = run_block(code, "docs/sampling.md", monkeypatch)
    try:
        ((text, reason),) = printed
        person = json.loads(text)
        assert reason == "stop" and set(person) == {"name", "age"} and isinstance(person["age"], int), text
    finally:
        ns["engine"].close()
