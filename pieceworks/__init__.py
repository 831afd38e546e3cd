"""pieceworks: a model executor for FP4 models with pluggable kernel backends and piecewise CUDA graphs.

Public API: `Executor`, `Engine`, `AsyncEngine`, `SamplingParams`, `StructuredOutputsParams`,
`RequestOutput`, `load_config`, `Config`, `hookimpl` (for plugins), and the typed errors of
`pieceworks.errors` (`ConfigError`, `CheckpointError`, `RequestError`, `BatchError`, `OutOfPages`,
`NonFiniteLogits`). `import pieceworks` loads nothing but the errors and the version: everything else is
imported on first use, so the CLI handles Ctrl-C from its first instant, and kernel libraries (flashinfer,
triton) and reference libraries (transformers) load only when a backend or test needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pieceworks.errors import (BatchError, CheckpointError, ConfigError, NonFiniteLogits, OutOfPages,
                               RequestError)
from pieceworks.version import __version__

if TYPE_CHECKING:
    from pieceworks.backends.hookspecs import hookimpl
    from pieceworks.config import Config, load_config
    from pieceworks.engine.async_engine import AsyncEngine
    from pieceworks.engine.engine import Engine
    from pieceworks.engine.params import SamplingParams, StructuredOutputsParams
    from pieceworks.engine.request import RequestOutput
    from pieceworks.executor.runner import Executor

__all__ = ["Executor", "Engine", "AsyncEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "Config", "load_config", "hookimpl", "ConfigError", "CheckpointError", "RequestError", "BatchError",
           "OutOfPages", "NonFiniteLogits", "__version__"]

_LAZY = {
    "Executor": "pieceworks.executor.runner",
    "Config": "pieceworks.config",
    "load_config": "pieceworks.config",
    "hookimpl": "pieceworks.backends.hookspecs",
    "Engine": "pieceworks.engine.engine",
    "AsyncEngine": "pieceworks.engine.async_engine",
    "SamplingParams": "pieceworks.engine.params",
    "StructuredOutputsParams": "pieceworks.engine.params",
    "RequestOutput": "pieceworks.engine.request",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pieceworks' has no attribute {name!r}")
