"""The backend contract shared by every op.

A backend is a small class with pure declarations (name, op, priority, modes, graph modes, numerics,
requirements) and `check(spec) -> list[str]`: the reasons it can't serve `spec`, empty when it can.
Nothing here reads global state: `BackendSpec` carries every fact about the machine and the model that
a check may look at, so tests build one by hand (a capability override is just a field). A backend's
options (`backends.options.<name>`) become its Options dataclass here, checked for every backend of the name.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from pieceworks.core.batch import ForwardMode, GraphMode
from pieceworks.errors import ConfigError

OPS = ("attention", "mla", "fp4_gemm", "moe")
NUMERICS = ("w4a4", "w4a16")

ALL_FORWARD_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED})
ALL_GRAPH_MODES = frozenset(GraphMode)


@dataclass(frozen=True)
class ModelFacts:
    """What backends may need to know about the model (all sizes are per tensor-parallel rank).

    Attributes:
        arch: "llama" or "deepseek_v3".
        dtype: activation dtype.
        num_heads: query heads.
        num_kv_heads: KV heads (GQA); 1 for MLA.
        head_dim: attention head size (GQA).
        kv_lora_rank: MLA latent size (0 without MLA).
        qk_rope_head_dim: MLA rope part of the key (0 without MLA).
        page_size: tokens per KV page.
        fp4: whether linears are NVFP4.
        moe_experts: routed experts (0 without MoE).
        moe_quant: "nvfp4" or "none" for the expert weights.
        sliding_windows: per layer, the keys a query sees in a sliding-window layer (itself and the W - 1
            before it), 0 in a full-attention layer; empty: every layer full (GQA attention backends that declare
            `windows` serve it).
        attn_logit_softcap: Gemma 2's: scores become cap * tanh(scores / cap) before the softmax (0: none;
            attention backends that declare `softcap` serve it).
        kv_fp8: the KV pool stores e4m3 K/V with per-layer scales (`kv_cache.dtype`; attention backends that
            declare `fp8_kv` serve it, no MLA backend does).
    """

    arch: str = "llama"
    dtype: torch.dtype = torch.float32
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    page_size: int = 16
    fp4: bool = False
    moe_experts: int = 0
    moe_quant: str = "none"
    sliding_windows: tuple[int, ...] = ()
    attn_logit_softcap: float = 0.0
    kv_fp8: bool = False


@dataclass(frozen=True)
class BackendSpec:
    """The machine and model a backend is asked to serve.

    Attributes:
        device: "cpu" or "cuda".
        capability: CUDA compute capability (major, minor), None on CPU.
        model: model facts.
        fp4_numerics: "auto", "w4a4" or "w4a16" (quantization.fp4_numerics).
        modules: importable module names, or None to probe the environment (tests pass a set).
    """

    device: str = "cpu"
    capability: tuple[int, int] | None = None
    model: ModelFacts = field(default_factory=ModelFacts)
    fp4_numerics: str = "auto"
    modules: frozenset[str] | None = None

    def importable(self, name: str) -> bool:
        if self.modules is not None:
            return name in self.modules
        return importlib.util.find_spec(name) is not None

    @classmethod
    def for_device(cls, device: torch.device | str, **kw: Any) -> "BackendSpec":
        """A spec for a real device, with its capability read from the driver."""
        device = torch.device(device)
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return cls(device=device.type, capability=cap, **kw)


@dataclass(frozen=True)
class Requirements:
    """What a backend needs from the machine.

    Attributes:
        devices: device kinds it runs on.
        min_capability: lowest CUDA compute capability, e.g. (8, 0).
        capability_majors: CUDA architectures it is built for, by major version, e.g. (10,) for
            sm_100/sm_103; None = any at or above min_capability.
        modules: modules that must be importable (checked without importing them).
        install_hint: how to get the modules, shown with the reason.
    """

    devices: tuple[str, ...] = ("cpu", "cuda")
    min_capability: tuple[int, int] | None = None
    capability_majors: tuple[int, ...] | None = None
    modules: tuple[str, ...] = ()
    install_hint: str = ""

    def reasons(self, spec: BackendSpec) -> list[str]:
        out = []
        if spec.device not in self.devices:
            out.append(f"needs device {' or '.join(self.devices)} (this run: {spec.device})")
        elif spec.device == "cuda" and spec.capability is not None:
            cap = ".".join(map(str, spec.capability))
            if self.min_capability and spec.capability < self.min_capability:
                need = ".".join(map(str, self.min_capability))
                out.append(f"needs compute capability >= {need} (this GPU: {cap})")
            if self.capability_majors and spec.capability[0] not in self.capability_majors:
                need = " or ".join(f"{m}.x" for m in self.capability_majors)
                out.append(f"needs compute capability {need} (this GPU: {cap})")
        for mod in self.modules:
            if not spec.importable(mod):
                hint = f" ({self.install_hint})" if self.install_hint else ""
                out.append(f"module '{mod}' is not importable{hint}")
        return out


def contract(method):
    """Marks an op base class's method that every backend of the op implements (`Backend.unimplemented`)."""
    method.__pieceworks_contract__ = True
    return method


def not_implemented(backend: Any, method: str) -> NotImplementedError:
    """The error of a contract method a backend did not define (the registry refuses such classes first)."""
    return NotImplementedError(f"{type(backend).__qualname__} does not define {method}: {backend.op} backends "
                               f"implement it with the signature of the op's base class (docs/plugins.md)")


class Backend:
    """One named implementation of one op.

    Subclasses declare the class attributes below and implement the op's run interface (see the op's
    `base.py`). They are built by the registry as `cls(spec, options)` for the table entries they win.
    """

    name: ClassVar[str]
    """Short registry key, unique within the op (`torch`, `flashinfer`, `triton`, `trtllm`)."""
    op: ClassVar[str]
    """One of OPS."""
    priority: ClassVar[int] = 0
    """Higher wins under `auto`; equal priorities go by name (alphabetical). Conventions: torch
    references 0-1, portable GPU kernels 40-50, vendor libraries 70-100, a specialised kernel that should
    win where it serves (e.g. decode only) just above the general one it beats."""
    requires: ClassVar[Requirements] = Requirements()
    forward_modes: ClassVar[frozenset[ForwardMode]] = ALL_FORWARD_MODES
    """Forward modes it serves (EXTEND, DECODE, MIXED); all by default."""
    graph_modes: ClassVar[frozenset[GraphMode]] = frozenset({GraphMode.EAGER})
    """Graph modes it is safe in; EAGER only unless declared, so that graph safety is never claimed by
    omission. FULL = `forward` is capturable in a whole-forward CUDA decode graph (no host sync, no
    tensor built from host data, buffers that `plan` refills at fixed addresses per graph batch size);
    PIECEWISE = safe in piecewise graphs (attention and mla run eagerly between pieces with plan/run
    as graphs expect and padded rows as the op's contract says; other ops are captured inside a piece).
    The conformance suite (`pieceworks.testing`) checks every declared mode."""
    full_extend: ClassVar[bool] = False
    """attention and mla: FULL holds for extend and mixed steps too (executor/extend_graph.py): `plan` of a
    `StepMetadata` with `extend_index` does no host work that the step's layout changes, and `forward` takes
    any layout of up to the captured tokens over up to `graph_batch_size` sequences from those device buffers.
    Other ops' graph modes hold for every forward mode."""
    numerics: ClassVar[tuple[str, ...]] = ()
    """fp4_gemm and moe: the NVFP4 numerics it implements, its default first (see NUMERICS)."""
    Options: ClassVar[type | None] = None
    """A dataclass of the backend's config options (`backends.options.<name>`), or None."""
    description: ClassVar[str] = ""

    def __init__(self, spec: BackendSpec, options: Any = None) -> None:
        self.spec = spec
        self.options = options if options is not None else (self.Options() if self.Options else None)

    @classmethod
    def check(cls, spec: BackendSpec) -> list[str]:
        """Reasons this backend can't serve `spec`; empty when it can.

        Subclasses extend this (call super) with model-dependent reasons, e.g. an unsupported page size.
        """
        reasons = cls.requires.reasons(spec)
        if cls.numerics and spec.model.fp4 and spec.fp4_numerics not in ("auto", *cls.numerics):
            reasons.append(
                f"implements {'/'.join(cls.numerics)} numerics; quantization.fp4_numerics asks for "
                f"{spec.fp4_numerics}"
            )
        return reasons

    @classmethod
    def resolved_numerics(cls, spec: BackendSpec) -> str | None:
        """The numerics this backend runs for `spec` (its default under `auto`)."""
        if not cls.numerics:
            return None
        return cls.numerics[0] if spec.fp4_numerics == "auto" else spec.fp4_numerics

    @classmethod
    def key(cls) -> str:
        return f"{cls.op}.{cls.name}"

    @classmethod
    def unimplemented(cls) -> list[str]:
        """The op's contract methods (`contract`) this class leaves to the base class."""
        return [name for name in dir(cls) if getattr(getattr(cls, name, None), "__pieceworks_contract__", False)]

    @classmethod
    def signature_problems(cls) -> list[str]:
        """How this class overrides the methods of its op's base classes (`pieceworks.backends.*.base`,
        `__init__` included) so that the calls the registry, models and ops make with the base method's
        arguments would raise: one message per method, naming the method, its parameters and the base's,
        e.g. 'forward(self, q, k) can't take the arguments of AttentionBackend.forward(self, q, k, v, out,
        layer_id, scale, kv) (too many positional arguments)'. Extra parameters with defaults, *args and
        **kwargs are fine; renamed parameters are too (every caller passes them by position). Run at
        registration, once per class."""
        out, seen = [], set()
        for klass in cls.__mro__:  # the nearest base's signature is the reference
            if not (klass.__module__.startswith("pieceworks.backends.") and klass.__module__.endswith(".base")):
                continue
            for name, ref in vars(klass).items():
                if name in seen or (name.startswith("_") and name != "__init__"):
                    continue
                seen.add(name)
                problem = _override_problem(cls, klass, name, ref)
                if problem:
                    out.append(problem)
        return out

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.key()}>"


def bad_check_result(cls: type[Backend], got: Any) -> str | None:
    """What is wrong with `got`, the value `cls.check` returned, or None where it is a list (or tuple) of reason
    strings (None back is a forgotten return; a bare string, one reason not in a list)."""
    if isinstance(got, (list, tuple)) and all(isinstance(r, str) for r in got):
        return None
    return (f"{cls.key()}.check() returned {got!r}; return a list of reason strings, each why it can't serve "
            "(empty: it can)")


def _shown(sig: inspect.Signature) -> str:
    """`sig` without annotations: '(self, q, k, v, out, layer_id, scale, kv)'."""
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def _override_problem(cls: type, base: type, name: str, ref: Any) -> str | None:
    """Why `cls`'s `name` can't be called as `base.name` is (see `Backend.signature_problems`), if it can't."""
    on_class = isinstance(ref, (classmethod, staticmethod))  # called on the class, not on an instance
    ref_fn = ref.__func__ if on_class else ref
    if not inspect.isfunction(ref_fn):
        return None  # a declaration (name, Options, requires, ...), not a method
    impl = inspect.getattr_static(cls, name)
    if impl is ref:
        return None
    if isinstance(impl, (classmethod, staticmethod)):
        fn, first = impl.__func__, ("cls",) if isinstance(impl, classmethod) else ()
    elif inspect.isfunction(impl):
        fn, first = impl, () if on_class else ("self",)
    elif not callable(impl):
        return f"{name} is {impl!r}, not a method: define it with the parameters of {base.__qualname__}.{name}"
    else:
        return None  # some other callable: its binding can't be read from here
    try:
        want, got = inspect.signature(ref_fn), inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a readable signature
        return None
    params = list(want.parameters.values())[0 if isinstance(ref, staticmethod) else 1:]  # without self/cls
    args = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY}
    try:
        got.bind(*first, *args, **kwargs)
    except TypeError as exc:
        if isinstance(ref, classmethod) and inspect.isfunction(impl):
            return (f"{name}{_shown(got)} is a plain method, but {base.__qualname__}.{name}{_shown(want)} is a "
                    "classmethod, called on the class: decorate it with @classmethod")
        return f"{name}{_shown(got)} can't take the arguments of {base.__qualname__}.{name}{_shown(want)} ({exc})"
    return None


@dataclass
class Candidate:
    """A backend considered for one kernel-table entry, with the reasons it can't serve (if any)."""

    backend: type[Backend]
    reasons: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.reasons

    def veto(self, reason: str) -> None:
        """Exclude this candidate (called by plugins from `pieceworks_adjust_candidates`)."""
        self.reasons.append(f"vetoed by a plugin: {reason}")


class SelectionError(ConfigError):
    """A configured backend can't serve, or no backend can serve an op at all (a `backends.*` value
    that this machine or model can't honour, hence a ConfigError)."""


def parse_options(backend: type[Backend], raw: dict | None) -> Any:
    """Turn `backends.options.<name>` into the backend's Options dataclass, naming unknown keys."""
    raw = dict(raw or {})
    if backend.Options is None:
        if raw:
            raise ValueError(
                f"backends.options.{backend.name}: backend {backend.key()} takes no options "
                f"(got {sorted(raw)})"
            )
        return None
    allowed = {f.name for f in fields(backend.Options)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(
            f"backends.options.{backend.name}: unknown option(s) {unknown} for {backend.key()}; "
            f"allowed: {sorted(allowed)}"
        )
    return backend.Options(**raw)


def known_options(name: str, all_backends: list[type[Backend]]) -> set[str]:
    known: set[str] = set()
    for other in all_backends:
        if other.name == name and other.Options is not None:
            known |= {f.name for f in fields(other.Options)}
    return known


def check_options(backends_cfg: Any, all_backends: list[type[Backend]]) -> None:
    """Every `backends.options.<name>` key must be an option of some registered backend of that name, and its
    value one that backend's Options take, whether or not that backend is chosen here (a typo fails on a CPU
    machine too); options for a name no registered backend has are an error too (a typo, or a plugin that is
    not installed here)."""
    names = sorted({c.name for c in all_backends})
    for name, raw in (backends_cfg.options or {}).items():
        if name not in names:
            raise ConfigError(f"backends.options.{name}: no registered backend is named {name!r} (registered: "
                              f"{', '.join(names)}); fix the name, install the plugin that provides it, or "
                              "remove the entry")
        known = known_options(name, all_backends)
        unknown = sorted(set(dict(raw or {})) - known)
        if unknown:
            raise SelectionError(
                f"backends.options.{name}: unknown option(s) {unknown}; known: {sorted(known) or 'none'}"
            )
        for cls in all_backends:  # their values too, whether or not the backend can serve here
            if cls.name == name and cls.Options is not None:
                try:
                    parse_options(cls, options_for(backends_cfg, cls))
                except (ValueError, TypeError) as e:
                    said = str(e) if str(e).startswith("backends.options.") else f"backends.options.{name}: {e}"
                    raise ConfigError(said) from None


def options_for(backends_cfg: Any, cls: type[Backend]) -> dict:
    """`backends.options.<name>` restricted to the keys `cls` knows (backends of one name share the
    options: flashinfer attention and MLA share `variant`, say; `check_options` has refused keys that
    no backend of that name knows)."""
    raw = dict(backends_cfg.options.get(cls.name, {}) or {})
    mine = {f.name for f in fields(cls.Options)} if cls.Options else set()
    return {k: v for k, v in raw.items() if k in mine}
