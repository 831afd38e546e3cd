"""pytest plugin for pieceworks and for backend authors (`-p pieceworks.testing.plugin`).

- `@pytest.mark.gpu` tests skip, with the reason, where no CUDA device is present.
- `--pieceworks-device` picks the devices the backend-matrix suite runs on (default: cpu, plus cuda
  when present).
"""

from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--pieceworks-device", action="append", default=None,
                     help="device(s) for the backend-matrix suite (default: cpu and, if present, cuda)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped with a reason when none is present)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on a CPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present (run it on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def matrix_devices(config: pytest.Config) -> list[str]:
    chosen = config.getoption("--pieceworks-device", default=None)
    if chosen:
        return list(chosen)
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
