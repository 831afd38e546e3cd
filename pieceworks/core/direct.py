"""Custom ops that skip the dispatcher when nothing traces them.

Every kernel entry the models call is a `torch.library` custom op, so that Dynamo traces a model with
`fullgraph=True` and sees each op as one opaque node (piecewise graphs split at the attention ops).
Called eagerly, an op goes through the dispatcher (autograd and ADInplaceOrView wrappers, argument
normalization, a Dynamo-disabled frame): 20-60 us of host time per call on the CPU machine, for ops
whose kernels take a few microseconds at small token counts, five or more per layer.

`direct(op, impl)` is what the models call instead of `op`: while Dynamo traces
(`torch.compiler.is_compiling()`), the op itself, so the graph gets its node; otherwise `impl`, the
function the op runs, called straight (with `cuda=`, the op's CUDA kernel for CUDA tensors). Eager
forwards, CUDA-graph captures of eager code and the op's own dispatch run the same function, so their
results are the same bits.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from pieceworks.core.context import get_forward_context

_compiling = torch.compiler.is_compiling


def direct(op: Callable, impl: Callable, cuda: Callable | None = None) -> Callable:
    """`op` under Dynamo, else `impl(*args)` (or `cuda(*args)` when the first argument is a CUDA tensor).

    Args:
        op: a `torch.library` custom op (CustomOpDef or OpOverloadPacket).
        impl: the op's implementation (its registered default); `cuda`: its CUDA kernel, if it has one.
    """
    if cuda is None:
        def call(*args, **kwargs):
            if _compiling():
                return op(*args, **kwargs)
            return impl(*args, **kwargs)
    else:
        def call(*args, **kwargs):
            if _compiling():
                return op(*args, **kwargs)
            return (cuda if args[0].is_cuda else impl)(*args, **kwargs)
    return functools.update_wrapper(call, impl)


def backend_method(op: str, method: str) -> Callable:
    """The implementation of an op that hands its arguments on to the step's backend: calls `method` of
    the backend the forward context holds for `op` (e.g. ("fp4_gemm", "forward_swiglu"))."""
    def call(*args):
        return getattr(getattr(get_forward_context().kernels, op), method)(*args)
    return call
