"""The backend registry: pluggy discovery, and selection into a frozen KernelTable.

Selection runs once when an executor is built. For every (op, forward mode, graph mode) it collects
the registered backends of the op, asks each for its reasons, lets plugins veto or reorder, and picks:

- a backend named in the config is used if it can serve; if it can't, that is an error listing its
  reasons and the backends that could. The one exception is graph safety: where the named backend
  is not safe in the entry's graph mode, the best backend that is takes its place, and the fallback
  is logged with its reason (the TRT-LLM MLA -> FlashInfer MLA case under piecewise graphs).
- `auto` picks the highest-priority backend with no reasons.

Nothing is looked up here while a model runs: the executor hands `KernelTable.step(...)` to the
forward context.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import pluggy

from pieceworks.backends import hookspecs
from pieceworks.backends.base import (OPS, Backend, BackendSpec, Candidate, SelectionError, bad_check_result,
                                      check_options, options_for, parse_options)
from pieceworks.backends.builtin import BUILTIN_PLUGINS
from pieceworks.backends.plugins import BUILTIN_ORIGIN, IN_PROCESS_ORIGIN, BrokenPlugin, PluginSet, misspelt_group
from pieceworks.core.batch import TABLE_MODES, ForwardMode, GraphMode
from pieceworks.core.context import StepKernels
from pieceworks.errors import ConfigError

log = logging.getLogger("pieceworks.registry")
PLANNED_OPS = ("attention", "mla")  # plan a step's layout: FULL graphs of extend steps need `full_extend`


@dataclass(frozen=True)
class Decision:
    """How one entry was chosen: shown by `pieceworks backends` and logged at build time."""

    op: str
    forward_mode: ForwardMode
    graph_mode: GraphMode
    configured: str
    chosen: str | None
    rejected: tuple[tuple[str, tuple[str, ...]], ...]
    fallback_from: str | None = None
    note: str = ""


@dataclass(frozen=True)
class KernelTable:
    """The frozen choice of backend instance per (op, forward mode, graph mode).

    An entry is None where the op is not needed by the model, or where no backend is safe in that
    graph mode (the executor then runs such steps eagerly; `graph_unavailable` says why).
    """

    entries: dict[tuple[str, ForwardMode, GraphMode], Backend | None]
    decisions: tuple[Decision, ...]
    graph_unavailable: dict[tuple[ForwardMode, GraphMode], str]
    _steps: dict[tuple[ForwardMode, GraphMode], StepKernels] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for mode, graphs in TABLE_MODES.items():
            for graph in graphs:
                kernels = {op: self.entries.get((op, mode, graph)) for op in OPS}
                self._steps[(mode, graph)] = StepKernels(**kernels)

    def get(self, op: str, mode: ForwardMode, graph: GraphMode) -> Backend | None:
        return self.entries.get((op, mode, graph))

    def step(self, mode: ForwardMode, graph: GraphMode) -> StepKernels:
        """The kernels of one step (IDLE steps get an empty set)."""
        return self._steps.get((mode, graph), StepKernels())

    def instances(self, op: str) -> list[Backend]:
        """Distinct backend instances chosen for `op` anywhere in the table."""
        seen: dict[int, Backend] = {}
        for (o, _, _), b in self.entries.items():
            if o == op and b is not None:
                seen[id(b)] = b
        return list(seen.values())

    def graph_mode_ok(self, mode: ForwardMode, graph: GraphMode) -> bool:
        return (mode, graph) not in self.graph_unavailable


class Registry:
    """Backends known to this process: built-ins and entry-point plugins, through pluggy.

    Loading is idempotent (every tensor-parallel worker may call `load()` again). Blocked plugin names
    (config `plugins.disabled`) are never loaded. A broken plugin is left out and listed in `broken`
    (`pieceworks.backends.plugins`); it stops only a selection that names one of its backends.
    """

    def __init__(self, disabled: Iterable[str] = (), autoload: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.autoload = autoload
        self.disabled = list(disabled)
        for name in disabled:
            self.pm.set_blocked(name)
        self.plugins = PluginSet(self.pm)
        self._loaded = False

    def load(self) -> "Registry":
        if self._loaded:
            return self
        self._load_builtins()
        if self.autoload:
            self.plugins.add_entry_points()
        self._loaded = True
        return self

    def _load_builtins(self) -> None:
        # first, so that a plugin re-registering a built-in key is the one left out
        for name, plugin in BUILTIN_PLUGINS.items():
            self.plugins.add(name, plugin, BUILTIN_ORIGIN)

    def _load_entrypoints(self) -> None:
        self.plugins.add_entry_points()

    def register_plugin(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin object or module (tests, embedders)."""
        self._load_builtins()
        self.plugins.add(name, plugin, IN_PROCESS_ORIGIN)

    def plugin_names(self) -> list[str]:
        """Plugins in use (broken and blocked ones excluded)."""
        return [name for name, plugin in self.pm.list_name_plugin() if plugin is not None]

    @property
    def broken(self) -> list[BrokenPlugin]:
        """Plugins left out because they can't be used, with the reasons (see `pieceworks.backends.plugins`)."""
        self.load()
        return list(self.plugins.broken)

    def origin(self, cls: type[Backend]) -> str:
        """`plugin NAME (origin)` of the plugin that registered `cls`."""
        name = self.plugins.owner.get(cls.key(), "?")
        return f"plugin {name!r} ({self.plugins.origins.get(name, 'unknown origin')})"

    def backends(self, op: str | None = None) -> list[type[Backend]]:
        """Registered backend classes (of one op), best first: higher priority, then name."""
        self.load()
        found = [cls for classes in self.plugins.provided.values() for cls in classes]
        out = [c for c in found if op is None or c.op == op]
        return sorted(out, key=lambda c: (-c.priority, c.name))

    def reasons(self, cls: type[Backend], spec: BackendSpec) -> list[str]:
        """`cls.check(spec)`, with a raising check turned into a reason that names its plugin (a bug in
        one plugin must not stop executors that would not have chosen it)."""
        try:
            got = cls.check(spec)
        except Exception as exc:
            name = self.plugins.owner.get(cls.key(), "?")
            return [f"check() raised {type(exc).__name__}: {exc} (a bug in {self.origin(cls)}; block it with "
                    f"plugins.disabled=[{name}])"]
        bad = bad_check_result(cls, got)
        return list(got) if bad is None else [f"{bad} (a bug in {self.origin(cls)})"]

    def resolve(
        self, backends_cfg: Any, spec: BackendSpec, ops: Iterable[str] = OPS
    ) -> KernelTable:
        """Build the kernel table for `spec`.

        Args:
            backends_cfg: a `pieceworks.config.BackendsConfig`.
            spec: the machine and the model.
            ops: the ops the model calls (others get no entries).

        Raises:
            SelectionError: a configured backend can't serve (message lists its reasons and the
                backends that could), or no backend can serve a required op.
        """
        ops = [op for op in OPS if op in set(ops)]
        _check_names(backends_cfg, self.backends(), self.plugins.broken, self.disabled)
        check_options(backends_cfg, self.backends())
        entries: dict = {}
        decisions: list[Decision] = []
        unavailable: dict = {}
        instances: dict[str, Backend] = {}

        def instance(cls: type[Backend]) -> Backend:
            if cls.key() not in instances:
                opts = parse_options(cls, options_for(backends_cfg, cls))
                instances[cls.key()] = cls(spec, opts)
            return instances[cls.key()]

        for op in ops:
            all_backends = self.backends(op)
            for mode, graphs in TABLE_MODES.items():
                configured = backends_cfg.choice(op, "decode" if mode is ForwardMode.DECODE else "extend")
                eager_choice = None
                for graph in graphs:
                    cls, decision = self._choose(op, mode, graph, configured, all_backends, spec)
                    if graph is GraphMode.EAGER:
                        eager_choice = cls
                    elif cls is None:
                        unavailable[(mode, graph)] = decision.note
                    elif eager_choice is not None and cls is not eager_choice:
                        decision = _with_fallback(decision, eager_choice)
                        log.info(
                            "%s %s under %s graphs: %s instead of %s (%s)",
                            op, mode.value, graph.value, cls.name, eager_choice.name, decision.note,
                        )
                    entries[(op, mode, graph)] = instance(cls) if cls is not None else None
                    decisions.append(decision)
        _check_layouts(entries)
        for d in decisions:
            if d.graph_mode is GraphMode.EAGER:
                log.debug("%s %s: %s (configured: %s)", d.op, d.forward_mode.value, d.chosen, d.configured)
        return KernelTable(entries=entries, decisions=tuple(decisions), graph_unavailable=unavailable)

    def _candidates(self, op, mode, graph, backends, spec) -> list[Candidate]:
        out = []
        for cls in backends:
            reasons = self.reasons(cls, spec)
            if mode not in cls.forward_modes:
                reasons.append(f"does not support {mode.value} steps")
            if graph not in cls.graph_modes:
                reasons.append(f"not safe in {graph.value} CUDA graphs")
            elif graph is GraphMode.FULL and mode is not ForwardMode.DECODE and op in PLANNED_OPS \
                    and not cls.full_extend:
                reasons.append(f"not safe in full CUDA graphs of {mode.value} steps (plans them on the host)")
            out.append(Candidate(cls, reasons))
        return out

    def _choose(self, op, mode, graph, configured, backends, spec):
        cands = self._candidates(op, mode, graph, backends, spec)
        names = [c.backend.name for c in cands]
        rejected = lambda: tuple((c.backend.name, tuple(c.reasons)) for c in cands if not c.ok)  # noqa: E731
        if configured != "auto":
            if configured not in names:
                raise SelectionError(
                    f"backends.{op}: no {op} backend named {configured!r}; registered: "
                    f"{', '.join(names) or 'none'}{left_out(self.plugins.broken)}"
                )
            pinned = cands[names.index(configured)]
            hard = [r for r in pinned.reasons if not r.startswith("not safe in ")]
            if hard:
                could = [c.backend.name for c in cands if c.ok] or ["none"]
                raise SelectionError(
                    f"backends.{op}={configured} can't serve {mode.value} steps here: "
                    f"{'; '.join(hard)}. Backends that could: {', '.join(could)}"
                )
            if pinned.ok:
                return pinned.backend, Decision(op, mode, graph, configured, configured, rejected())
            # Graph safety is the one thing a pinned backend may be replaced for.
            safe = [c for c in cands if c.ok]
            if not safe:
                note = f"no {op} backend is safe in {graph.value} graphs ({configured}: {pinned.reasons[-1]})"
                return None, Decision(op, mode, graph, configured, None, rejected(), note=note)
            note = f"{configured} is {pinned.reasons[-1]}"
            return safe[0].backend, Decision(op, mode, graph, configured, safe[0].backend.name, rejected(),
                                             fallback_from=configured, note=note)
        self._adjust(op=op, forward_mode=mode, graph_mode=graph, spec=spec, candidates=cands)
        ok = [c for c in cands if c.ok]
        if ok:
            return ok[0].backend, Decision(op, mode, graph, "auto", ok[0].backend.name, rejected())
        if graph is not GraphMode.EAGER:
            note = f"no {op} backend is safe in {graph.value} graphs for {mode.value} steps"
            return None, Decision(op, mode, graph, "auto", None, rejected(), note=note)
        detail = "; ".join(f"{c.backend.name}: {', '.join(c.reasons)}" for c in cands) or "none registered"
        raise SelectionError(f"no {op} backend can serve {mode.value} steps here ({detail})")


    def _adjust(self, **kwargs: Any) -> None:
        """Every plugin's `pieceworks_adjust_candidates`, one at a time in pluggy's call order (last
        registered first); a raising plugin is marked broken and the others still run."""
        for impl in reversed(self.pm.hook.pieceworks_adjust_candidates.get_hookimpls()):
            try:
                impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception as exc:
                name = impl.plugin_name
                self.plugins.mark_broken(name, self.plugins.origins.get(name, "unknown origin"),
                                         f"pieceworks_adjust_candidates raised {type(exc).__name__}: {exc}")


def _with_fallback(decision: Decision, eager_choice: type[Backend]) -> Decision:
    reasons = dict(decision.rejected).get(eager_choice.name, ())
    note = decision.note or f"{eager_choice.name}: {'; '.join(reasons) or 'lower ranked here'}"
    return replace(decision, fallback_from=decision.fallback_from or eager_choice.name, note=note)


def left_out(broken: list[BrokenPlugin], width: int = 100) -> str:
    """The broken plugins (which may have registered the backend asked for), one line each with its
    reason cut to `width` characters; `pieceworks backends` shows them in full."""
    if not broken:
        return ""
    lines = []
    for b in broken:
        where = re.sub(r", entry point [^;]*", "", b.origin)  # the distribution(s)
        reason = " ".join(b.reason.split())  # an import error's message may span lines
        reason = reason if len(reason) <= width else reason[: width - 3] + "..."
        lines.append(f"\n  - plugin {b.name!r} ({where}): {reason}")
    return ("; plugins left out as broken (`pieceworks backends` says why in full; plugins.disabled blocks "
            "one):" + "".join(lines))


def _check_names(backends_cfg: Any, all_backends: list[type[Backend]], broken: list[BrokenPlugin],
                 disabled: list[str]) -> None:
    """Every backend named in `backends.<op>` must be registered for that op, also for ops this model
    does not call (`backends.mla=nosuch` on a Llama is a typo, not a no-op). Blocked and broken plugins
    are named too: the backend may be one that they would have registered."""
    for op in OPS:
        names = list(dict.fromkeys(c.name for c in all_backends if c.op == op))  # best first
        for mode in ("extend", "decode"):
            name = backends_cfg.choice(op, mode)
            if name != "auto" and name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                blocked = f"; plugins.disabled blocks {', '.join(disabled)}" if disabled else ""
                raise SelectionError(f"backends.{op}: no {op} backend named {name!r}"
                                     + (f" (did you mean {close[0]!r}?)" if close else "")
                                     + f"; registered: {', '.join(names) or 'none'} (or auto){blocked}"
                                     + left_out(broken))


def _check_layouts(entries: dict) -> None:
    for op in ("fp4_gemm", "moe"):
        chosen = {b.key(): b for (o, _, _), b in entries.items() if o == op and b is not None}
        layouts = {getattr(b, "weight_layout", "linear") for b in chosen.values()}
        if len(layouts) > 1:
            raise SelectionError(
                f"{op}: the backends chosen for different modes ({', '.join(sorted(chosen))}) need "
                f"different weight layouts ({', '.join(sorted(layouts))}); one copy of the weights "
                f"must serve every mode: set backends.{op} to one backend for all modes"
            )


def load_registry(plugins_cfg: Any = None) -> Registry:
    """A loaded registry honouring `plugins.disabled` and `plugins.autoload`.

    Raises:
        ConfigError: `plugins.disabled` names neither a built-in family nor an installed entry point.
    """
    disabled = list(getattr(plugins_cfg, "disabled", []) or [])
    if disabled:
        # an entry point in a misspelt group is reported as broken, and blocking it silences that
        eps = importlib.metadata.entry_points()
        found = {ep.name for group in eps.groups if group == hookspecs.PROJECT or misspelt_group(group)
                 for ep in eps.select(group=group)}
        known = [*BUILTIN_PLUGINS, *sorted(found)]
        unknown = [n for n in disabled if n not in known]
        if unknown:
            raise ConfigError(f"plugins.disabled: {unknown[0]!r} is no plugin here; known: {', '.join(known)}")
    autoload = bool(getattr(plugins_cfg, "autoload", True))
    return Registry(disabled=disabled, autoload=autoload).load()

