"""Which graph runners an executor gets, from `cuda_graph.*` and the device: piecewise graphs for extend
and mixed steps (on CUDA by default; on the CPU the same split runs directly when switched on) and full
decode graphs (CUDA only)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from pieceworks.config import Switch

log = logging.getLogger("pieceworks.executor")


def build_graph_runners(graphs_cfg: Any, model: torch.nn.Module, table: Any, kv: Any, max_context: int,
                        progress: bool) -> tuple[Any, Any]:
    """(PiecewiseRunner or None, DecodeGraphRunner or None) for `graphs_cfg` (a CudaGraphConfig)."""
    on_cuda = kv.device.type == "cuda"
    piecewise = decode_graphs = None
    pw = graphs_cfg.piecewise
    if pw.enabled is Switch.on or (pw.enabled is Switch.auto and on_cuda):
        from pieceworks.executor.piecewise import PiecewiseRunner

        piecewise = PiecewiseRunner(model, table, kv, pw, progress=progress)
    dec = graphs_cfg.decode
    if dec.enabled is not Switch.off:
        from pieceworks.executor.cuda_graph import check_batch_sizes

        check_batch_sizes(dec.batch_sizes, kv.allocator.capacity, kv.page_size)
    if on_cuda and dec.enabled is not Switch.off:
        from pieceworks.executor.cuda_graph import DecodeGraphRunner

        decode_graphs = DecodeGraphRunner(model, table, kv, max_context, dec.batch_sizes, progress=progress)
    elif dec.enabled is Switch.on:
        log.info("cuda_graph.decode.enabled=on has no effect on %s: decode graphs need CUDA", kv.device)
    return piecewise, decode_graphs
