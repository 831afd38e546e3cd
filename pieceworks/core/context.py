"""The per-forward context: what the custom ops read while one step runs.

Ops take only tensors and ints (so Dynamo traces them once for every layer and every step); the
kernel choice for the step, its attention metadata and the KV pool come from here. The context is a
contextvar entered by `forward_context(...)`, which refuses nesting: one step at a time per thread.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from pieceworks.core.batch import StepMetadata


@dataclass(frozen=True)
class StepKernels:
    """The backend instance of every op for one (forward mode, graph mode); attributes by op name."""

    attention: Any = None
    mla: Any = None
    fp4_gemm: Any = None
    moe: Any = None


@dataclass(frozen=True)
class ForwardContext:
    """What a running step exposes to the ops.

    Attributes:
        kernels: the backends chosen for this step's (forward mode, graph mode).
        meta: the step's batch metadata (attention backends planned from it before the step).
        kv: the KV pool (`pieceworks.executor.kv_cache.KVPool`), or None for models without attention.
    """

    kernels: StepKernels
    meta: "StepMetadata | None" = None
    kv: Any = None


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "pieceworks_forward_context", default=None
)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` the current forward context for the duration of the block.

    Raises:
        RuntimeError: if a forward context is already active (steps do not nest).
    """
    if _current.get() is not None:
        raise RuntimeError(
            "a pieceworks forward is already running in this thread; forward contexts do not nest "
            "(call Executor.forward from outside the model's forward)"
        )
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    """The active forward context.

    Raises:
        RuntimeError: outside a forward (an op was called without `forward_context`).
    """
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError(
            "pieceworks ops read the kernel choice from the forward context, and none is active: "
            "run the model through Executor.forward, or wrap the call in "
            "pieceworks.core.context.forward_context(...)"
        )
    return ctx


def in_forward() -> bool:
    """Whether a forward context is active."""
    return _current.get() is not None
