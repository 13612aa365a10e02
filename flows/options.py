"""Command-line options generated from the config dataclasses (issue 11, item 6; issue 23, item 7).

A config-bearing command is bound to a ``ConfigSpec``: its root dataclass, plus named
sections of other dataclasses (``eval``'s ``ray.*`` is ``RayEvalConfig``). The command
takes ``--config FILE`` (YAML) and trailing ``key=value`` overrides, both validated by
``specdraft.config`` (nested keys with dots, unknown keys are errors), and its ``--help``
lists every field of the tree — dotted key, type, default and the field's comment as its
description — so a field added there shows up here without an edit; a field with
``metadata={"hidden": True}`` (a test hook) is valid but not listed. Classes are named
``"module:Class"``: the help reads them from their source (``flows/config_source.py``) and
a command imports them only when it runs, so every ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flows.config_source import HIDDEN, REQUIRED  # REQUIRED: the default of a field without one
from specdraft.config import ConfigError, from_dict, merge, parse_overrides, to_dict

DESCRIPTION_WIDTH = 100  # columns of a field's description lines in --help


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
    """A default as the help shows it: plain data (``to_dict``) as JSON, a string as itself."""
    if value is REQUIRED:
        return "(required)"
    if isinstance(value, str):
        return value if value else '""'
    text = json.dumps(value, default=str)
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


def _descriptions(cls: type) -> dict[str, str]:
    """Field name -> description (the field's comment in its class's source), base classes included."""
    from flows.config_source import class_descriptions

    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(class_descriptions(klass.__module__, klass.__qualname__))
    return out


def field_rows(cls: type, prefix: str = "", instance: Any = None) -> Iterator[tuple[str, str, Any, str]]:
    """(dotted key, type, default, description) for every field of dataclass ``cls`` shown in ``--help``,
    nested ones flattened; a field with ``metadata={"hidden": True}`` (a test hook) is left out.

    Defaults come from ``instance`` when given (so a parent's ``default_factory`` shows), else
    from the field definitions; they are plain data (``to_dict``), or ``REQUIRED``. This imports the
    classes (``flows.config_source.static_rows`` reads the same rows from their source, at once).
    """
    hints = typing.get_type_hints(cls)
    described = _descriptions(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get(HIDDEN):
            continue
        tp, key = hints[f.name], prefix + f.name
        value = getattr(instance, f.name) if instance is not None else _default(f)
        if dataclasses.is_dataclass(tp):
            yield from field_rows(tp, key + ".", value if dataclasses.is_dataclass(value) else None)
            continue
        yield key, type_name(tp), value if value is REQUIRED else to_dict(value), described.get(f.name, "")
        item, sep = _item_class(tp)
        if item is not None:
            yield from field_rows(item, key + sep)


def imported_rows(spec: ConfigSpec) -> list[tuple[str, str, Any, str]]:
    """The rows of ``describe``, read from the imported dataclasses (the reference for ``static_rows``)."""
    root, sections = _classes(spec)
    try:
        config, parts = load_config(spec)
    except ConfigError:  # a root with required fields: show the field definitions' defaults
        config, parts = None, {}
    rows = list(field_rows(root, "", config))
    for key, cls in sections.items():
        rows += field_rows(cls, key + ".", parts.get(key))
    return rows


def source_rows(spec: ConfigSpec) -> list[tuple[str, str, Any, str]]:
    """The rows of ``describe``, read from the dataclasses' source without importing them
    (``flows.config_source``); raises ``Unsupported`` for a form that reader does not know."""
    from flows.config_source import static_rows

    defaults = parse_overrides(spec.defaults)
    rows = list(static_rows(spec.root, "", {k: v for k, v in defaults.items() if k not in dict(spec.sections)}))
    for key, ref in spec.sections:
        rows += static_rows(ref, key + ".", defaults.get(key))
    return rows


def describe(spec: ConfigSpec) -> str:
    """The help section listing every config field of the command, with its description."""
    from flows.config_source import Unsupported

    try:
        rows = source_rows(spec)
    except Unsupported:  # a form the source reader does not know: import the classes (slower, same rows)
        rows = imported_rows(spec)
    names = spec.root.partition(":")[2] + "".join(f", {key}.*: {ref.partition(':')[2]}" for key, ref in spec.sections)
    kw = max(len(r[0]) for r in rows) + 2
    tw = max(len(r[1]) for r in rows) + 2
    lines = [
        f"config fields ({names}): set them in the --config YAML or as trailing key=value",
        "(nested keys with dots, lists as a,b or [a,b]); a --config file overrides these defaults:",
        "",
        f"  {'key':<{kw}}{'type':<{tw}}default",
    ]
    for key, tp, default, text in rows:
        lines.append(f"  {key:<{kw}}{tp:<{tw}}{_show(default)}")
        lines += textwrap.wrap(text, width=DESCRIPTION_WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6)
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
