"""A broken plugin is reported with its distribution, entry-point name and the `plugins.disabled` hint, and
stops only executors that select it: import errors, raising hooks, bad classes, raising checks, misspelt
hooks, duplicate keys and entry-point names installed by two distributions."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from pieceworks.backends.base import BackendSpec
from pieceworks.backends.registry import Registry, SelectionError
from pieceworks.config import load_config
from pieceworks.core.batch import ForwardMode, GraphMode

GOOD = '''
from pieceworks import hookimpl
from pieceworks.backends.attention.torch import TorchAttentionBackend

class GoodAttention(TorchAttentionBackend):
    name = "good"
    priority = 5

@hookimpl
def pieceworks_register_backends():
    return [GoodAttention]
'''

BROKEN = {
    "import": "raise ImportError('missing kernel library')\n",
    "long_error": "raise ImportError('libkern.so: undefined symbol\\n' + 'x' * 2000 + '\\nrebuild against torch')\n",
    "raising_hook": '''
from pieceworks import hookimpl

@hookimpl
def pieceworks_register_backends():
    raise RuntimeError("kernels not built")
''',
    "no_name": '''
from pieceworks import hookimpl
from pieceworks.backends.attention.base import AttentionBackend

class Nameless(AttentionBackend):
    priority = 1

@hookimpl
def pieceworks_register_backends():
    return [Nameless]
''',
    "instance": '''
from pieceworks import hookimpl
from pieceworks.backends.attention.torch import TorchAttentionBackend
from pieceworks.backends.base import BackendSpec

class Inst(TorchAttentionBackend):
    name = "inst"

@hookimpl
def pieceworks_register_backends():
    return [Inst(BackendSpec())]
''',
    "misspelt": '''
from pieceworks import hookimpl
from pieceworks.backends.attention.torch import TorchAttentionBackend

class Typo(TorchAttentionBackend):
    name = "typo"

@hookimpl
def pieceworks_register_backend():
    return [Typo]
''',
    "unmarked": '''
from pieceworks.backends.attention.torch import TorchAttentionBackend

class Unmarked(TorchAttentionBackend):
    name = "unmarked"

def pieceworks_register_backends():
    return [Unmarked]
''',
    "bare_class": '''
from pieceworks import hookimpl
from pieceworks.backends.attention.torch import TorchAttentionBackend

class Bare(TorchAttentionBackend):
    name = "bare"

@hookimpl
def pieceworks_register_backends():
    return Bare
''',
    "no_forward": '''
from pieceworks import hookimpl
from pieceworks.backends.attention.base import AttentionBackend

class NoForward(AttentionBackend):
    name = "noforward"

@hookimpl
def pieceworks_register_backends():
    return [NoForward]
''',
    "bad_signature": '''
from pieceworks import hookimpl
from pieceworks.backends.attention.torch import TorchAttentionBackend

class OldForward(TorchAttentionBackend):
    name = "oldforward"

    def forward(self, q, k, v, out, layer_id):
        pass

@hookimpl
def pieceworks_register_backends():
    return [OldForward]
''',
    "dup_key": '''
from pieceworks import hookimpl
from pieceworks.backends.attention.torch import TorchAttentionBackend

class Again(TorchAttentionBackend):
    name = "torch"

@hookimpl
def pieceworks_register_backends():
    return [Again]
''',
}

EXPECTED = {
    "import": "import failed: ImportError: missing kernel library",
    "raising_hook": "pieceworks_register_backends raised RuntimeError: kernels not built",
    "no_name": "has no `name`",
    "instance": "an instance of Inst, not a backend class",
    "misspelt": "defines pieceworks_register_backend, which is no pieceworks hook",
    "unmarked": "is not marked with @pieceworks.hookimpl",
    "dup_key": "registered as attention.torch, which plugin 'pieceworks.torch' already registers",
    "no_forward": "pwb_no_forward.NoForward does not define forward: attention backends implement it",
    "bare_class": "pieceworks_register_backends returned Bare, not a list of backend classes: return a list (e.g. [Bare])",
    "bad_signature": "backend attention.oldforward (pwb_bad_signature.OldForward): forward(self, q, k, v, out, "
                     "layer_id) can't take the arguments of AttentionBackend.forward(self, q, k, v, out, layer_id, "
                     "scale, kv) (too many positional arguments). Match the op's base class (extra parameters need "
                     "defaults",
}


def install(tmp_path, monkeypatch, dist: str, modules: dict[str, str], eps: dict[str, str],
            group: str = "pieceworks") -> None:
    """A distribution `dist` on sys.path with `modules` and entry points `eps` of `group`."""
    root = tmp_path / dist
    root.mkdir()
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    monkeypatch.syspath_prepend(str(root))
    for mod in modules:
        monkeypatch.delitem(sys.modules, mod, raising=False)


def resolve(reg, overrides=()):
    cfg = load_config({"model": {"arch": "llama"}}, list(overrides))
    return reg.resolve(cfg.backends, BackendSpec(), ("attention",))


@pytest.fixture
def installed(tmp_path, monkeypatch):
    mods = {f"pwb_{k}": v for k, v in BROKEN.items()} | {"pwb_good": GOOD}
    install(tmp_path, monkeypatch, "pw-broken-kernels", mods, {k: f"pwb_{k}" for k in [*BROKEN, "good"]})
    yield
    for mod in mods:
        sys.modules.pop(mod, None)


def test_each_broken_plugin_is_reported_and_the_rest_still_runs(installed):
    reg = Registry().load()
    broken = {b.name: b for b in reg.broken}
    assert set(broken) == set(BROKEN)
    for name, want in EXPECTED.items():
        b = broken[name]
        assert want in b.reason, (name, b.reason)
        assert b.origin == f"distribution pw-broken-kernels 0.1, entry point {name} = pwb_{name}"
        assert f"block it with plugins.disabled=[{name}]" in str(b)
    assert "good" in reg.plugin_names() and not set(BROKEN) & set(reg.plugin_names())
    table = resolve(reg)  # an executor that selects none of them is built as usual
    assert table.get("attention", ForwardMode.EXTEND, GraphMode.EAGER).name == "good"
    assert resolve(reg, ["backends.attention=torch"]).get("attention", ForwardMode.DECODE, GraphMode.EAGER).name == "torch"


def test_selecting_a_broken_plugins_backend_names_the_plugin(installed):
    """The selection error lists every broken plugin (it may have registered the name), one short line each."""
    with pytest.raises(SelectionError, match=r"(?s)no attention backend named 'typo'.*plugins left out as broken "
                       r"\(`pieceworks backends` says why in full.*\n  - plugin 'misspelt' \(distribution "
                       r"pw-broken-kernels 0.1\): it defines pieceworks_register_backend, which is no pieceworks hook") as e:
        resolve(Registry().load(), ["backends.attention=typo"])
    lines = str(e.value).splitlines()
    assert len(lines) == 1 + len(BROKEN) and max(map(len, lines[1:])) <= 170
    (long,) = [line for line in lines if "'long_error'" in line]  # 2 KB over three lines in full
    assert long.endswith("import failed: ImportError: libkern.so: undefined symbol " + "x" * 40 + "...")


def test_left_out_names_every_distribution_of_a_broken_plugin():
    from pieceworks.backends.plugins import BrokenPlugin
    from pieceworks.backends.registry import left_out

    two = BrokenPlugin("kernels", "distribution pw-one 0.1, entry point kernels = pw_one; distribution pw-two 0.2, "
                       "entry point kernels = pw_two", "2 distributions install the entry-point name 'kernels'")
    assert left_out([two]).endswith("\n  - plugin 'kernels' (distribution pw-one 0.1; distribution pw-two 0.2): "
                                    "2 distributions install the entry-point name 'kernels'")


def test_blocked_broken_plugin_is_neither_loaded_nor_reported(installed):
    reg = Registry(disabled=list(BROKEN)).load()
    assert reg.broken == [] and "good" in reg.plugin_names()


def test_raising_check_is_a_reason_naming_the_plugin(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "pw-checky", {"pw_checky": '''
        from pieceworks import hookimpl
        from pieceworks.backends.attention.torch import TorchAttentionBackend

        class Checky(TorchAttentionBackend):
            name = "checky"
            priority = 50

            @classmethod
            def check(cls, spec):
                raise KeyError("head_dim")

        @hookimpl
        def pieceworks_register_backends():
            return [Checky]
    '''}, {"checky": "pw_checky"})
    reg = Registry().load()
    table = resolve(reg)
    assert table.get("attention", ForwardMode.EXTEND, GraphMode.EAGER).name != "checky"
    rejected = dict(next(d for d in table.decisions if d.graph_mode is GraphMode.EAGER).rejected)
    (reason,) = rejected["checky"]
    assert reason.startswith("check() raised KeyError: 'head_dim' (a bug in plugin 'checky' (distribution pw-checky 0.1")
    assert "plugins.disabled=[checky]" in reason
    with pytest.raises(SelectionError, match=r"backends.attention=checky can't serve.*check\(\) raised KeyError"):
        resolve(reg, ["backends.attention=checky"])


def test_a_check_returning_no_list_is_one_reason(tmp_path, monkeypatch):
    """A bare string (one reason not in a list) or None (a forgotten return) from check() is one reason naming the
    mistake, not a reason per character or a TypeError."""
    install(tmp_path, monkeypatch, "pw-checkstr", {"pw_checkstr": '''
        from pieceworks import hookimpl
        from pieceworks.backends.attention.torch import TorchAttentionBackend

        class CheckStr(TorchAttentionBackend):
            name = "checkstr"
            priority = 50

            @classmethod
            def check(cls, spec):
                return "needs an H100"

        class CheckNone(CheckStr):
            name = "checknone"

            @classmethod
            def check(cls, spec):
                super().check(spec)

        @hookimpl
        def pieceworks_register_backends():
            return [CheckStr, CheckNone]
    '''}, {"checkstr": "pw_checkstr"})
    table = resolve(Registry().load())
    rejected = dict(next(d for d in table.decisions if d.graph_mode is GraphMode.EAGER).rejected)
    for name, got in (("checkstr", "'needs an H100'"), ("checknone", "None")):
        (reason,) = rejected[name]
        assert reason.startswith(f"attention.{name}.check() returned {got}; return a list of reason strings"), reason
        assert "(a bug in plugin 'checkstr'" in reason


def test_one_entry_point_name_from_two_distributions_is_reported(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "pw-one", {"pw_one": GOOD}, {"kernels": "pw_one"})
    install(tmp_path, monkeypatch, "pw-two", {"pw_two": GOOD.replace('"good"', '"other"')}, {"kernels": "pw_two"})
    reg = Registry().load()
    (broken,) = reg.broken
    assert broken.name == "kernels" and "2 distributions install the entry-point name 'kernels'" in broken.reason
    assert "distribution pw-one 0.1" in broken.origin and "distribution pw-two 0.1" in broken.origin
    assert "kernels" not in reg.plugin_names()
    assert not {"good", "other"} & {c.name for c in reg.backends("attention")}


def test_a_key_two_plugins_register_is_served_by_neither(tmp_path, monkeypatch):
    """Which of two plugins registering one key serves it would depend on the order they are found in:
    neither does, a third registering it later is left out too, and a selection naming the key names them."""
    fast = GOOD.replace('"good"', '"fast"')
    install(tmp_path, monkeypatch, "pw-vendor-a", {"pw_vendor_a": fast}, {"vendor_a": "pw_vendor_a"})
    install(tmp_path, monkeypatch, "pw-vendor-b", {"pw_vendor_b": fast}, {"vendor_b": "pw_vendor_b"})
    install(tmp_path, monkeypatch, "pw-vendor-c", {"pw_vendor_c": fast}, {"vendor_c": "pw_vendor_c"})
    reg = Registry().load()
    assert sorted(b.name for b in reg.broken) == ["vendor_a", "vendor_b", "vendor_c"]
    assert "fast" not in {c.name for c in reg.backends("attention")}
    reasons = [b.reason for b in reg.broken]  # in the order found: that order is what must not matter
    assert "which one would serve depends on the order plugins are found in, so neither does" in reasons[0]
    assert "neither serves it, since which one would depends on the order plugins are found in" in reasons[1]
    assert "which other plugins registered too (all left out)" in reasons[-1]
    with pytest.raises(SelectionError, match="no attention backend named 'fast'") as err:
        resolve(reg, ["backends.attention=fast"])
    assert all(f"plugin {n!r}" in str(err.value) for n in ("vendor_a", "vendor_b", "vendor_c"))
    blocked = Registry(disabled=["vendor_b", "vendor_c"]).load()  # the documented way out: block all but one
    assert "fast" in {c.name for c in blocked.backends("attention")} and not blocked.broken
    with pytest.raises(SelectionError, match=r"no attention backend named 'fsat' \(did you mean 'fast'\?\).*"
                                             r"plugins.disabled blocks vendor_b, vendor_c"):
        resolve(blocked, ["backends.attention=fsat"])


def test_raising_adjust_hook_is_reported_and_selection_goes_on():
    from pieceworks import hookimpl

    class Bad:
        @hookimpl
        def pieceworks_adjust_candidates(self, op, forward_mode, graph_mode, spec, candidates):
            raise ValueError("oops")

    reg = Registry(autoload=False)
    reg.register_plugin(Bad(), "bad")
    table = resolve(reg.load())
    assert table.get("attention", ForwardMode.EXTEND, GraphMode.EAGER).name == "torch"
    (broken,) = reg.broken
    assert broken.name == "bad" and broken.reason == "pieceworks_adjust_candidates raised ValueError: oops"
    assert broken.origin == "registered in-process"


def test_pieceworks_backends_lists_broken_plugins(installed, capsys):
    from pieceworks.report import print_backends

    cfg = load_config({"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu"}})
    assert print_backends(cfg) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "broken plugin import (distribution pw-broken-kernels 0.1, entry point import = pwb_import): import " \
           "failed: ImportError: missing kernel library; block it with plugins.disabled=[import]" in out
    assert "broken plugin no_name" in out


@pytest.mark.parametrize("group", ["pieceworks.backends", "pieceworks_plugins", "Pieceworks", "peiceworks"])
def test_a_plugin_in_a_misspelt_entry_point_group_is_reported(tmp_path, monkeypatch, caplog, capsys, group):
    """An entry point under a group that is not `pieceworks` but looks like it is never loaded; it is reported as
    left out (a warning, `pieceworks backends`), with the group to use, and `plugins.disabled` blocks it."""
    from pieceworks.backends.registry import load_registry
    from pieceworks.report import print_backends

    install(tmp_path, monkeypatch, "pw-misgrouped", {"pwm_good": GOOD}, {"mine": "pwm_good"}, group=group)
    install(tmp_path, monkeypatch, "pw-elsewhere", {}, {"tool": "pw_elsewhere"}, group="pytest11")
    want = (f"its entry point is in group {group!r}, which is never loaded: declare it in group 'pieceworks' "
            "([project.entry-points.pieceworks] in pyproject.toml")
    try:
        with caplog.at_level(logging.WARNING, logger="pieceworks.registry"):
            reg = Registry().load()
        (b,) = [b for b in reg.broken if b.name == "mine"]
        assert want in b.reason and not [b for b in reg.broken if b.name == "tool"]
        assert b.origin == "distribution pw-misgrouped 0.1, entry point mine = pwm_good"
        assert "mine" not in reg.plugin_names()
        assert [r.getMessage() for r in caplog.records if want in r.getMessage()] == [str(b)]
        assert "plugin 'mine' (distribution pw-misgrouped 0.1, entry point mine = pwm_good)" in str(b)

        cfg = load_config({"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu"}})
        assert print_backends(cfg) == 0
        assert f"broken plugin mine (distribution pw-misgrouped 0.1, entry point mine = pwm_good): {want}" in \
            " ".join(capsys.readouterr().out.split())

        blocked = load_registry(load_config({"model": {"arch": "llama"}}, ["plugins.disabled=[mine]"]).plugins)
        assert not [b for b in blocked.broken if b.name == "mine"]
    finally:
        sys.modules.pop("pwm_good", None)
