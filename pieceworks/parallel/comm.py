"""Collectives as custom ops in the `pieceworks` namespace, with fake implementations.

`pieceworks::all_reduce(x, group)` (sum) and `pieceworks::all_gather(x, group)` (concatenate along the
last dimension) are functional: they return a new tensor and take the process group by name (a string
Dynamo keeps as a constant), so the models trace with `fullgraph=True` and the collectives sit inside
the pieces of a piecewise graph and inside the full decode graphs like any other op. They are not
splitting ops and do nothing on the host that a CUDA graph could not capture (NCCL collectives on the
current stream capture into the graph). At world size 1 the models never call them. The models call
`reduce` / `gather`, which leave out the dispatcher in eager code (core/direct.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from pieceworks.core.direct import direct
from pieceworks.parallel.layout import TPLayout


def _all_reduce(x: Tensor, group: str) -> Tensor:
    """The sum of `x` [any shape] over the ranks of process group `group` (same shape and dtype)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_resolve_process_group(group))
    return out


all_reduce = torch.library.custom_op("pieceworks::all_reduce", _all_reduce, mutates_args=())


@all_reduce.register_fake
def _all_reduce_fake(x, group):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(x: Tensor, group: str) -> Tensor:
    """x [T, n] on each of N ranks -> [T, N * n], rank r's columns at [r * n, (r + 1) * n)."""
    pg = _resolve_process_group(group)
    n = dist.get_world_size(pg)
    stacked = x.new_empty((n * x.shape[0], x.shape[1]))
    _gather_single(stacked, x.contiguous(), group=pg)
    return stacked.view(n, x.shape[0], x.shape[1]).transpose(0, 1).reshape(x.shape[0], n * x.shape[1])


all_gather = torch.library.custom_op("pieceworks::all_gather", _all_gather, mutates_args=())


@all_gather.register_fake
def _all_gather_fake(x, group):
    # the world size is not a tensor property: the fake asks the (real) group, which exists at trace time
    n = dist.get_world_size(_resolve_process_group(group))
    return x.new_empty((x.shape[0], n * x.shape[1]))


# What the models call: the op while Dynamo traces, its implementation straight otherwise (core/direct.py).
_reduce_call = direct(all_reduce, _all_reduce)
_gather_call = direct(all_gather, _all_gather)


def reduce(x: Tensor, tp: TPLayout) -> Tensor:
    """Sum of the ranks' partial results (a row-parallel linear's output); x itself without a group."""
    return x if tp.group is None else _reduce_call(x, tp.group)


def gather(x: Tensor, tp: TPLayout) -> Tensor:
    """The ranks' column chunks side by side (vocab-parallel logits); x itself without a group."""
    return x if tp.group is None else _gather_call(x, tp.group)
