"""The SmolLM2 demo model for tests that need a real tokenizer: its directory (the test skips, with the reason,
where the model isn't installed) and copies of its tokenizer files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def smollm2_dir() -> Path:
    """The converted SmolLM2 demo model (`ensure_smollm2`); skips the calling test without it or transformers."""
    pytest.importorskip("transformers", reason="tokenizers load through transformers")
    smollm2 = pytest.importorskip("pieceworks.models.smollm2")
    try:
        return smollm2.ensure_smollm2(progress=False)
    except smollm2.SmolLM2NotInstalled as exc:
        pytest.skip(str(exc))


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of model directory `src` copied into `dst`."""
    from pieceworks.models.smollm2 import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
