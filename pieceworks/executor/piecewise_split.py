"""The split half of piecewise graphs: the torch.compile backend and the pieces it makes.

`PiecewiseBackend` receives the model's FX graph (traced once by `torch.compile(fullgraph=True)`, the
token dimension dynamic) and splits it at the splitting ops (`attention`, `mla`), keeping order. A piece
that is exactly one splitting op becomes a direct call of the op's implementation; every other piece
is wrapped in a `PieceRunner`: on CUDA it holds one CUDA graph per capture size (captured largest
first, all pieces and sizes in the owner's memory pool); on CPU it runs the piece directly. The owner,
`executor/piecewise.py`'s `PiecewiseRunner`, sets the phase (direct, capture, replay) and the size; it is
typed `Any` here so that this module stays below that one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_map

from pieceworks.backends.ops import is_splitting_node_target, splitting_impl
from pieceworks.core.batch import mark_replayed

log = logging.getLogger("pieceworks.piecewise")


def weak_ref(t: Any) -> Any:
    """A CUDA tensor aliasing `t`'s memory without keeping it allocated (other tensors pass through).

    Graph outputs are kept this way, as vLLM does, so that memory freed during one capture is reused by
    the next (liveness during replay is the same as during capture, since replay order is capture
    order). Built on `__cuda_array_interface__`: torch keeps the interface object alive, not the block.
    """
    if not isinstance(t, torch.Tensor) or not t.is_cuda or t.numel() == 0:
        return t
    size = t.element_size()
    iface = {
        "shape": tuple(t.shape),
        "strides": tuple(s * size for s in t.stride()),
        "typestr": {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[size],
        "data": (t.data_ptr(), False),
        "version": 2,
    }
    holder = type("_CudaArray", (), {"__cuda_array_interface__": iface})()
    return mark_replayed(torch.as_tensor(holder, device=t.device).view(t.dtype))


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    output: Any
    input_ptrs: list[tuple[int, int]]  # (arg index, data_ptr) of tensor inputs at capture
    static_inputs: dict[int, torch.Tensor] = field(default_factory=dict)


class PieceRunner:
    """Runs one piece of the split graph: directly, or captured/replayed per capture size."""

    def __init__(self, owner: Any, piece: torch.fx.GraphModule, index: int, is_last: bool):
        self.owner = owner
        self.piece = piece
        self.index = index
        self.is_last = is_last
        self.entries: dict[int, _Entry] = {}

    def __call__(self, *args: Any) -> Any:
        phase = self.owner.phase
        if phase == "direct":
            return self.piece(*args)
        size = self.owner.current_size
        if phase == "capture":
            return self._capture(size, args)
        entry = self.entries[size]
        recording = self.owner.recording
        for i, ptr in entry.input_ptrs:
            if args[i].data_ptr() != ptr:  # an input that is not where the graph reads it
                entry.static_inputs[i].copy_(args[i])
                self.owner.recordable = False  # the copy's source need not be the same tensor next step
        entry.graph.replay()
        if recording is not None:
            recording.append((entry.graph.replay, ()))
        return entry.output

    def _capture(self, size: int, args: tuple) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.owner.pool):
            out = self.piece(*args)
            if self.is_last:  # nothing else reads it: free it to the pool right away
                out = tree_map(weak_ref, out)
        fixed = self.owner.fixed_ptrs
        ptrs = [(i, a.data_ptr()) for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and a.data_ptr() not in fixed]
        statics = {i: weak_ref(args[i]) for i, _ in ptrs}
        self.entries[size] = _Entry(graph, tree_map(weak_ref, out), ptrs, statics)
        self.owner.num_graphs += 1
        return out


class PiecewiseBackend:
    """The torch.compile backend: split at the splitting ops, wrap the other pieces in PieceRunners."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.num_compiles = 0
        self.recordable = True  # every splitting piece is a direct call (whose calls can be recorded)
        self.split_gm: torch.fx.GraphModule | None = None
        self.pieces: list[PieceRunner] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.num_compiles += 1
        if self.num_compiles > 1:
            log.warning("piecewise model traced again (%d times): a Dynamo guard failed", self.num_compiles)
        part = 0
        node_part: dict[torch.fx.Node, int] = {}
        for node in gm.graph.nodes:
            if node.op == "call_function" and is_splitting_node_target(node.target):
                part += 1
                node_part[node] = part
                part += 1
            else:
                node_part[node] = part
        split_gm = split_module(gm, None, lambda n: node_part[n], keep_original_order=True)
        names = [n.target for n in split_gm.graph.nodes if n.op == "call_module"]
        runnable = [n for n in names if not _is_splitting_piece(getattr(split_gm, n))]
        self.recordable = True
        for name in names:
            if name not in runnable:
                direct = _direct_call(getattr(split_gm, name), self.owner)
                if direct is not None:
                    split_gm.__dict__[name] = direct
                else:  # runs as a submodule: nothing records its calls
                    self.recordable = False
        pieces = []
        for i, name in enumerate(runnable):
            runner = PieceRunner(self.owner, getattr(split_gm, name), i, is_last=name == runnable[-1])
            split_gm.__dict__[name] = runner  # called by the split graph's code; not a submodule
            pieces.append(runner)
        self.split_gm, self.pieces = split_gm, pieces
        self.num_splitting = len(names) - len(runnable)
        return split_gm

    def release(self) -> None:
        """Let go of the runner, the pieces and their graphs (`PiecewiseRunner.release`): Dynamo keeps
        this backend and the split graph it returned for the life of the process."""
        if self.split_gm is not None:
            for node in self.split_gm.graph.nodes:
                if node.op == "call_module":
                    self.split_gm.__dict__[node.target] = _released
        self.split_gm, self.pieces, self.owner = None, [], None

    def unique_pieces(self) -> int:
        """How many structurally different pieces (identical layers give identical pieces)."""
        return len({_structure(p.piece.graph) for p in self.pieces})


def _is_splitting_piece(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and is_splitting_node_target(n.target) for n in gm.graph.nodes)


def _direct_call(gm: torch.fx.GraphModule, owner: Any) -> Callable | None:
    """For a piece that is exactly `placeholders -> one splitting op -> output`, a function calling the
    op's implementation directly with the same arguments (no dispatcher on the per-layer path), adding
    the call to `owner.recording` while one is made."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(calls) != 1 or calls[0].kwargs or len(gm.graph.nodes) != len(placeholders) + 2:
        return None
    impl = splitting_impl(calls[0].target)
    if impl is None:
        return None
    slots = [placeholders.index(a) if isinstance(a, torch.fx.Node) else None for a in calls[0].args]
    consts = list(calls[0].args)

    def call(*args: Any) -> None:
        bound = [args[i] if i is not None else c for i, c in zip(slots, consts)]
        impl(*bound)
        if owner.recording is not None:
            owner.recording.append((impl, tuple(bound)))

    return call


def _structure(graph: torch.fx.Graph) -> tuple:
    """A piece's graph with node names replaced by positions (per-layer parameter names differ)."""
    index = {n: i for i, n in enumerate(graph.nodes)}

    def norm(a: Any) -> Any:
        return ("node", index[a]) if isinstance(a, torch.fx.Node) else a

    return tuple(
        (n.op, "" if n.op == "placeholder" else str(n.target),
         repr(torch.fx.node.map_aggregate(n.args, norm)), repr(torch.fx.node.map_aggregate(n.kwargs, norm)))
        for n in graph.nodes
    )


def _released(*args: Any) -> None:
    raise RuntimeError("this piecewise runner was released (Executor.close); build a new executor")
