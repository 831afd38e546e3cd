"""pytest plugin for pieceworks and for backend authors, registered by the `pytest11` entry point
`pieceworks.testing.plugin` (so installing pieceworks is enough; `-p pieceworks.testing.plugin` names
the same plugin where the entry point is not installed).

- `@pytest.mark.gpu` tests skip, with the reason, where no CUDA device is present.
- The conformance suite (`pytest --pyargs pieceworks.testing.suite`) is parametrized here:
  `--pieceworks-backend OP.NAME` (repeatable) picks the backends under test (default: every registered
  backend, and the ones from plugins are under test); `--pieceworks-device cpu|cuda` (repeatable) the
  devices (default: both, the CUDA cases skipping where there is no GPU); `--pieceworks-disable PLUGIN`
  (repeatable) leaves a plugin out, as `plugins.disabled` does.
- A suite case running past `--pieceworks-timeout` seconds (default 300; 0: none) stops the run with every
  thread's stack and the case's name: a kernel that hangs would otherwise stall it for good.
- A skip is not a pass: a backend under test none of whose cases passed or failed (each skipped, or none
  collected) makes the run fail, unless `--pieceworks-allow-skip`; the summary names every backend that
  was not (fully) tested and why.
- A broken plugin (its import fails, its hook has the wrong signature, ...: `pieceworks.backends.plugins`)
  fails a run without `--pieceworks-backend`, where every plugin is under test; the summary names it and
  why. With `--pieceworks-backend`, one that names a broken plugin's backend is a usage error naming the
  broken plugins.
"""

from __future__ import annotations

import faulthandler
import os
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
import torch

SUITE_OP = "_pieceworks_ops"  # the ops of a suite test function (`pieceworks.testing.suite.for_op`)
SUITE_DTYPES = "_pieceworks_dtypes"  # its dtype names per device, where it takes a `dtype` (ditto)
DEVICES = ("cpu", "cuda")


@dataclass
class Tally:
    """Outcomes of one backend's suite cases."""

    passed: int = 0
    failed: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    collected: int = 0

    @property
    def tested(self) -> bool:
        return bool(self.passed or self.failed)


class SuiteState:
    """The backends a run selects and what happened to their cases."""

    def __init__(self, config: pytest.Config) -> None:
        from pieceworks.backends.plugins import BUILTIN_ORIGIN
        from pieceworks.backends.registry import Registry

        self.config = config
        self.registry = Registry(disabled=config.getoption("--pieceworks-disable") or []).load()
        self.allow_skip = config.getoption("--pieceworks-allow-skip")
        chosen = config.getoption("--pieceworks-backend") or []
        known = {cls.key(): cls for cls in self.registry.backends()}
        unknown = [k for k in chosen if k not in known]
        if unknown:
            broken = "".join(f"\n  {b}" for b in self.registry.broken)
            raise pytest.UsageError(
                f"--pieceworks-backend: no backend {', '.join(unknown)} is registered (OP.NAME, e.g. "
                f"attention.torch); registered: {', '.join(sorted(known))}"
                + (f"\nbroken plugins:{broken}" if broken else ""))
        self.explicit = bool(chosen)
        if chosen:
            self.selected = [known[k] for k in dict.fromkeys(chosen)]
            self.under_test = set(dict.fromkeys(chosen))
        else:
            self.selected = list(known.values())
            self.under_test = {k for k in known if self.registry.plugins.origins.get(
                self.registry.plugins.owner.get(k)) != BUILTIN_ORIGIN}
        self.devices = list(dict.fromkeys(config.getoption("--pieceworks-device") or DEVICES))
        self.tallies: dict[str, Tally] = defaultdict(Tally)
        self.node_backend: dict[str, str] = {}
        self.suite_collected = False

    def backends(self, ops: tuple[str, ...]) -> list[type]:
        return [cls for cls in self.selected if cls.op in ops]


_STATE = pytest.StashKey[SuiteState]()
_STDERR = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pieceworks", "pieceworks backend conformance suite")
    group.addoption("--pieceworks-backend", action="append", default=None, metavar="OP.NAME",
                    help="run the suite for this backend only (repeatable), e.g. attention.mine")
    group.addoption("--pieceworks-device", action="append", default=None, choices=DEVICES,
                    help="device(s) for the suite (repeatable; default: cpu and cuda, cuda cases skip "
                         "without a GPU)")
    group.addoption("--pieceworks-disable", action="append", default=None, metavar="PLUGIN",
                    help="leave this plugin out (repeatable; as plugins.disabled does for the executor), e.g. "
                         "one that registers your backend's name too")
    group.addoption("--pieceworks-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="stop the run, naming the case and showing every thread's stack, when one suite case "
                         "runs longer (a kernel that hangs); 0: no limit (default 300)")
    group.addoption("--pieceworks-allow-skip", action="store_true", default=False,
                    help="let a backend under test whose every case skipped pass the run (a skip is "
                         "otherwise not a pass)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped with a reason when none is present)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on a CPU")
    config.pluginmanager.register(Recorder(config), "pieceworks-suite-recorder")
    # the terminal's stderr, taken before a test's output is captured: where a timed-out case is reported
    config.stash[_STDERR] = os.dup(2)
    limit = config.getoption("--pieceworks-timeout", 0.0)
    if not 0 <= limit <= 1e6:  # nan and inf too (threading.Timer takes neither)
        raise pytest.UsageError(f"--pieceworks-timeout {limit:g}: give seconds from 0 (no limit) to 1e6")
    if config.getoption("--pieceworks-backend", None):
        _state(config)  # an unknown OP.NAME is a usage error before anything is collected


def _state(config: pytest.Config) -> SuiteState:
    if _STATE not in config.stash:
        config.stash[_STATE] = SuiteState(config)
    return config.stash[_STATE]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    ops = getattr(metafunc.function, SUITE_OP, None)
    if ops is None:
        return
    state = _state(metafunc.config)
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", [pytest.param(c, id=c.key()) for c in state.backends(ops)])
    dtypes = getattr(metafunc.function, SUITE_DTYPES, None)
    if dtypes is not None:
        metafunc.parametrize(("device", "dtype"), [
            pytest.param(d, t, id=f"{d}-{t}", marks=[pytest.mark.gpu] if d == "cuda" else [])
            for d in state.devices for t in dtypes[d]])
    elif "device" in metafunc.fixturenames:
        metafunc.parametrize("device", [pytest.param(d, id=d, marks=[pytest.mark.gpu] if d == "cuda" else [])
                                        for d in state.devices])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, dropped = [], []
    state = None
    for item in items:
        fn = getattr(item, "function", None)
        if getattr(fn, SUITE_OP, None) is not None:
            state = state or _state(config)
            state.suite_collected = True
            backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
            if not isinstance(backend, type):  # no selected backend of this op: nothing to run
                dropped.append(item)
                continue
            state.node_backend[item.nodeid] = backend.key()
            state.tallies[backend.key()].collected += 1
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; none is present (run it on the GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STDERR in config.stash:
        os.close(config.stash[_STDERR])


class Watchdog:
    """Ends the process when a case outlives `limit` seconds: a thread names the case and dumps every
    thread's stack; should the case hold the GIL (a C call that never returns), faulthandler's own thread
    does the same 30 s later without the name."""

    def __init__(self, nodeid: str, limit: float, fd: int) -> None:
        self.nodeid, self.limit, self.fd = nodeid, limit, fd
        self.timer = threading.Timer(limit, self.fire)
        self.timer.daemon = True
        self.timer.start()
        faulthandler.dump_traceback_later(limit + 30, exit=True, file=fd)

    def fire(self) -> None:
        os.write(self.fd, f"\npieceworks conformance suite: {self.nodeid} ran past {self.limit:g} s "
                          "(--pieceworks-timeout): a kernel that hangs, or an endless loop; the run stops here. "
                          "Every thread's stack:\n".encode())
        faulthandler.dump_traceback(file=self.fd, all_threads=True)
        os._exit(1)

    def cancel(self) -> None:
        self.timer.cancel()
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    state = item.config.stash.get(_STATE, None)
    limit = item.config.getoption("--pieceworks-timeout")
    if state is None or item.nodeid not in state.node_backend or limit == 0:
        yield
        return
    watchdog = Watchdog(item.nodeid, limit, item.config.stash[_STDERR])
    try:
        yield
    finally:
        watchdog.cancel()


class Recorder:
    """Counts each suite case's outcome against its backend (a plugin object: a report carries no config)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        state = self.config.stash.get(_STATE, None)
        key = state.node_backend.get(report.nodeid) if state is not None else None
        if key is None:
            return
        tally = state.tallies[key]
        if report.failed:
            tally.failed += 1
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            tally.skipped[reason.removeprefix("Skipped: ")] += 1
        elif report.when == "call" and report.passed:
            tally.passed += 1


def untested(state: SuiteState) -> dict[str, Tally]:
    """Backends under test that no case tested (every case skipped, or none collected)."""
    if not (state.suite_collected or state.explicit):
        return {}
    return {k: state.tallies[k] for k in sorted(state.under_test) if not state.tallies[k].tested}


def broken_under_test(state: SuiteState) -> list:
    """Broken plugins of a run that tests every plugin (no --pieceworks-backend): their backends are under
    test, and none of them could be registered."""
    return [] if state.explicit or not state.suite_collected else list(state.registry.broken)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE, None)
    if state is None:
        return
    if (untested(state) and not state.allow_skip) or broken_under_test(state):
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _reasons(tally: Tally, most: int = 4) -> str:
    shown = [f"{reason} ({n}x)" if n > 1 else reason for reason, n in tally.skipped.most_common(most)]
    more = len(tally.skipped) - most
    return "; ".join(shown) + (f"; and {more} more reasons" if more > 0 else "")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not (state.suite_collected or state.explicit):
        return
    tr = terminalreporter
    tr.section("pieceworks conformance suite")
    for key, tally in sorted(state.tallies.items()):
        if key not in state.under_test and not tally.tested:
            continue
        mark = "under test" if key in state.under_test else "built-in"
        line = f"{key} ({mark}): {tally.passed} passed, {tally.failed} failed, {sum(tally.skipped.values())} skipped"
        tr.write_line(line + (f" -- skipped: {_reasons(tally)}" if tally.skipped else ""))
    missing = untested(state)
    for key, tally in missing.items():
        why = _reasons(tally) if tally.skipped else "no case of it was collected"
        tr.write_line(f"NOT TESTED: {key}: every case skipped: {why}" if tally.skipped
                      else f"NOT TESTED: {key}: {why}", red=True, bold=True)
    for broken in state.registry.broken:
        tr.write_line(f"BROKEN PLUGIN: {broken}", red=True)
    if broken_under_test(state):
        tr.write_line("the run fails: an installed plugin is broken, so its backends, under test, were not "
                      "registered (fix or uninstall it; --pieceworks-backend OP.NAME tests named backends only)",
                      red=True, bold=True)
    if missing:
        if state.allow_skip:
            tr.write_line("--pieceworks-allow-skip: the backends above count as passing although untested",
                          yellow=True)
        else:
            tr.write_line("the run fails: a skip is not a pass (run where the backend can serve, or pass "
                          "--pieceworks-allow-skip to accept an untested backend)", red=True, bold=True)
