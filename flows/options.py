"""Command-line options generated from the config dataclasses (issue 11, item 6).

A config-bearing command is bound to a ``ConfigSpec``: its root dataclass, plus named
sections of other dataclasses (``eval``'s ``ray.*`` is ``RayEvalConfig``). The command
takes ``--config FILE`` (YAML) and trailing ``key=value`` overrides, both validated by
``specdraft.config`` (nested keys with dots, unknown keys are errors), and its ``--help``
lists every field of the tree — dotted key, type, default — read from the dataclasses, so a
field added there shows up here without an edit. Classes are named ``"module:Class"`` and
imported only when a command runs or shows its help, so ``specdraft --help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specdraft.config import ConfigError, from_dict, merge, parse_overrides, to_dict

REQUIRED = object()  # marks a field without a default in the help table


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigSpec:
    """The config a command is bound to."""

    root: str  # "module:Class" of the root dataclass
    sections: tuple[tuple[str, str], ...] = ()  # (key, "module:Class"): another dataclass under key.*
    defaults: tuple[str, ...] = ()  # key=value the command starts from, under --config and overrides


def resolve(ref: str) -> type:
    """``"pipelines.train:TrainConfig"`` -> the class."""
    module, _, name = ref.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert dataclasses.is_dataclass(cls), f"{ref} is not a dataclass"
    return cls


def _classes(spec: ConfigSpec) -> tuple[type, dict[str, type]]:
    root = resolve(spec.root)
    sections = {key: resolve(ref) for key, ref in spec.sections}
    clash = sorted(set(sections) & {f.name for f in dataclasses.fields(root)})
    assert not clash, f"{root.__name__} has field(s) {clash} that clash with the command's sections"
    return root, sections


def _read(path: str | Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return loaded


def load_config(
    spec: ConfigSpec, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[Any, dict[str, Any]]:
    """The command's config and its sections: ``spec.defaults``, then the YAML at ``path``, then overrides.

    Every problem — unknown key, wrong type, a failed check in a ``__post_init__`` — is a
    ``ConfigError`` naming the key.
    """
    root, sections = _classes(spec)
    data = parse_overrides(spec.defaults)
    if path is not None:
        data = merge(data, _read(path))
    data = merge(data, parse_overrides(overrides))
    valid = sorted({f.name for f in dataclasses.fields(root) if f.init} | set(sections))
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"{root.__name__}: unknown key(s) {unknown}; valid keys are {valid}")
    try:
        parts = {key: from_dict(cls, data.pop(key, None), key) for key, cls in sections.items()}
        return from_dict(root, data), parts
    except AssertionError as err:  # a dataclass's own checks
        raise ConfigError(f"{root.__name__}: {err}") from None


def type_name(tp: Any) -> str:
    """A short readable name for a field's type: ``float``, ``beagle|eagle | None``, ``list[int]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if tp is Any:
        return "Any"
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    if value is REQUIRED:
        return "(required)"
    if isinstance(value, str):
        return value if value else '""'
    text = json.dumps(to_dict(value), default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


def _item_class(tp: Any) -> tuple[type | None, str]:
    """The dataclass inside ``X | None`` (keys ``field.x``) or ``list[X]`` (keys ``field[].x``)."""
    for arg in typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,):
        if dataclasses.is_dataclass(arg):
            return arg, "."
        if typing.get_origin(arg) in (list, tuple) and typing.get_args(arg) and dataclasses.is_dataclass(
            typing.get_args(arg)[0]
        ):
            return typing.get_args(arg)[0], "[]."
    return None, ""


def field_rows(cls: type, prefix: str = "", instance: Any = None) -> Iterator[tuple[str, str, str]]:
    """(dotted key, type, default) for every field of dataclass ``cls``, nested ones flattened.

    Defaults come from ``instance`` when given (so a parent's ``default_factory`` shows), else
    from the field definitions.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, key = hints[f.name], prefix + f.name
        value = getattr(instance, f.name) if instance is not None else _default(f)
        if dataclasses.is_dataclass(tp):
            yield from field_rows(tp, key + ".", value if dataclasses.is_dataclass(value) else None)
            continue
        yield key, type_name(tp), _show(value)
        item, sep = _item_class(tp)
        if item is not None:
            yield from field_rows(item, key + sep)


def describe(spec: ConfigSpec) -> str:
    """The help section listing every config field of the command."""
    root, sections = _classes(spec)
    try:
        config, parts = load_config(spec)
    except ConfigError:  # a root with required fields: show the field definitions' defaults
        config, parts = None, {}
    rows = list(field_rows(root, "", config))
    for key, cls in sections.items():
        rows += field_rows(cls, key + ".", parts.get(key))
    names = f"{root.__name__}" + "".join(f", {key}.*: {cls.__name__}" for key, cls in sections.items())
    kw = max(len(r[0]) for r in rows) + 2
    tw = max(len(r[1]) for r in rows) + 2
    lines = [
        f"config fields ({names}): set them in the --config YAML or as trailing key=value",
        "(nested keys with dots, lists as a,b or [a,b]); a --config file overrides these defaults:",
        "",
        f"  {'key':<{kw}}{'type':<{tw}}default",
    ]
    lines += [f"  {k:<{kw}}{t:<{tw}}{d}" for k, t, d in rows]
    return "\n".join(lines) + "\n"


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser whose ``--help`` ends with its config fields (built only when shown)."""

    config_spec: ConfigSpec | None = None

    def format_help(self) -> str:
        text = super().format_help()
        if self.config_spec is not None:
            text += "\n" + describe(self.config_spec)
        return text


def add_config_options(parser: CommandParser, spec: ConfigSpec, *, example: str, default: str | None = None) -> None:
    """``--config FILE`` and trailing ``key=value`` overrides for ``spec``; the fields go into ``--help``."""
    parser.config_spec = spec
    parser.add_argument("--config", default=default, metavar="FILE",
                        help=f"YAML with the config fields listed below (default: {default or 'none'})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=f"config overrides, e.g. {example}")
    parser.set_defaults(config_spec=spec)
