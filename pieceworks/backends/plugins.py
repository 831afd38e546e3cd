"""Plugin discovery with isolation: built-in families, entry points of group `pieceworks`, in-process plugins.

A plugin that can't be used is left out and recorded as a `BrokenPlugin` with its distribution, its
entry-point name and the reason: its import fails, its `pieceworks_register_backends` raises or returns
something that is not a backend class (an instance, a class without `name`, an unknown op, a method
whose parameters can't take the base method's arguments: `Backend.signature_problems`), it registers
an (op, name) key another plugin already has (a built-in key: it alone is left out; another plugin's: both
are, since which one served would depend on the order they are found in), a `pieceworks_*` function of it
matches no hook (a misspelt hook would otherwise never be called), two distributions install the same
entry-point name, or its entry point is in a group that looks like a misspelling of `pieceworks`. Only
executors that select one of its backends notice it (their selection names the broken plugin); every
other executor runs, and `pieceworks backends` lists it with the reason.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pluggy

from pieceworks.backends import hookspecs
from pieceworks.backends.base import OPS, Backend

log = logging.getLogger("pieceworks.registry")

HOOK_NAMES = tuple(sorted(n for n in dir(hookspecs) if n.startswith("pieceworks_")))
BUILTIN_ORIGIN = "built into pieceworks"
IN_PROCESS_ORIGIN = "registered in-process"


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin left out of the registry.

    Attributes:
        name: its plugin name (the entry-point name; what `plugins.disabled` takes).
        origin: where it comes from: distribution and version, entry point.
        reason: what is wrong with it.
    """

    name: str
    origin: str
    reason: str

    def __str__(self) -> str:
        return (f"plugin {self.name!r} ({self.origin}) is broken and left out: {self.reason}. Fix or "
                f"uninstall it, or block it with plugins.disabled=[{self.name}]")


def entry_point_origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f"distribution {dist.name} {dist.version}" if dist is not None else "unknown distribution"
    return f"{where}, entry point {ep.name} = {ep.value}"


class PluginSet:
    """The plugins of one registry, each admitted only once its backends have been validated.

    Attributes:
        provided: plugin name -> the backend classes it registered, in load order.
        origins: plugin name -> where it comes from.
        owner: backend key (`op.name`) -> the plugin that registered it.
        broken: the plugins left out, in the order they were found.
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.provided: dict[str, list[type[Backend]]] = {}
        self.origins: dict[str, str] = {}
        self.owner: dict[str, str] = {}
        self.contested: set[str] = set()  # keys two plugins registered: nobody may serve them
        self.broken: list[BrokenPlugin] = []

    def known(self, name: str) -> bool:
        return name in self.provided or any(b.name == name for b in self.broken)

    def mark_broken(self, name: str, origin: str, reason: str) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self.provided.pop(name, None)
        for key in [k for k, owner in self.owner.items() if owner == name]:
            del self.owner[key]
        broken = BrokenPlugin(name, origin, reason)
        self.broken.append(broken)
        log.warning("%s", broken)

    def add(self, name: str, plugin: Any, origin: str) -> None:
        """Register `plugin` under `name` unless it is blocked, already known, or broken."""
        if self.pm.is_blocked(name) or self.known(name):
            return
        problem = hook_name_problem(self.pm, plugin)
        if problem:
            return self.mark_broken(name, origin, problem)
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy's validation: a hook with arguments its spec does not have
            return self.mark_broken(name, origin, f"{type(exc).__name__}: {exc}")
        try:
            classes = self._call_register(name)
        except Exception as exc:
            return self.mark_broken(name, origin, f"pieceworks_register_backends raised {type(exc).__name__}: {exc}")
        problem = self._class_problem(classes, name)
        if problem:
            if self._leave_out_rivals(classes, name):
                problem += "; neither serves it, since which one would depends on the order plugins are found in"
            return self.mark_broken(name, origin, problem)
        self.provided[name] = classes
        self.origins[name] = origin
        for cls in classes:
            self.owner[cls.key()] = name

    def add_entry_points(self) -> None:
        """Every entry point of group `pieceworks`; one name installed by several distributions is
        reported and none of them is loaded (which one wins would depend on sys.path order)."""
        by_name: dict[str, list[importlib.metadata.EntryPoint]] = defaultdict(list)
        every = importlib.metadata.entry_points()
        for ep in every.select(group=hookspecs.PROJECT):
            seen = by_name[ep.name]
            if not any(e.value == ep.value and entry_point_origin(e) == entry_point_origin(ep) for e in seen):
                seen.append(ep)
        for name, eps in by_name.items():
            if self.pm.is_blocked(name) or self.known(name):
                continue
            if len(eps) > 1:
                origins = "; ".join(entry_point_origin(ep) for ep in eps)
                self.mark_broken(name, origins, f"{len(eps)} distributions install the entry-point name "
                                 f"{name!r}, so none of them is loaded; uninstall all but one")
                continue
            ep = eps[0]
            try:
                plugin = ep.load()
            except Exception as exc:
                self.mark_broken(name, entry_point_origin(ep), f"import failed: {type(exc).__name__}: {exc}")
                continue
            self.add(name, plugin, entry_point_origin(ep))
        self._misgrouped(every)

    def _misgrouped(self, every: importlib.metadata.EntryPoints) -> None:
        """Report the entry points of groups that look like a misspelling of `pieceworks` (`misspelt_group`):
        otherwise such a plugin is silently never loaded. One pass over the groups already read."""
        project = hookspecs.PROJECT
        for group in every.groups:
            if not misspelt_group(group):
                continue
            for ep in every.select(group=group):
                if not self.pm.is_blocked(ep.name) and not self.known(ep.name):
                    self.mark_broken(ep.name, entry_point_origin(ep), f"its entry point is in group {group!r}, "
                                     f"which is never loaded: declare it in group {project!r} "
                                     f"([project.entry-points.{project}] in pyproject.toml; docs/plugins.md)")

    def _leave_out_rivals(self, classes: list, name: str) -> list[str]:
        """Leave out the plugins that already registered a key that `name` registers too, unless they are
        built in: which of two plugins would serve a key depends on the order they are found in, so
        neither does (a selection naming the key fails and names both). Returns the plugins left out."""
        rivals = []
        for cls in classes:
            valid = (isinstance(cls, type) and issubclass(cls, Backend) and isinstance(getattr(cls, "name", None), str)
                     and getattr(cls, "op", None) in OPS)
            key = cls.key() if valid else None
            rival = self.owner.get(key)
            if rival is not None and rival != name and self.origins.get(rival) != BUILTIN_ORIGIN:
                self.contested.add(key)
                self.mark_broken(rival, self.origins[rival], f"it registers {key}, which plugin {name!r} registers "
                                 "too; which one would serve depends on the order plugins are found in, so neither "
                                 "does: uninstall one")
                self.origins.pop(rival, None)
                rivals.append(rival)
        return rivals

    def _call_register(self, name: str) -> list:
        """This plugin's own `pieceworks_register_backends` results (one plugin at a time, so a raising
        plugin takes no other down)."""
        out: list = []
        for impl in self.pm.hook.pieceworks_register_backends.get_hookimpls():
            if impl.plugin_name == name:
                got = impl.function()
                if got is not None and not isinstance(got, (list, tuple)):
                    return [_NotAList(got)]  # `_class_problem` says so (not "raised TypeError")
                out.extend(got or [])
        return out

    def _class_problem(self, classes: list, name: str) -> str | None:
        mine: dict[str, type] = {}
        for cls in classes:
            if isinstance(cls, _NotAList):
                got = cls.value
                shown = got.__qualname__ if isinstance(got, type) else repr(got)
                return (f"pieceworks_register_backends returned {shown}, not a list of backend classes: "
                        f"return a list (e.g. [{shown if isinstance(got, type) else 'MyBackend'}])")
            if not isinstance(cls, type):
                return (f"pieceworks_register_backends returned {cls!r}, an instance of {type(cls).__name__}, "
                        "not a backend class: return the class itself")
            what = f"{cls.__module__}.{cls.__qualname__}"
            if not issubclass(cls, Backend):
                return (f"{what} is not a pieceworks backend: subclass the op's base class (e.g. "
                        "pieceworks.backends.attention.base.AttentionBackend)")
            if not isinstance(getattr(cls, "name", None), str) or not cls.name:
                return f"{what} has no `name` (set a short registry key as a class attribute: name = \"mine\")"
            if getattr(cls, "op", None) not in OPS:
                return f"{what} declares op {getattr(cls, 'op', None)!r}; ops are {', '.join(OPS)}"
            missing = cls.unimplemented()
            if missing:
                return (f"{what} does not define {', '.join(missing)}: {cls.op} backends implement it with the "
                        f"signature of the op's base class (docs/plugins.md, the contract per op)")
            bad = cls.signature_problems()
            if bad:
                return (f"backend {cls.key()} ({what}): {'; '.join(bad)}. Match the op's base class (extra "
                        "parameters need defaults; docs/plugins.md, the contract per op)")
            key = cls.key()
            if key in self.contested:
                return f"{what} is registered as {key}, which other plugins registered too (all left out)"
            other = mine.get(key)
            if other is not None and other is not cls:
                return f"it registers two classes as {key}: {other.__qualname__} and {cls.__qualname__}"
            if key in self.owner:
                return f"{what} is registered as {key}, which plugin {self.owner[key]!r} already registers"
            mine[key] = cls
        return None


@dataclass(frozen=True)
class _NotAList:
    """What a `pieceworks_register_backends` returned in place of a list."""

    value: Any


def misspelt_group(group: str) -> bool:
    """Whether entry-point `group` is not `pieceworks` but looks like a misspelling of it: it starts with
    "pieceworks" (`pieceworks.backends`, `pieceworks_plugins`, `Pieceworks`) or is close to it (`peiceworks`)."""
    project = hookspecs.PROJECT
    low = group.lower()
    return group != project and (low.startswith(project) or bool(difflib.get_close_matches(low, [project], 1, 0.8)))


def hook_name_problem(pm: pluggy.PluginManager, plugin: Any) -> str | None:
    """Why `plugin`'s `pieceworks_*` functions would not be called as it expects, if they would not."""
    for attr in dir(plugin):
        if not attr.startswith("pieceworks_") or not callable(getattr(plugin, attr, None)):
            continue
        if attr not in HOOK_NAMES:
            close = difflib.get_close_matches(attr, HOOK_NAMES, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            return f"it defines {attr}, which is no pieceworks hook ({hint}hooks: {', '.join(HOOK_NAMES)})"
        if pm.parse_hookimpl_opts(plugin, attr) is None:
            return f"its {attr} is not marked with @pieceworks.hookimpl, so it would never be called"
    return None
