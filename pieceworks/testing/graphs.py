"""Graph-safety checks for the backends that declare FULL or PIECEWISE.

- `traced(fn)` (any device, no GPU needed): `fn` under `torch.compile(fullgraph=True)` with Dynamo's
  eager backend, so nothing is compiled but every host sync (`.item()`, `.tolist()`, `nonzero`) and every
  branch on a tensor's value is a graph break, which `fullgraph=True` turns into an error.
- `CaptureRun` (CUDA): a `PoolRun` whose decode steps replay one CUDA graph, as the decode graph runner
  does: plan, one eager warm-up of every layer, capture every layer's forward once, then for each step
  re-plan with new lengths into the same static buffers, copy fresh inputs and replay. A sync or a copy
  from host memory inside forward fails the capture; a `plan` that leaves the graph reading stale
  buffers fails the replayed step's checks.
- `capture_replay(fn, inputs)` (CUDA): the same for an op without plan (fp4_gemm, moe): capture `fn` on
  static inputs, replay it on new values, compare with an eager call.
- `stand_in_capture(runner)` (any device): captures a CPU piecewise runner's pieces with stand-in
  graphs, so its replay path runs without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Callable
from unittest import mock

import torch
from torch.utils._pytree import tree_leaves

from pieceworks.testing.contract import ContractError, PoolRun


# what a graph-safe forward must not contain: host syncs and values that depend on tensor contents
SYNC_METHODS = {"item", "tolist", "nonzero", "cpu", "numpy", "__bool__", "__int__", "__float__", "any", "all"}


def _sync_ops() -> set:
    aten = torch.ops.aten
    return {torch.nonzero, torch.Tensor.item, torch.Tensor.tolist, torch.tensor, aten._local_scalar_dense.default,
            aten.nonzero.default, aten._assert_scalar.default}


def _host_syncs(gm: torch.fx.GraphModule) -> list[str]:
    found = []
    for node in gm.graph.nodes:
        sync = (node.op == "call_method" and node.target in SYNC_METHODS and node.target not in ("any", "all")) \
            or (node.op == "call_function" and node.target in _sync_ops())
        if sync:
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            if name.startswith("_assert_scalar"):  # Dynamo's guard on a value read from a tensor
                name = "a value read from a tensor"
            code = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines()
                    if ln.strip() and set(ln.strip()) - set("^~ ")]
            found.append(f"{name}" + (f" at `{code[-1]}`" if code else ""))
    return found


def traced(fn: Callable, what: str) -> Callable:
    """`fn` traced whole by Dynamo and run from the traced graph; a graph break, a host sync (`.item()`,
    `.tolist()`, `nonzero`) or a tensor built from host data in it raises ContractError naming `what`."""
    import torch._dynamo

    def inspect(gm: torch.fx.GraphModule, example_inputs):
        syncs = _host_syncs(gm)
        if syncs:
            raise ContractError(f"{what} syncs with the host or reads tensor values on the host: "
                                f"{'; '.join(dict.fromkeys(syncs))}")
        return gm.forward

    compiled = torch.compile(fn, fullgraph=True, backend=inspect, dynamic=False)

    def run(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except ContractError as exc:
            raise ContractError(f"{exc}. A backend declaring FULL must not do that in forward: move it to "
                                "plan()") from None
        except Exception as exc:
            inner = exc  # torch 2.11 chains the backend's error as __cause__, 2.13 keeps it as inner_exception
            while not isinstance(inner, ContractError):
                nxt = inner.__cause__ or getattr(inner, "inner_exception", None)
                if nxt is None:
                    break
                inner = nxt
            if isinstance(inner, ContractError):
                raise ContractError(f"{inner}. A backend declaring FULL must not do that in forward: move "
                                    "it to plan()") from None
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            if isinstance(exc, torch._dynamo.exc.RecompileError):
                raise ContractError(
                    f"{what} traces to another graph for a later step ({first}): a FULL graph replays the values "
                    "it captured, so what changes per step (lengths, counts) must come from tensors plan() fills, "
                    "not from Python values read in forward") from exc
            raise ContractError(
                f"{what} is not traceable as one graph (torch.compile fullgraph=True): {first}. A FULL graph "
                "replays the captured kernels only: forward must not sync with the host (.item(), .tolist(), "
                "nonzero, printing a tensor), branch on tensor values, or do host work each step needs (sleeping, "
                "I/O, calls Dynamo can't trace): move that work to plan()") from exc

    return run


class CaptureRun(PoolRun):
    """A FULL-graph PoolRun on CUDA: one graph captured at the first step, replayed for every step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graph_obj: torch.cuda.CUDAGraph | None = None
        self.static_in: list[dict] = []
        self.static_out: list[torch.Tensor] = []

    def forward_all(self, xs: list[dict]) -> list[torch.Tensor]:
        if self.graph_obj is None:
            self.static_in = [{k: v.clone() for k, v in x.items()} for x in xs]
            rows = next(iter(xs[0].values())).shape[0]
            self.static_out = [torch.zeros(self.shape.out_shape(rows), dtype=self.dtype, device=self.device)
                               for _ in xs]
            self._layers()  # eager warm-up (backends may learn the scale or build kernels here)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self._layers()
            except Exception as exc:
                raise ContractError(
                    f"forward can't be captured in a CUDA graph although the backend declares FULL: "
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''} "
                    "(no host syncs, no tensors built from host data, no kernel-library setup in forward: "
                    "do that in plan())") from exc
            self.graph_obj = graph
        for static, x in zip(self.static_in, xs):
            for k, v in x.items():
                static[k].copy_(v)
        for out in self.static_out:
            out.fill_(float("nan"))
        self.graph_obj.replay()
        torch.cuda.synchronize()
        for x, static in zip(xs, self.static_in):  # the inputs the replayed forward was given
            x.update(static)
        return [out.clone() for out in self.static_out]

    def _layers(self) -> None:
        for layer, (x, out) in enumerate(zip(self.static_in, self.static_out)):
            self.shape.call(self.impl, x, out, layer, self.scale, self.pool)


def capture_replay(fn: Callable[..., torch.Tensor], make_inputs: Callable[[int], tuple], what: str,
                   tol: float) -> None:
    """Capture `fn(*make_inputs(0))` in a CUDA graph, replay it on `make_inputs(1)` copied into the static
    inputs, and compare with an eager `fn(*make_inputs(1))` (relative error <= tol)."""
    from pieceworks.testing.contract import rel_err

    static = make_inputs(0)
    fn(*static)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn(*static)
    except Exception as exc:
        raise ContractError(f"{what}: forward can't be captured in a CUDA graph although the backend declares "
                            f"graph safety: {type(exc).__name__}: {exc}") from exc
    fresh = make_inputs(1)
    for s, f in zip(static, fresh):
        if isinstance(s, torch.Tensor) and s.is_floating_point():
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    want = fn(*fresh)
    err = rel_err(out, want)
    if not err <= tol:
        raise ContractError(f"{what}: the replayed graph on new inputs is {err:.2e} from an eager call "
                            f"(tolerance {tol:.0e}): forward reads something the graph did not capture")


class StandInGraph:
    """Where `stand_in_capture` puts a CUDA graph: `replay()` runs the piece again on the tensors it was
    captured with and copies the result into the captured outputs (fixed addresses, as a graph has), or,
    for host timing (`rerun=False`), does nothing."""

    def __init__(self) -> None:
        self.piece: Callable | None = None
        self.args: tuple = ()
        self.outputs: list[torch.Tensor] = []

    def replay(self) -> None:
        if self.piece is not None:
            for dst, src in zip(self.outputs, tree_leaves(self.piece(*self.args))):
                dst.copy_(src)


def stand_in_capture(runner, rerun: bool = True) -> None:
    """Capture every size of a CPU `PiecewiseRunner` (executor/piecewise.py) with `StandInGraph`s: its
    steps then take the replay path (recorded programs included) as on CUDA, without a GPU."""
    from pieceworks.executor.piecewise_split import PieceRunner

    real = PieceRunner._capture

    def capture(self, size: int, args: tuple):
        out = real(self, size, args)
        entry = self.entries[size]
        if rerun:
            entry.graph.piece, entry.graph.args, entry.graph.outputs = self.piece, args, tree_leaves(entry.output)
        return out

    with mock.patch.object(torch.cuda, "CUDAGraph", StandInGraph), \
            mock.patch.object(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext()), \
            mock.patch.object(PieceRunner, "_capture", capture):
        runner.use_graphs = True
        for size in reversed(runner.sizes):
            runner._dummy_step(size, "direct")
            runner._dummy_step(size, "capture")
