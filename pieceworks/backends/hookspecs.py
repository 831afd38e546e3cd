"""Hook specifications for pieceworks plugins.

A plugin is a module or object with functions marked `@pieceworks.hookimpl`, registered under the
entry-point group ``pieceworks`` of its package::

    [project.entry-points.pieceworks]
    mykernels = "mykernels.plugin"

Hooks run when an executor is built (discovery and selection), never per step. Specs only ever grow by
gaining arguments, so a plugin written against an older pieceworks keeps working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pieceworks.backends.base import Backend, BackendSpec, Candidate
    from pieceworks.core.batch import ForwardMode, GraphMode

PROJECT = "pieceworks"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def pieceworks_register_backends() -> "list[type[Backend]]":
    """Return the backend classes this plugin provides.

    Built-in backends are registered through this same hook. Each class declares its op, name,
    priority, requirements, forward modes, graph modes and numerics (see
    :class:`pieceworks.backends.base.Backend`); a (op, name) pair registered twice is an error.

    :return: A list of Backend subclasses (may be empty).

    Called once per registry load; the results of all plugins are concatenated.
    """


@hookspec
def pieceworks_adjust_candidates(
    op: str,
    forward_mode: "ForwardMode",
    graph_mode: "GraphMode",
    spec: "BackendSpec",
    candidates: "list[Candidate]",
) -> None:
    """Veto or reorder the candidates for one kernel-table entry before the choice is made.

    :param op: The op being resolved (``attention``, ``mla``, ``fp4_gemm``, ``moe``).
    :param forward_mode: The forward mode of the entry.
    :param graph_mode: The graph mode of the entry.
    :param spec: The machine and model the table is built for.
    :param candidates: Backends that can serve this op, best first. Reorder the list in place, or
        veto one with ``candidate.veto("reason")``; the reason is shown in the selection log and
        ``pieceworks backends``.

    Runs only for ``auto`` selections; a backend named in the config is used or refused, never
    overridden by a plugin. Called for every (op, forward mode, graph mode) entry at build time.
    """
