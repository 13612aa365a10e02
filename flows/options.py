"""Command-line options generated from the config dataclasses: one source for the settings and their flags.

A config-bearing command is bound to a ``ConfigSpec``: its root dataclass, plus named
sections of other dataclasses (``eval``'s ``ray.*`` is ``RayEvalConfig``). The command
takes ``--config FILE`` (YAML) and trailing ``key=value`` overrides, both validated by
``specdraft.config`` (nested keys with dots, unknown keys are errors), and its ``--help``
lists every field of the tree — dotted key, type, default and the field's comment as its
description — so a field added there shows up here without an edit; a field with
``metadata={"hidden": True}`` (a test hook) is valid but not listed. The classes are the settings
themselves (``specdraft/configs/``, ``pipelines/configs.py``), which import no torch, Ray or MLflow, so
every ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specdraft.config import ConfigError, from_dict, merge, parse_overrides, to_dict

DESCRIPTION_WIDTH = 100  # columns of a field's description lines in --help
HIDDEN = "hidden"  # field(metadata={"hidden": True}): a valid key left out of --help (test hooks)
REQUIRED = object()  # the default of a field without one


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigSpec:
    """The config a command is bound to."""

    root: type  # the root dataclass
    sections: tuple[tuple[str, type], ...] = ()  # (key, dataclass): another dataclass under key.*
    defaults: tuple[str, ...] = ()  # key=value the command starts from, under --config and overrides

    def __post_init__(self) -> None:
        clash = sorted(dict(self.sections).keys() & {f.name for f in dataclasses.fields(self.root)})
        if clash:
            raise TypeError(f"{self.root.__name__} has field(s) {clash} that clash with the command's sections")


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
    root, sections = spec.root, dict(spec.sections)
    data = parse_overrides(spec.defaults)
    if path is not None:
        data = merge(data, _read(path))
    data = merge(data, parse_overrides(overrides))
    valid = sorted({f.name for f in dataclasses.fields(root) if f.init} | set(sections))
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"{root.__name__}: unknown key(s) {unknown}; valid keys are {valid}")
    parts = {key: from_dict(cls, data.pop(key, None), key) for key, cls in sections.items()}
    return from_dict(root, data), parts


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


def class_descriptions(cls: type) -> dict[str, str]:
    """Field name -> description of dataclass ``cls`` and its bases: the comment after a field on its line, else
    the block of comment lines directly above it (no blank line between)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(_comments_of(inspect.getsourcefile(klass), klass.__qualname__))
    return out


@functools.cache
def _comments_of(path: str | None, name: str) -> dict[str, str]:
    if path is None:
        return {}
    text = Path(path).read_text()
    node = next((n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        return {}
    comments: dict[int, str] = {}
    whole_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                whole_line.add(tok.start[0])
    out: dict[str, str] = {}
    for field in (n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)):
        line, last = field.lineno, field.end_lineno or field.lineno
        trailing = next((comments[n] for n in range(line, last + 1) if n in comments and n not in whole_line), None)
        above, n = [], line - 1
        while trailing is None and n in whole_line:
            above.insert(0, comments[n])
            n -= 1
        if trailing is not None or above:
            out[field.target.id] = trailing if trailing is not None else " ".join(above)
    return out


def field_rows(cls: type, prefix: str = "", instance: Any = None) -> Iterator[tuple[str, str, Any, str]]:
    """(dotted key, type, default, description) for every field of dataclass ``cls`` shown in ``--help``,
    nested ones flattened; a field with ``metadata={"hidden": True}`` (a test hook) is left out.

    Defaults come from ``instance`` when given (so a parent's ``default_factory`` shows), else
    from the field definitions; they are plain data (``to_dict``), or ``REQUIRED``.
    """
    hints = typing.get_type_hints(cls)
    described = class_descriptions(cls)
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


def rows(spec: ConfigSpec) -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, description) of every field ``describe`` lists: the command's defaults
    applied (a root with required fields shows the field definitions' defaults)."""
    try:
        config, parts = load_config(spec)
    except ConfigError:
        config, parts = None, {}
    out = list(field_rows(spec.root, "", config))
    for key, cls in spec.sections:
        out += field_rows(cls, key + ".", parts.get(key))
    return out


def describe(spec: ConfigSpec) -> str:
    """The help section listing every config field of the command, with its description."""
    table = rows(spec)
    names = spec.root.__name__ + "".join(f", {key}.*: {cls.__name__}" for key, cls in spec.sections)
    kw = max(len(r[0]) for r in table) + 2
    tw = max(len(r[1]) for r in table) + 2
    lines = [
        f"config fields ({names}): set them in the --config YAML or as trailing key=value",
        "(nested keys with dots, lists as a,b or [a,b]); a --config file overrides these defaults:",
        "",
        f"  {'key':<{kw}}{'type':<{tw}}default",
    ]
    for key, tp, default, text in table:
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


def command_config(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The config (and its sections) a parsed command line asks for: --config, sugar flags, then key=value.

    Raises ``specdraft.config.ConfigError`` for a bad key or value; runs nothing.
    """
    return load_config(args.config_spec, args.config, [*args.sugar(args), *args.overrides])
