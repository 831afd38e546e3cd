"""English texts shipped with pieceworks (sources and licenses in `README.md` beside this file)."""

from __future__ import annotations

from pathlib import Path

ENGLISH_TXT = Path(__file__).with_name("english.txt")
"""The evaluation text for perplexity checks: the GNU GPL v3 (35 KB of English, verbatim)."""

CALIBRATION_TXT = Path(__file__).with_name("calibration.txt")
"""The calibration text for NVFP4 activation scales: the GNU FDL v1.3 (23 KB, verbatim). A different
document from `ENGLISH_TXT`, so a model is never calibrated on its eval text."""


def english_text() -> str:
    """The contents of `ENGLISH_TXT`."""
    return ENGLISH_TXT.read_text(encoding="utf-8")


def calibration_text() -> str:
    """The contents of `CALIBRATION_TXT`."""
    return CALIBRATION_TXT.read_text(encoding="utf-8")
