"""pieceworks: a model executor for FP4 models with pluggable kernel backends and piecewise CUDA graphs.

Public API: `Executor`, `Engine`, `AsyncEngine`, `SamplingParams`, `RequestOutput`, `load_config`,
`hookimpl` (for plugins). `import pieceworks` stays light: kernel
libraries (flashinfer, triton) and reference libraries (transformers) load only when a backend or
test needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pieceworks.backends.hookspecs import hookimpl
from pieceworks.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from pieceworks.engine.async_engine import AsyncEngine
    from pieceworks.engine.engine import Engine
    from pieceworks.engine.params import SamplingParams
    from pieceworks.engine.request import RequestOutput
    from pieceworks.executor.runner import Executor

__version__ = "0.1.0"
__all__ = ["Executor", "Engine", "AsyncEngine", "SamplingParams", "RequestOutput", "Config", "ConfigError", "load_config", "hookimpl", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Executor":
        from pieceworks.executor.runner import Executor

        return Executor
    if name in ("Engine", "AsyncEngine", "SamplingParams", "RequestOutput"):
        import pieceworks.engine

        return getattr(pieceworks.engine, name)
    raise AttributeError(f"module 'pieceworks' has no attribute {name!r}")
