"""Selection: auto, pinned, pinned-but-unavailable, per mode, piecewise fallback, plugins, vetoes."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from pieceworks.backends.attention.torch import TorchAttentionBackend
from pieceworks.backends.base import ALL_FORWARD_MODES, BackendSpec, ModelFacts, Requirements
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend
from pieceworks.backends.hookspecs import hookimpl
from pieceworks.backends.registry import Registry, SelectionError
from pieceworks.config import ConfigError, load_config
from pieceworks.core.batch import ForwardMode, GraphMode

E, D, M = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED
EAGER, FULL, PW = GraphMode.EAGER, GraphMode.FULL, GraphMode.PIECEWISE


class FastAttention(TorchAttentionBackend):
    name = "fast"
    priority = 10


class CudaOnlyAttention(TorchAttentionBackend):
    name = "cudaonly"
    priority = 30
    requires = Requirements(devices=("cuda",), capability_majors=(10,), modules=("no_such_module_xyz",))


class NotPiecewiseSafe(TorchAttentionBackend):
    """Like TRT-LLM MLA: fine eagerly and in full decode graphs, not inside piecewise graphs."""

    name = "nopw"
    priority = 20
    graph_modes = frozenset({EAGER, FULL})


class DecodeOnly(TorchAttentionBackend):
    name = "decodeonly"
    priority = 40
    forward_modes = frozenset({D})


class FullExtend(TorchAttentionBackend):
    """Like attention.triton_all: planned on the device, so safe in full graphs of extend steps; ranked low."""

    name = "fullext"
    priority = 5
    full_extend = True


class Plugin:
    def __init__(self, *backends):
        self.backends = list(backends)

    @hookimpl
    def pieceworks_register_backends(self):
        return self.backends


def registry(*backends, disabled=(), name="testplugin") -> Registry:
    reg = Registry(disabled=disabled, autoload=False)
    reg.register_plugin(Plugin(*backends), name)
    return reg.load()


def resolve(reg, overrides=(), spec=None, ops=("attention",)):
    cfg = load_config({"model": {"arch": "llama"}}, list(overrides))
    return reg.resolve(cfg.backends, spec or BackendSpec(), ops)


def test_auto_picks_highest_priority_that_can_serve():
    table = resolve(registry(FastAttention, CudaOnlyAttention))
    for mode, graph in [(E, EAGER), (E, PW), (M, EAGER), (D, EAGER), (D, FULL)]:
        assert table.get("attention", mode, graph).name == "fast"
    rejected = dict(next(d for d in table.decisions if d.graph_mode is EAGER).rejected)
    assert any("needs device cuda" in r for r in rejected["cudaonly"])
    assert any("no_such_module_xyz" in r for r in rejected["cudaonly"])


def test_pinned_backend_is_used():
    table = resolve(registry(FastAttention), ["backends.attention=torch"])
    assert {b.name for b in table.instances("attention")} == {"torch"}


def test_pinned_backend_that_cannot_serve_names_reasons_and_alternatives():
    with pytest.raises(SelectionError) as err:
        resolve(registry(FastAttention, CudaOnlyAttention), ["backends.attention=cudaonly"])
    msg = str(err.value)
    assert "backends.attention=cudaonly" in msg and "needs device cuda" in msg
    assert "Backends that could: fast, torch" in msg


def test_unknown_backend_name_lists_registered_ones():
    with pytest.raises(ConfigError, match="no attention backend named 'nope'; registered: triton, flashinfer, triton_all, fast, torch"):
        resolve(registry(FastAttention), ["backends.attention=nope"])


def test_capability_reasons_with_an_overridden_spec():
    spec = BackendSpec(device="cuda", capability=(9, 0), modules=frozenset({"no_such_module_xyz"}))
    assert CudaOnlyAttention.check(spec) == ["needs compute capability 10.x (this GPU: 9.0)"]
    assert CudaOnlyAttention.check(BackendSpec(device="cuda", capability=(10, 0), modules=frozenset({"no_such_module_xyz"}))) == []


def test_per_mode_choice():
    table = resolve(registry(FastAttention), ["backends.attention={extend: torch, decode: fast}"])
    assert table.get("attention", E, EAGER).name == "torch"
    assert table.get("attention", M, PW).name == "torch"  # mixed follows the extend choice
    assert table.get("attention", D, FULL).name == "fast"


def test_mode_support_is_respected():
    table = resolve(registry(DecodeOnly, FastAttention))
    assert table.get("attention", D, EAGER).name == "decodeonly"
    assert table.get("attention", E, EAGER).name == "fast"
    with pytest.raises(SelectionError, match="does not support extend steps"):
        resolve(registry(DecodeOnly), ["backends.attention=decodeonly"])


def test_piecewise_fallback_is_chosen_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="pieceworks.registry"):
        table = resolve(registry(NotPiecewiseSafe, FastAttention))
    assert table.get("attention", E, EAGER).name == "nopw"
    assert table.get("attention", D, FULL).name == "nopw"
    assert table.get("attention", E, PW).name == "fast"
    decision = next(d for d in table.decisions if d.forward_mode is E and d.graph_mode is PW)
    assert decision.fallback_from == "nopw" and "not safe in piecewise" in decision.note
    assert any("fast instead of nopw" in r.getMessage() and "not safe in piecewise" in r.getMessage()
               for r in caplog.records)


def test_pinned_backend_not_piecewise_safe_falls_back_only_under_piecewise():
    table = resolve(registry(NotPiecewiseSafe, FastAttention), ["backends.attention=nopw"])
    assert table.get("attention", E, EAGER).name == "nopw"
    assert table.get("attention", E, PW).name == "fast"
    assert table.get("attention", D, FULL).name == "nopw"


def test_no_graph_safe_backend_marks_graph_mode_unavailable():
    table = resolve(registry(NotPiecewiseSafe, disabled=("pieceworks.torch",)))
    assert table.get("attention", E, PW) is None
    assert not table.graph_mode_ok(E, PW) and table.graph_mode_ok(D, FULL)


def test_full_graphs_of_extend_steps_take_a_full_extend_backend(caplog):
    with caplog.at_level(logging.INFO, logger="pieceworks.registry"):
        table = resolve(registry(FullExtend, FastAttention))
    assert table.get("attention", E, EAGER).name == "fast" and table.get("attention", E, PW).name == "fast"
    assert table.get("attention", E, FULL).name == "fullext" and table.get("attention", M, FULL).name == "fullext"
    assert table.get("attention", D, FULL).name == "fast"  # decode graphs: full_extend does not matter
    decision = next(d for d in table.decisions if d.forward_mode is E and d.graph_mode is FULL)
    assert decision.fallback_from == "fast" and "full CUDA graphs of extend steps" in decision.note
    # pinned: the pinned backend where it is safe, the full_extend one in its place where not
    table = resolve(registry(FullExtend, FastAttention), ["backends.attention={extend: fast, decode: fast}"])
    assert table.get("attention", E, PW).name == "fast" and table.get("attention", M, FULL).name == "fullext"


def test_no_full_extend_backend_marks_full_extend_graphs_unavailable():
    table = resolve(registry(FastAttention))
    assert table.get("attention", E, FULL) is None and table.get("attention", D, FULL).name == "fast"
    assert not table.graph_mode_ok(E, FULL) and not table.graph_mode_ok(M, FULL) and table.graph_mode_ok(E, PW)
    assert "safe in full graphs for extend steps" in table.graph_unavailable[(E, FULL)]


def test_blocked_plugin_is_not_loaded():
    reg = registry(FastAttention, disabled=("testplugin",))
    assert "testplugin" not in reg.plugin_names()
    assert [c.name for c in reg.backends("attention")] == ["triton", "flashinfer", "triton_all", "torch"]  # the built-ins
    with pytest.raises(SelectionError, match="no attention backend can serve"):
        resolve(registry(disabled=("pieceworks.torch",)))


def test_loading_is_idempotent():
    reg = registry(FastAttention)
    before = reg.backends()
    reg.load()
    reg._load_entrypoints()
    reg.register_plugin(Plugin(FastAttention), "testplugin")
    assert reg.backends() == before


def test_duplicate_backend_key_leaves_the_later_plugin_out():
    class Dup(TorchAttentionBackend):
        name = "torch"

    reg = registry(Dup)
    assert reg.backends("attention")[-1] is TorchAttentionBackend
    (broken,) = reg.broken
    assert broken.name == "testplugin" and "attention.torch, which plugin 'pieceworks.torch' already" in broken.reason


def test_plugin_veto_hook():
    class Veto:
        @hookimpl
        def pieceworks_adjust_candidates(self, op, forward_mode, graph_mode, spec, candidates):
            for c in candidates:
                if c.backend.name == "fast" and forward_mode is D:
                    c.veto("decode belongs to torch here")

    reg = registry(FastAttention)
    reg.register_plugin(Veto(), "veto")
    table = resolve(reg)
    assert table.get("attention", E, EAGER).name == "fast"
    assert table.get("attention", D, EAGER).name == "torch"
    d = next(d for d in table.decisions if d.forward_mode is D and d.graph_mode is EAGER)
    assert "vetoed by a plugin: decode belongs to torch here" in dict(d.rejected)["fast"]


def test_backend_options_are_validated():
    table = resolve(Registry(autoload=False).load(), ["backends.options.torch.path=dense"], ops=("moe",))
    assert table.get("moe", E, EAGER).options.path == "dense"
    with pytest.raises(SelectionError, match=r"backends.options.torch: unknown option\(s\) \['bogus'\]"):
        resolve(Registry(autoload=False).load(), ["backends.options.torch.bogus=1"], ops=("moe",))
    with pytest.raises(ValueError, match="use auto, sparse or dense"):
        resolve(Registry(autoload=False).load(), ["backends.options.torch.path=fast"], ops=("moe",))


def test_options_of_backends_not_chosen_here_are_checked_too():
    # the Triton backends can't serve on a CPU machine; a typo in their options still fails there
    with pytest.raises(SelectionError, match=r"backends.options.triton: unknown option\(s\) \['gemm_tile'\]"):
        resolve(Registry().load(), ["backends.options.triton.gemm_tile=x.json"], ops=("fp4_gemm",))
    table = resolve(Registry().load(), ["backends.options.triton.gemm_tiles=x.json"], ops=("fp4_gemm",))
    assert {b.name for b in table.instances("fp4_gemm")} != {"triton"}  # not built here: the file is not read
    with pytest.raises(ConfigError, match="backends.options.notinstalled: no registered backend is named 'notinstalled'"):
        resolve(Registry().load(), ["backends.options.notinstalled.x=1"], ops=("fp4_gemm",))


def test_fp4_numerics_restricts_selection():
    class A4(TorchFp4GemmBackend):
        name = "a4only"
        priority = 5
        numerics = ("w4a4",)

    spec = lambda n: BackendSpec(model=ModelFacts(fp4=True), fp4_numerics=n)  # noqa: E731
    assert resolve(registry(A4), spec=spec("auto"), ops=("fp4_gemm",)).get("fp4_gemm", E, EAGER).name == "a4only"
    # w4a16: the best CPU w4a16 backend (the load-time dequant one, priority 1, above the reference)
    assert resolve(registry(A4), spec=spec("w4a16"), ops=("fp4_gemm",)).get("fp4_gemm", E, EAGER).name == "dequant"
    t = resolve(registry(A4), spec=spec("w4a4"), ops=("fp4_gemm",))
    assert t.get("fp4_gemm", D, EAGER).name == "a4only"
    with pytest.raises(SelectionError, match="quantization.fp4_numerics asks for w4a16"):
        resolve(registry(A4), ["backends.fp4_gemm=a4only"], spec=spec("w4a16"), ops=("fp4_gemm",))


def test_weight_layouts_must_agree_across_modes():
    class Swizzled(TorchFp4GemmBackend):
        name = "swz"
        weight_layout = "swizzled_128x4"

    with pytest.raises(SelectionError, match="different weight layouts"):
        resolve(registry(Swizzled), ["backends.fp4_gemm={extend: swz, decode: torch}"],
                spec=BackendSpec(model=ModelFacts(fp4=True)), ops=("fp4_gemm",))


def test_entry_point_plugin_from_an_installed_distribution(tmp_path, monkeypatch):
    """A plugin package installed on sys.path, discovered through importlib.metadata entry points."""
    (tmp_path / "pw_demo_plugin.py").write_text(textwrap.dedent('''
        from pieceworks import hookimpl
        from pieceworks.backends.attention.torch import TorchAttentionBackend

        class DemoAttention(TorchAttentionBackend):
            name = "demo"
            priority = 99

        @hookimpl
        def pieceworks_register_backends():
            return [DemoAttention]
    '''))
    dist = tmp_path / "pw_demo_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pw-demo-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pieceworks]\ndemo = pw_demo_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        reg = Registry().load()
        assert "demo" in reg.plugin_names()
        assert resolve(reg).get("attention", E, EAGER).name == "demo"
        blocked = Registry(disabled=["demo"]).load()
        assert "demo" not in blocked.plugin_names()
        assert resolve(blocked).get("attention", E, EAGER).name == "torch"
    finally:
        sys.modules.pop("pw_demo_plugin", None)


def test_all_forward_modes_constant():
    assert ALL_FORWARD_MODES == {E, D, M}


def test_graph_modes_default_to_eager_only():
    """A backend that declares nothing claims no CUDA-graph safety."""
    from pieceworks.backends.attention.base import AttentionBackend

    class Plain(AttentionBackend):
        name = "plain"

        def forward(self, q, k, v, out, layer_id, scale, kv):
            raise AssertionError("not called")

    assert Plain.graph_modes == {EAGER}
    table = resolve(registry(Plain), ["backends.attention=plain"])
    assert table.get("attention", E, EAGER).name == "plain"
    assert table.get("attention", E, PW).name == "torch"  # the graph-safe fallback, logged


def test_every_builtin_backend_registers_with_its_base_signatures():
    reg = Registry(autoload=False).load()
    assert not reg.broken and len(reg.backends()) > len(set(c.op for c in reg.backends()))
    assert {c.key(): c.signature_problems() for c in reg.backends()} == {c.key(): [] for c in reg.backends()}


def _attention(name, **methods):
    return type(f"Bad{name.capitalize()}", (TorchAttentionBackend,), {"name": name, **methods})


def _forward(self, q, k, v, out, layer_id, scale, kv):
    pass


@pytest.mark.parametrize("cls, method, got, want, why", [
    (_attention("short", forward=lambda self, q, k, v, out, layer_id: None), "forward",
     "(self, q, k, v, out, layer_id)", "AttentionBackend.forward(self, q, k, v, out, layer_id, scale, kv)",
     "too many positional arguments"),
    (_attention("newarg", forward=lambda self, q, k, v, out, layer_id, scale, kv, window: None), "forward",
     "(self, q, k, v, out, layer_id, scale, kv, window)", "AttentionBackend.forward(self, q, k, v, out, "
     "layer_id, scale, kv)", "missing a required argument: 'window'"),
    (_attention("kwonly", forward=lambda self, q, k, v, out, layer_id, scale, kv, *, window: None), "forward",
     "(self, q, k, v, out, layer_id, scale, kv, *, window)", "AttentionBackend.forward",
     "missing a required argument: 'window'"),
    (_attention("noplan", plan=lambda self: None), "plan", "(self)", "AttentionBackend.plan(self, meta)",
     "too many positional arguments"),
    (_attention("init", __init__=lambda self, spec: None), "__init__", "(self, spec)",
     "Backend.__init__(self, spec, options=None)", "too many positional arguments"),
    (_attention("nocheck", check=staticmethod(lambda: [])), "check", "()", "AttentionBackend.check(cls, spec)",
     "too many positional arguments"),
    (type("BadGemm", (TorchFp4GemmBackend,), {"name": "badgemm", "forward_swiglu": lambda self, x, w: x}),
     "forward_swiglu", "(self, x, w)", "Fp4GemmBackend.forward_swiglu(self, x, weight, weight_scale, "
     "weight_scale_2, input_scale, intermediate)", "too many positional arguments"),
])
def test_a_method_with_the_wrong_signature_is_refused_at_registration(cls, method, got, want, why, caplog):
    """Not a raw TypeError deep in the model at the first step: the plugin is left out when it registers, and the
    message names the plugin, the backend, the method, its parameters and the base class's."""
    with caplog.at_level(logging.WARNING, logger="pieceworks.registry"):
        reg = registry(cls)
    (broken,) = reg.broken
    assert broken.name == "testplugin" and cls.name not in {c.name for c in reg.backends()}
    assert broken.reason.startswith(f"backend {cls.key()} ({__name__}.{cls.__qualname__}): {method}{got} can't "
                                    f"take the arguments of {want}")
    assert f"({why}" in broken.reason and "extra parameters need defaults" in broken.reason
    assert f"plugin 'testplugin' (registered in-process) is broken and left out: {broken.reason}" in caplog.text
    with pytest.raises(SelectionError, match=rf"no {cls.op} backend named '{cls.name}'.*\n  - plugin 'testplugin'"):
        resolve(reg, [f"backends.{cls.op}={cls.name}"], ops=(cls.op,))


def test_a_classmethod_overridden_by_a_plain_method_is_refused():
    reg = registry(_attention("plaincheck", check=lambda self, spec: []))
    (broken,) = reg.broken
    assert "check(self, spec) is a plain method, but AttentionBackend.check(cls, spec) is a classmethod, called on " \
           "the class: decorate it with @classmethod" in broken.reason


def test_a_method_replaced_by_a_value_is_refused():
    (broken,) = registry(_attention("nofwd", forward=None)).broken
    assert "backend attention.nofwd" in broken.reason
    assert "forward is None, not a method: define it with the parameters of AttentionBackend.forward" in broken.reason


@pytest.mark.parametrize("forward", [
    _forward,
    lambda self, *args, **kwargs: None,
    lambda self, q, k, v, out, *rest: None,
    lambda self, q, k, v, out, layer_id, scale, kv, window=None, *, trace=False: None,
    lambda self, query, key, value, output, layer, softmax_scale, pool: None,  # every caller passes by position
    staticmethod(lambda q, k, v, out, layer_id, scale, kv: None),
    classmethod(lambda cls, q, k, v, out, layer_id, scale, kv: None),
], ids=["same", "varargs", "rest", "extra_defaults", "renamed", "staticmethod", "classmethod"])
def test_signatures_that_can_take_the_base_arguments_are_accepted(forward):
    cls = _attention("fine", forward=forward, __init__=lambda self, spec, options=None, *, extra=1: None)
    reg = registry(cls)
    assert not reg.broken and cls in reg.backends("attention")
