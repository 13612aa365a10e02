"""Typed configuration: frozen dataclasses, loaded from YAML/dicts in this one place.

Every component declares its own ``@dataclass(frozen=True, kw_only=True, slots=True)``;
this module turns plain data (YAML, JSON, ``key=value`` overrides) into those objects.
Unknown keys are errors, values are coerced to the declared field types, and
``flatten`` gives the dotted view used for MLflow params.

A ``key=value`` override is read as a YAML scalar, but a text setting keeps the word it was given
(``Written``): a field typed ``str``, a ``Literal`` of strings, a list of strings (``a,b``), or the
``str`` of ``str | None`` takes ``off``, ``on``, ``yes``, ``no``, ``true``, ``null``, ``01`` or
``2026-11-26`` as the text written, where YAML would read a bool, None, an int or a date. The one
exception: ``null`` (or ``~``) sets an optional field (``str | None``) to None, its only spelling on
the command line; a plain ``str`` field keeps ``"null"``. Every other setting (bool, int, float, a
list of numbers, a mapping) reads the YAML value as before. A YAML file is read as YAML: quote a word there.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that does not match its schema."""


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    """An override's scalar as typed on the command line (``text``) and as YAML reads it (``value``), when the
    two differ in type (``off`` -> False, ``2026-11-26`` -> a date): a text setting takes ``text``, any other
    setting ``value`` (``_coerce``)."""

    text: str
    value: Any


def _as_read(value: Any) -> Any:
    """``value`` with every ``Written`` inside it (a mapping's or a list's items too) as YAML reads it: what an
    untyped setting (``Any``, a ``dict[str, Any]``'s values: ``vllm_engine_kwargs.enforce_eager=true``) takes."""
    if isinstance(value, Written):
        return value.value
    if isinstance(value, dict):
        return {k: _as_read(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_read(v) for v in value]
    return value


def _takes_text(tp: Any) -> bool:
    """A text setting: ``str``, a ``Literal`` whose choices are all strings, or a list / tuple of those
    (given as ``a,b``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return all(isinstance(a, str) for a in args)
    if origin in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        return bool(items) and all(_takes_text(a) for a in items)
    return tp is str


def from_dict(cls: type[T], data: dict[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ``ConfigError``."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        got = repr(data.text if isinstance(data, Written) else data) if isinstance(data, (Written, str, int, float)) \
            else type(data).__name__
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {got}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {unknown}; valid keys are {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        default = _default_of(fields[name])
        if isinstance(value, dict) and dataclasses.is_dataclass(default):  # override on top of the field's default
            value = merge(to_dict(default), value)
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as err:  # missing fields, a value its __post_init__ refuses
        raise ConfigError(f"{where or cls.__name__}: {err}") from None


def _default_of(f: dataclasses.Field) -> Any:
    """A field's default value (``default_factory`` called), or None when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if isinstance(value, Written) and origin not in (typing.Union, types.UnionType):
        if _takes_text(tp):
            value = value.text
        else:  # YAML's reading; an error names the word as written (seed=off: got 'off', not False)
            try:
                return _coerce(tp, value.value, where)
            except ConfigError as err:
                raise ConfigError(str(err).replace(repr(value.value), repr(value.text))) from None
    if tp is Any:
        return _as_read(value)
    if origin in (typing.Union, types.UnionType):
        if (value.value if isinstance(value, Written) else value) is None and type(None) in args:
            return None  # ``key=null`` sets an optional field to None (a plain str field keeps "null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as err:
                errors.append(str(err))
        shown = value.text if isinstance(value, Written) else value
        raise ConfigError(f"{where}: {shown!r} matches none of {tp}: {errors}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        elif isinstance(value, (int, float)):  # one item, as a string without a comma is (train.epochs=1)
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if origin is tuple:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        inner = args[0] if args else Any
        return [_coerce(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        if len(args) == 2 and args[1] is not Any:
            return {k: _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
        return _as_read(dict(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected a bool, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{where}: expected an int, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where}: expected an int, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, datetime.date):  # YAML reads an unquoted 2026-11-26 as a date: the day as written
            return value.isoformat()
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["train.lr=1e-4", "draft.arch=eagle"]`` -> nested dict (values parsed as YAML scalars; a scalar YAML
    reads as something other than a string is a ``Written``, so a text setting keeps the word as typed)."""
    nested: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        if not isinstance(value, (str, dict, list)):  # off -> False, null -> None, 2026-11-26 -> a date, 01 -> 1
            value = Written(raw.strip(), value)
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} descends into a non-mapping")
        node[parts[-1]] = value
    return nested


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``update`` wins."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Load ``cls`` from a YAML file (optional) plus ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        data = loaded
    data = merge(data, parse_overrides(overrides))
    return from_dict(cls, data)


def to_dict(obj: Any) -> Any:
    """Dataclass tree -> plain JSON-able data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted-key view of a config (for MLflow params and hashing)."""
    data = to_dict(obj)
    out: dict[str, Any] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and value:
                out.update(flatten(value, name))
            else:
                out[name] = value
    else:
        out[prefix] = data
    return out


def config_hash(obj: Any) -> str:
    """Stable short hash of a config (or any JSON-able data)."""
    import hashlib

    blob = json.dumps(to_dict(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
