"""The conformance suite, run the documented way (`pytest --pyargs pieceworks.testing.suite
--pieceworks-backend OP.NAME`) in a subprocess on out-of-tree plugins installed by entry point: it passes
docs/plugins.md's example backend and a correct tiled copy of it, fails each broken copy
(tests/helpers/suite_variants.py), and fails a run whose backend under test skipped every case."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
BROKEN = {  # variant -> what the suite must say about it (one of its failures)
    "anyheaddim": "shapes that check() accepts fail",
    "nokvwrite": "new tokens' K/V are not at their slots",
    "ignoreslayer": "new tokens' K/V are not at their slots",
    "ignoresscale": "relative error",
    "staleplan": "step 2",  # its first step is right; the next one reads the first one's plan
    "nanpadded": "padded rows",
    "nopaddedkv": "the reserved slot does not hold a padded row's K/V",
    "syncs": "syncs with the host or reads tensor values on the host: item",
    "fp32error": "> tolerance 1e-05",
    "bf16error": "> tolerance 5e-03",
}


def docs_example() -> str:
    """The complete backend of docs/plugins.md (its first Python block)."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    block = re.search(r"```python\n(# mykernels/plugin\.py\n.*?)```", text, re.S)
    assert block, "docs/plugins.md lost its example backend (a ```python block starting '# mykernels/plugin.py')"
    return block.group(1)


def dist(site: Path, name: str, eps: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(eps)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A site directory with docs/plugins.md's `mykernels` package and the variants, each installed by
    entry point of group pieceworks as a plugin author's pyproject.toml would declare it."""
    site = tmp_path_factory.mktemp("site")
    (site / "mykernels").mkdir()
    (site / "mykernels" / "__init__.py").write_text("")
    (site / "mykernels" / "plugin.py").write_text(docs_example())
    (site / "suite_variants.py").write_text((ROOT / "tests" / "helpers" / "suite_variants.py").read_text())
    dist(site, "mykernels", "[pieceworks]\nmykernels = mykernels.plugin\n")
    dist(site, "suite_variants", "[pieceworks]\nvariants = suite_variants\n")
    return site


def suite(site: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "pieceworks.testing.suite", "-q", "-p", "no:cacheprovider",
           "--pieceworks-device", "cpu", *args]
    if not any(ep.name == "pieceworks.testing.plugin" for ep in importlib.metadata.entry_points(group="pytest11")):
        cmd += ["-p", "pieceworks.testing.plugin"]  # this checkout is not installed: name the plugin
    # one thread: the tensors are tiny, and CI machines are small
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=site, env=env, capture_output=True, text=True, timeout=600)


def failures(xml: Path) -> dict[str, list[str]]:
    """backend key -> failure messages of its cases, from a JUnit report."""
    out: dict[str, list[str]] = {}
    for case in ET.parse(xml).iter("testcase"):
        key = re.search(r"attention\.\w+", case.get("name", ""))
        for bad in [*case.iter("failure"), *case.iter("error")]:
            out.setdefault(key.group(0) if key else "?", []).append((bad.get("message") or "") + (bad.text or ""))
    return out


def test_suite_passes_the_docs_example_and_a_correct_plugin(site):
    res = suite(site, "--pieceworks-backend", "attention.mine", "--pieceworks-backend", "attention.tiled")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    for key in ("attention.mine", "attention.tiled"):
        assert re.search(rf"{key} \(under test\): \d+ passed, 0 failed", res.stdout), res.stdout[-3000:]


def test_suite_fails_each_broken_copy_and_a_backend_whose_every_case_skips(site, tmp_path):
    xml = tmp_path / "report.xml"
    args = [a for name in [*BROKEN, "notimportable"] for a in ("--pieceworks-backend", f"attention.{name}")]
    res = suite(site, *args, f"--junitxml={xml}")
    assert res.returncode == 1, res.stdout[-6000:] + res.stderr[-3000:]
    found = failures(xml)
    for name, says in BROKEN.items():
        messages = found.get(f"attention.{name}", [])
        assert messages, f"the suite passed attention.{name}:\n{res.stdout[-4000:]}"
        assert any(says in m for m in messages), (name, says, [m[:600] for m in messages])
    # check() wrongly says "not importable": every case skips, which fails the run and is named
    assert "attention.notimportable" not in found
    assert "NOT TESTED: attention.notimportable: every case skipped: attention.notimportable can't serve here: " \
           "module 'mykernels_ext' is not importable (pip install mykernels)" in res.stdout, res.stdout[-4000:]
    assert "a skip is not a pass" in res.stdout


def test_allow_skip_accepts_an_untested_backend(site):
    res = suite(site, "--pieceworks-backend", "attention.notimportable", "--pieceworks-allow-skip")
    assert res.returncode == 0, res.stdout[-4000:]
    assert "NOT TESTED: attention.notimportable" in res.stdout and "--pieceworks-allow-skip: the backends above" in res.stdout


def test_unknown_backend_is_a_usage_error(site):
    res = suite(site, "--pieceworks-backend", "attention.nosuch")
    assert res.returncode == 4 and "no backend attention.nosuch is registered" in res.stderr, res.stderr[-2000:]
