"""pieceworks: a model executor for FP4 models with pluggable kernel backends and piecewise CUDA graphs.

Public API: `Executor`, `load_config`, `hookimpl` (for plugins). `import pieceworks` stays light: kernel
libraries (flashinfer, triton) and reference libraries (transformers) load only when a backend or
test needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pieceworks.backends.hookspecs import hookimpl
from pieceworks.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from pieceworks.executor.runner import Executor

__version__ = "0.1.0"
__all__ = ["Executor", "Config", "ConfigError", "load_config", "hookimpl", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Executor":
        from pieceworks.executor.runner import Executor

        return Executor
    raise AttributeError(f"module 'pieceworks' has no attribute {name!r}")
