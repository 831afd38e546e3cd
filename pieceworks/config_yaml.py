"""Reading configuration: YAML files, dicts and dotlist overrides merged by OmegaConf onto a dataclass
schema, and turned into plain frozen dataclasses.

`pieceworks.config` owns the schema and the value checks and calls these; nothing here names a config
section, so this module sits below it (a schema field may carry an `example` in its metadata, a YAML flow
value that error messages show). Every failure is a `ConfigError` that names the key, the file and,
where it can be found, the line (`locate`).
"""

from __future__ import annotations

import enum
import io
import typing
from dataclasses import Field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, TupleConfig
from omegaconf.errors import OmegaConfBaseException

from pieceworks.errors import ConfigError

OVERRIDES = "command-line overrides"  # where a message says an override's value came from
SEQUENCES = (ListConfig, TupleConfig)
CONTAINERS = (DictConfig, *SEQUENCES)


def merge(schema: type, source: Path | dict | None, overrides: list[str] | None) -> Any:
    """`schema` (the root config dataclass) merged with `source` (a YAML file or a dict) and then
    with each dotlist override in turn ("model.path=/models/x"), as dataclass instances that may still
    hold OmegaConf containers (`plain` turns them into Python ones).

    Raises:
        ConfigError: the file can't be read or is not a YAML mapping; an override key with an empty
            part or a value YAML can't parse; an unknown key (the message lists the allowed ones), a
            value of the wrong shape (a scalar or mapping for a list, a non-mapping for a section, a list
            where an earlier layer set a mapping) or type, naming the file and line or the override.
    """
    label = ""
    path = source if isinstance(source, Path) else None
    try:
        if isinstance(source, dict):
            layer = OmegaConf.create(source)
            _check_shapes(schema, layer, label)
        elif path is not None:
            label = str(path)
            layer = read_yaml(path)
            _check_shapes(schema, layer, label, path)
        else:
            layer = OmegaConf.create({})
        merged = OmegaConf.merge(OmegaConf.structured(schema), layer)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value (e.g. model.path=/models/x)")
            label = OVERRIDES
            layer = _parse_override(item)
            _check_shapes(schema, layer, label)
            merged = _merge_layer(merged, layer, label)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _explain(exc, label, path, schema) from None


def _merge_layer(merged: DictConfig, layer: DictConfig, label: str) -> DictConfig:
    """`layer` merged onto `merged`; a list given where an earlier layer set a mapping, or a mapping
    where it set a list (in a free-form field: `_check_shapes` catches the schema's own), is a
    ConfigError naming the key (OmegaConf raises a bare TypeError)."""
    try:
        return OmegaConf.merge(merged, layer)
    except TypeError:
        clash = _clash(merged, layer, "")
        if clash is None:
            raise
        key, old, new = clash
        kinds = ("a mapping", "a list") if isinstance(old, DictConfig) else ("a list", "a mapping")
        raise ConfigError(f"{key}: {_shown(new)} is {kinds[1]} and can't replace {_shown(old)}, {kinds[0]} set "
                          f"before it; give {kinds[0]} or drop the earlier setting (in {label})") from None


def _clash(old: DictConfig, new: DictConfig, prefix: str) -> tuple[str, Any, Any] | None:
    """(dotted key, old value, new value) of the first key where `new` puts a list onto a mapping of
    `old` or a mapping onto a list, or None."""
    for k in new:
        if k not in old or any(OmegaConf.is_interpolation(c, k) or OmegaConf.is_missing(c, k) for c in (old, new)):
            continue
        a, b = old[k], new[k]
        if isinstance(a, DictConfig) and isinstance(b, DictConfig):
            if (found := _clash(a, b, f"{prefix}{k}.")) is not None:
                return found
        elif isinstance(a, DictConfig) != isinstance(b, DictConfig) and all(isinstance(v, CONTAINERS) for v in (a, b)):
            return f"{prefix}{k}", a, b
    return None


def _parse_override(item: str) -> DictConfig:
    """One "key=value" override as OmegaConf nodes; a key with an empty part ("model..arch") or a
    value YAML can't read is a ConfigError naming the key (and the value)."""
    import yaml

    key, value = item.split("=", 1)
    parts = key.split(".")
    if "" in parts:  # OmegaConf would read each empty part as a key named ""
        fixed = ".".join(p for p in parts if p)
        why = ("it is empty" if not fixed else "it starts with a dot" if not parts[0]
               else "it ends with a dot" if not parts[-1] else "empty part between dots")
        hint = f"; did you mean {fixed}={value}?" if fixed else "; write key=value (e.g. model.path=/models/x)"
        raise ConfigError(f"override {item!r}: the key {key!r} is malformed ({why}){hint}")
    if key != key.strip():
        raise ConfigError(f"override {item!r}: the key {key!r} has spaces around it; write {key.strip()}={value}")
    if not value.strip():  # YAML reads it as null: `model.arch=$ARCH` with ARCH unset would unset the key
        raise ConfigError(f"override {item!r}: no value; give one, or {key}=null to unset the key")
    try:
        layer = OmegaConf.from_dotlist([item])  # first: its loader's messages
        node = yaml.compose(value)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{key}: can't parse the value {value!r} ({problem}); "
                          f"quote it or fix the brackets") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ConfigError(f"{key}: can't read the value ({str(e).split(':')[0]})") from None
    odd = _yaml11_number(node)
    if odd is not None:
        raise ConfigError(f"{key}: {odd[0]}")
    return layer


def read_yaml(path: Path) -> DictConfig:
    """A YAML config file as OmegaConf nodes; every problem with the file is a ConfigError naming it
    (and the line, for YAML syntax: tabs, duplicate keys, unclosed brackets)."""
    import yaml

    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give a YAML file")
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} can't be read: {e.strerror}") from None
    try:
        top = yaml.compose(text)  # OmegaConf reads a bare scalar `x` as {x: None}, and refuses a number
        if top is not None and not isinstance(top, yaml.MappingNode):
            layer = None
        else:  # after compose: OmegaConf's loader gives the clearer messages (tabs, duplicate keys, brackets)
            layer = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        try:  # OmegaConf's loader's message where it has one (PyYAML's own refuses what it may take)
            OmegaConf.load(io.StringIO(text))
        except yaml.YAMLError as own:
            e = own
        except Exception:
            pass
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; a config is a few levels of sections") from None
    except ValueError as e:  # an integer of more digits than Python converts (no advice on sys settings)
        raise ConfigError(f"{path}: a value can't be read ({str(e).split(':')[0]})") from None
    odd = _yaml11_number(top)
    if odd is not None:
        raise ConfigError(f"{path}:{odd[1] + 1}: {odd[0]}")
    if not isinstance(layer, DictConfig):
        kind = "a list" if isinstance(top, yaml.SequenceNode) else "a single value"
        raise ConfigError(f"{path}: the top level is {kind}; it must be a mapping of sections "
                          f"(model:, kv_cache:, ...)")
    return layer


INT, FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def _yaml11_number(node: Any) -> tuple[str, int] | None:
    """The first plain scalar YAML 1.1 reads as a number other than the decimal it looks like (`1:30` is 90 and
    `1:30.5` 90.5 in base 60, `016` is 14 in octal), as what to say and its line; None when there is none."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        return next(filter(None, (_yaml11_number(v) for _, v in node.value)), None)
    if isinstance(node, yaml.SequenceNode):
        return next(filter(None, (_yaml11_number(v) for v in node.value)), None)
    if not isinstance(node, yaml.ScalarNode) or node.style or node.tag not in (INT, FLOAT):
        return None
    text = node.value.replace("_", "").lstrip("+-")
    value = yaml.safe_load(node.value)
    if ":" in text:
        kind = "a base-60 number"
    elif node.tag == INT and text.isdigit() and text[0] == "0" and abs(value) != int(text, 10):
        kind = "an octal number"
    else:
        return None
    return (f"{node.value} reads as {value} (YAML 1.1: {kind}); write {value} if that is meant, or quote "
            f"'{node.value}' for the text", node.start_mark.line)


def locate(path: Path, dotted: str) -> str:
    """`file:line` of `dotted` (or its nearest present parent) in a YAML file, or just the file."""
    import yaml

    try:
        node = yaml.compose(path.read_text())
    except Exception:  # the file was parsed by OmegaConf already; a location is a nicety
        return str(path)
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        for k, v in node.value:
            if k.value == part:
                line, node = k.start_mark.line + 1, v
                break
        else:
            break
    return f"{path}:{line}" if line else str(path)


def with_location(exc: ConfigError, path: Path | None) -> ConfigError:
    """`exc` (whose message starts with the dotted key) with the file and line of that key appended,
    when `path` is a YAML file that sets it."""
    if path is None:
        return exc
    where = locate(path, str(exc).split(":", 1)[0])
    return ConfigError(f"{exc} (in {where})") if where != str(path) else exc


def _check_shapes(schema: type, layer: DictConfig, source: str, path: Path | None = None, prefix: str = "") -> None:
    """Refuse a value of `layer` whose shape does not fit its schema field: a non-list where the field
    is a list, a non-mapping where it is a section (a nested dataclass) or a dict. OmegaConf's merge
    reports these in its own terms ("AnyNode is not a ListConfig", "int is not a subclass of
    ModelConfig" with no key) or, for a mapping merged onto a list, as a bare TypeError.

    `source` is "" (a dict), the file name (then `path` is that file) or `OVERRIDES`: it picks the
    syntax of the example in the message (key=value for overrides) and where the message says the value
    came from. Unknown keys, interpolations and missing values are left to OmegaConf.
    """
    hints = typing.get_type_hints(schema)
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        if OmegaConf.is_missing(layer, f.name):  # `in` says no for it: read as not given, the key would be unset
            where = locate(path, key) if path is not None else source
            raise ConfigError(f"{key}: ??? (OmegaConf's missing value) is no setting; give a value, or leave the key "
                              f"out{f' (in {where})' if where else ''}")
        if f.name not in layer or OmegaConf.is_interpolation(layer, f.name):
            continue
        kind, optional = _shape(hints[f.name])
        value = layer[f.name]
        if kind is None or (value is None and optional):
            continue
        if kind == "list":
            fits, expected = isinstance(value, SEQUENCES), "a list"
        elif kind == "bool":  # OmegaConf would take any number, or "16", for true
            fits = isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false"))
            expected = "true or false"
        else:
            fits = isinstance(value, DictConfig)
            expected = f"a mapping of {f.name} settings" if kind == "section" else "a mapping"
        if fits:
            if kind == "section":
                _check_shapes(hints[f.name], value, source, path, f"{key}.")
            continue
        example = _example(f, hints[f.name])
        example = f"{key}={example}" if source == OVERRIDES else f"{f.name}: {example}"
        where = locate(path, key) if path is not None else source
        where = f" (in {where})" if where else ""
        raise ConfigError(f"{key}: expected {expected} (e.g. {example}), got {_shown(value)}{where}")


def _shape(hint: Any) -> tuple[str | None, bool]:
    """("section" | "list" | "mapping" | "bool" | None, whether None is allowed) of a schema field's type."""
    hint, optional = _unwrap(hint)
    if is_dataclass(hint):
        return "section", optional
    origin = typing.get_origin(hint) or hint
    if origin is bool:
        return "bool", optional
    if origin in (list, tuple):
        return "list", optional
    if origin is dict:
        return "mapping", optional
    return None, optional


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(T, True) for Optional[T], (hint, False) otherwise."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else Any), True
    return hint, False


def _example(f: Field, hint: Any) -> str:
    """A YAML flow value for field `f`: its metadata's `example`, or one built from its type (a
    section: its first field with a plain default)."""
    if "example" in f.metadata:
        return f.metadata["example"]
    kind, _ = _shape(hint)
    hint, _ = _unwrap(hint)
    if kind == "section":
        sub_hints = typing.get_type_hints(hint)
        for sub in fields(hint):
            default = sub.default_factory() if callable(sub.default_factory) else sub.default
            if is_dataclass(default):
                return f"{{{sub.name}: {_example(sub, sub_hints[sub.name])}}}"
            if isinstance(default, bool):
                return f"{{{sub.name}: {str(default).lower()}}}"
            if isinstance(default, (enum.Enum, str, int, float)):
                return f"{{{sub.name}: {as_dict(default)}}}"
        return "{...}"
    if kind == "list":
        return "[a,b]" if typing.get_args(hint) == (str,) else "[1,2]"
    if kind == "bool":
        return "true"
    return "{key: value}"


def _shown(value: Any) -> str:
    """A config value as a message shows it: null for None, containers as plain Python."""
    if value is None:
        return "null"
    return repr(_to_container(value))


def _explain(exc: OmegaConfBaseException, source: str, path: Path | None, schema: type) -> ConfigError:
    """Turn an OmegaConf error into one line naming the key, the value and what is allowed."""
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if path is not None and source == str(path):
        source = locate(path, key)
    where = f" (in {source})" if source else ""
    if type(exc).__name__ == "ConfigKeyError" or "not in struct" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        allowed = _allowed_keys(schema, parent)
        hint = f"; allowed keys{' under ' + parent if parent else ''}: {', '.join(allowed)}" if allowed else ""
        return ConfigError(f"{key}: unknown key{where}{hint}")
    return ConfigError(f"{key or 'config'}: {msg}{where}")


def _allowed_keys(schema: type, dotted: str) -> list[str]:
    node: Any = schema
    for part in filter(None, dotted.split(".")):
        match = {f.name: f for f in fields(node)}.get(part) if is_dataclass(node) else None
        if match is None:
            return []
        node = match.default_factory() if callable(match.default_factory) else match.default
        node = type(node)
    return [f.name for f in fields(node)] if is_dataclass(node) else []


def plain(obj: Any) -> Any:
    """OmegaConf.to_object gives dataclass instances holding OmegaConf containers; re-create them so
    nested dict/list values are plain Python (the dataclasses themselves are frozen)."""
    if is_dataclass(obj):
        return replace(obj, **{f.name: plain(getattr(obj, f.name)) for f in fields(obj)})
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in _to_container(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in _to_container(obj)]
    return _to_container(obj)


def _to_container(obj: Any) -> Any:
    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=True)
    return obj


def as_dict(cfg: Any) -> Any:
    """A config dataclass as nested dicts of plain values (enums by their value): `merge`'s input."""
    if is_dataclass(cfg):
        return {f.name: as_dict(getattr(cfg, f.name)) for f in fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    return cfg


def to_yaml(cfg: Any) -> str:
    """A config dataclass as YAML, which `merge` reads back as the same config."""
    return OmegaConf.to_yaml(OmegaConf.create(as_dict(cfg)))
