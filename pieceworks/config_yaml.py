"""Reading configuration: YAML files, dicts and dotlist overrides merged by OmegaConf onto a dataclass
schema, and turned into plain frozen dataclasses.

`pieceworks.config` owns the schema and the value checks and calls these; nothing here names a config
section, so this module sits below it. Every failure is a `ConfigError` that names the key, the file
and, where it can be found, the line (`locate`).
"""

from __future__ import annotations

import enum
import io
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pieceworks.errors import ConfigError


def merge(schema: type, source: Path | dict | None, overrides: list[str] | None) -> Any:
    """`schema` (the root config dataclass) merged with `source` (a YAML file or a dict) and then
    with each dotlist override in turn ("model.path=/models/x"), as dataclass instances that may still
    hold OmegaConf containers (`plain` turns them into Python ones).

    Raises:
        ConfigError: the file can't be read or is not a YAML mapping; an override value YAML can't
            parse; an unknown key (the message lists the allowed ones) or a value of the wrong type,
            naming the file and line or the override.
    """
    label = ""
    path = source if isinstance(source, Path) else None
    try:
        if isinstance(source, dict):
            layer = OmegaConf.create(source)
        elif path is not None:
            label = str(path)
            layer = read_yaml(path)
        else:
            layer = OmegaConf.create({})
        merged = OmegaConf.merge(OmegaConf.structured(schema), layer)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value (e.g. model.path=/models/x)")
            label = "command-line overrides"
            merged = OmegaConf.merge(merged, _parse_override(item))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _explain(exc, label, path, schema) from None


def _parse_override(item: str) -> DictConfig:
    """One "key=value" override as OmegaConf nodes; a value YAML can't read is a ConfigError naming
    the key and the value."""
    import yaml

    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as e:
        key, value = item.split("=", 1)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{key}: can't parse the value {value!r} ({problem}); "
                          f"quote it or fix the brackets") from None


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
        layer = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    top = yaml.compose(text)  # OmegaConf reads a bare scalar `x` as {x: None}
    if not isinstance(layer, DictConfig) or not (top is None or isinstance(top, yaml.MappingNode)):
        kind = "a list" if isinstance(top, yaml.SequenceNode) else "a single value"
        raise ConfigError(f"{path}: the top level is {kind}; it must be a mapping of sections "
                          f"(model:, kv_cache:, ...)")
    return layer


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
