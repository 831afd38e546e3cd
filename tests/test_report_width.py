"""`pieceworks backends` in an 80-column terminal: every line fits, and every reason is still printed."""

from __future__ import annotations

import io

from rich.cells import cell_len
from rich.console import Console

from pieceworks import report
from pieceworks.backends.base import BackendSpec
from pieceworks.backends.registry import load_registry
from pieceworks.config import load_config
from pieceworks.core.devices import resolve_device


def test_backends_fit_80_columns_with_every_reason(monkeypatch):
    cfg = load_config(None, [], require_model=False)
    out = io.StringIO()
    monkeypatch.setattr(report, "console", Console(file=out, width=80, color_system=None))
    assert report.print_backends(cfg) == 0
    text = out.getvalue()
    lines = text.splitlines()
    assert max(cell_len(line) for line in lines) <= 80, [line for line in lines if cell_len(line) > 80]
    assert "…" not in text  # nothing cut off

    facts, _ = report._model_facts(cfg)
    spec = BackendSpec.for_device(resolve_device(cfg.runtime.device), model=facts,
                                  fp4_numerics=cfg.quantization.fp4_numerics)
    registry = load_registry(cfg.plugins)
    refused = [(cls, registry.reasons(cls, spec)) for cls in registry.backends()]
    refused = [(cls, reasons) for cls, reasons in refused if reasons]
    assert refused  # without a GPU, the GPU backends are refused
    flat = " ".join(text.split())
    split = 0
    for cls, reasons in refused:
        assert f"{cls.op}.{cls.name}" in flat
        for reason in reasons:
            assert " ".join(reason.split()) in flat, reason  # the words in order, across line breaks
            split += not any(reason in line for line in lines)
    assert split > 0  # the long reasons are wrapped over several lines
