"""The request layer above the executor: SamplingParams, the batched device sampler, the Engine
(scheduling with chunked prefill, admission by pages, preemption by recompute, prefix caching,
detokenization) and AsyncEngine. Imports only executor/ and the layers below it.

The Engine classes load lazily (`pieceworks.engine.Engine`), so importing SamplingParams doesn't
import the executor.
"""

from __future__ import annotations

from typing import Any

from pieceworks.engine.params import SamplingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "Engine", "AsyncEngine", "RequestOutput"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from pieceworks.engine.engine import Engine

        return Engine
    if name == "AsyncEngine":
        from pieceworks.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "RequestOutput":
        from pieceworks.engine.request import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'pieceworks.engine' has no attribute {name!r}")
