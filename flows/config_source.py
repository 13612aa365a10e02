"""The config fields a command's ``--help`` lists, read from the dataclasses' source files (issue 23, item 7).

A command's ``--help`` lists every field of its config tree — dotted key, type, default and what the field
means. The description is the comment the field is written with, the one source of truth: the comment
after the field on its line, else the block of comment lines directly above it (``field_comments``).

``--help`` must answer at once, and the modules that define the config dataclasses import torch,
transformers, Ray, MLflow or Prefect at their top (seconds to tens of seconds on a loaded machine). So
``static_rows`` reads the fields without importing anything: it parses each module with ``ast``, follows
the names a class uses through the module's own definitions and imports (type aliases, constants, nested
dataclasses, ``field(default_factory=...)``), and evaluates the literal defaults. It understands the
forms the configs use; anything else raises ``Unsupported`` and the caller falls back to importing the
classes (``flows.options.field_rows``, slow but exact). ``tests/flows/test_help.py`` checks that both
give the same rows for every command, so the fallback is never needed there.

A field whose ``metadata`` has ``"hidden": True`` (a test hook such as ``fault.train_fail_at_step``) is
still a valid key but is left out of the help.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import operator
import tokenize
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

HIDDEN = "hidden"  # field(metadata={"hidden": True}): a valid key left out of --help (test hooks)
REQUIRED = object()  # the default of a field without one
BUILTIN_TYPES = ("int", "float", "str", "bool", "bytes", "list", "dict", "tuple", "set", "frozenset", "object")
FACTORIES = {"list": list, "dict": dict, "tuple": tuple, "set": set}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.Mod: operator.mod}


class Unsupported(Exception):
    """A form in a config class's source this reader does not evaluate (the caller imports the class instead)."""


@dataclass(frozen=True)
class ClassRef:
    module: str
    name: str


@dataclass(frozen=True)
class Instance:
    """A dataclass value: its class and the keyword arguments it was built with (the rest are defaults)."""

    cls: ClassRef
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Field:
    name: str
    annotation: ast.expr
    default: Any  # a value, an Instance, or REQUIRED
    hidden: bool
    description: str


# --- source files and names --------------------------------------------------------------------------------


@cache
def module_file(module: str) -> Path:
    """The source file of ``module``, found without importing it or its parent packages."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)  # locates the top package; does not run it
    if spec is None or not spec.submodule_search_locations:
        raise Unsupported(f"{module}: not a module of a package found on sys.path")
    base = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise Unsupported(f"{module}: no source file at {base}")


@cache
def _module(module: str) -> tuple[Path, ast.Module, dict[str, ast.AST]]:
    """(file, tree, top-level name -> its class, assignment or import) of ``module``."""
    path = module_file(module)
    tree = ast.parse(path.read_text(), str(path))
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            names[node.target.id] = node.value
        elif isinstance(node, ast.ImportFrom):
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(max(0, node.level - 1)):
                package = package.rpartition(".")[0]
            source = ".".join(p for p in (package if node.level else "", node.module or "") if p)
            for alias in node.names:
                names[alias.asname or alias.name] = ast.ImportFrom(module=source, names=[alias], level=0)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = node
    return path, tree, names


def _lookup(module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """(defining module, node) of a top-level ``name`` of ``module``, followed through ``from X import``."""
    if depth > 20:
        raise Unsupported(f"{module}.{name}: import chain too long")
    node = _module(module)[2].get(name)
    if isinstance(node, ast.ImportFrom):
        source, original = node.module, node.names[0].name
        if source.split(".")[0] in ("typing", "typing_extensions", "dataclasses", "__future__"):
            return source, node
        try:
            found = _lookup(source, original, depth + 1)
        except Unsupported:
            return source, node
        if found is None:  # a submodule imported from its package: ``from specdraft import files``
            return source, node
        return found
    return (module, node) if node is not None else None


@cache
def _comments(path: Path) -> tuple[dict[int, str], frozenset[int]]:
    """(line -> comment text, the lines that hold only a comment) of a source file."""
    comments: dict[int, str] = {}
    whole_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                whole_line.add(tok.start[0])
    return comments, frozenset(whole_line)


def field_comments(path: Path, fields: list[ast.AnnAssign]) -> dict[int, str]:
    """Line of a field -> its description: the comment after it on its line, else the comment lines
    directly above it (with no blank line between)."""
    comments, whole_line = _comments(path)
    out: dict[int, str] = {}
    for node in fields:
        line = node.lineno
        trailing = next((comments[n] for n in range(line, (node.end_lineno or line) + 1)
                         if n in comments and n not in whole_line), None)
        if trailing is not None:
            out[line] = trailing
            continue
        above, n = [], line - 1
        while n in whole_line:
            above.insert(0, comments[n])
            n -= 1
        if above:
            out[line] = " ".join(above)
    return out


@cache
def class_descriptions(module: str, name: str) -> dict[str, str]:
    """Field name -> description (its comment) of the class ``name`` defined at the top of ``module``."""
    path, tree, _ = _module(module)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        return {}
    fields = [n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    lines = field_comments(path, fields)
    return {n.target.id: lines[n.lineno] for n in fields if n.lineno in lines}


# --- values --------------------------------------------------------------------------------------------


def _where(module: str, node: ast.AST) -> str:
    return f"{module_file(module)}:{getattr(node, 'lineno', '?')}"


def evaluate(module: str, node: ast.expr) -> Any:
    """The value of a default's expression: literals, arithmetic, module constants (followed through
    imports), dataclass calls (an ``Instance``), ``list``/``dict``/... factories and ``lambda: ...``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [evaluate(module, e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise Unsupported(f"{_where(module, node)}: ** in a dict default")
        return {evaluate(module, k): evaluate(module, v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = evaluate(module, node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        return BINARY[type(node.op)](evaluate(module, node.left), evaluate(module, node.right))
    if isinstance(node, ast.Lambda) and not node.args.args:
        return evaluate(module, node.body)
    if isinstance(node, ast.Name):
        return _name_value(module, node)
    if isinstance(node, ast.Call) and not node.args:
        func = evaluate(module, node.func) if isinstance(node.func, ast.Name) else None
        kwargs = {k.arg: evaluate(module, k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords):
            raise Unsupported(f"{_where(module, node)}: ** in a call")
        if isinstance(func, ClassRef):
            return Instance(func, kwargs)
        if func in FACTORIES.values() and not kwargs:
            return func()
    raise Unsupported(f"{_where(module, node)}: cannot evaluate {ast.unparse(node)!r} without running it")


def _name_value(module: str, node: ast.Name) -> Any:
    found = _lookup(module, node.id)
    if found is None:
        if node.id in FACTORIES:
            return FACTORIES[node.id]
        raise Unsupported(f"{_where(module, node)}: unknown name {node.id!r}")
    source, definition = found
    if isinstance(definition, ast.ClassDef):
        if not _is_dataclass(definition):
            raise Unsupported(f"{_where(source, definition)}: {definition.name} is not a dataclass")
        return ClassRef(source, definition.name)
    if isinstance(definition, ast.expr):
        return evaluate(source, definition)
    raise Unsupported(f"{_where(module, node)}: {node.id!r} comes from {source}, which is not read")


def _is_dataclass(node: ast.ClassDef) -> bool:
    def name(d: ast.expr) -> str:
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")

    return any(name(d) == "dataclass" for d in node.decorator_list)


# --- classes and fields ----------------------------------------------------------------------------------


@cache
def class_fields(cls: ClassRef) -> tuple[Field, ...]:
    """The init fields of dataclass ``cls`` in order (base classes' first), with their defaults."""
    found = _lookup(cls.module, cls.name)
    if found is None or not isinstance(found[1], ast.ClassDef) or not _is_dataclass(found[1]):
        raise Unsupported(f"{cls.module}:{cls.name}: not a dataclass defined in that module's source")
    module, node = found
    out: dict[str, Field] = {}
    for base in node.bases:
        value = evaluate(module, base)
        if not isinstance(value, ClassRef):
            raise Unsupported(f"{_where(module, node)}: base {ast.unparse(base)!r} is not a dataclass")
        out.update((f.name, f) for f in class_fields(value))
    nodes = [n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    described = class_descriptions(module, node.name)
    for n in nodes:
        if "ClassVar" in ast.unparse(n.annotation):
            continue
        default, hidden, init = _field_default(module, n.value)
        if init:
            out[n.target.id] = Field(n.target.id, n.annotation, default, hidden, described.get(n.target.id, ""))
        else:
            out.pop(n.target.id, None)
    return tuple(out.values())


def _field_default(module: str, value: ast.expr | None) -> tuple[Any, bool, bool]:
    """(default, hidden, init) of a field's right-hand side."""
    if value is None:
        return REQUIRED, False, True
    func = value.func if isinstance(value, ast.Call) else None
    is_field = (isinstance(func, ast.Name) and func.id == "field") or (
        isinstance(func, ast.Attribute) and func.attr == "field")
    if not is_field:
        return evaluate(module, value), False, True
    kw = {k.arg: k.value for k in value.keywords}
    metadata = evaluate(module, kw["metadata"]) if "metadata" in kw else {}
    init = evaluate(module, kw["init"]) if "init" in kw else True
    if "default" in kw:
        default = evaluate(module, kw["default"])
    elif "default_factory" in kw:
        factory = evaluate(module, kw["default_factory"])
        default = Instance(factory) if isinstance(factory, ClassRef) else (
            factory() if callable(factory) else factory)  # a lambda's body is its value already
    else:
        default = REQUIRED
    return default, bool(metadata.get(HIDDEN)), bool(init)


# --- types -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TypeInfo:
    """A field's annotation, as the help shows it and as far as nesting goes."""

    text: str  # "int | None", "chain|tree", "list[int]"
    dataclass: ClassRef | None = None  # the annotation is this dataclass: its fields are listed as key.*
    item: tuple[ClassRef, str] | None = None  # X | None -> (X, "."), list[X] -> (X, "[].")
    union: tuple[TypeInfo, ...] = ()  # the members of a union (flattened)


def type_info(module: str, node: ast.expr) -> TypeInfo:
    """Render an annotation as ``flows.options.type_name`` renders the imported type."""
    if isinstance(node, ast.Constant):
        if node.value is None:
            return TypeInfo("None")
        if node.value is Ellipsis:
            return TypeInfo("...")
        if isinstance(node.value, str):  # a quoted annotation
            return type_info(module, ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union(type_info(module, node.left), type_info(module, node.right))
    if isinstance(node, ast.Subscript):
        head = _name_of(node.value)
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Literal":
            return TypeInfo("|".join(str(evaluate(module, a)) for a in args))
        if head in ("Optional", "Union"):
            members = [type_info(module, a) for a in args] + ([TypeInfo("None")] if head == "Optional" else [])
            return _union(*members)
        if head in BUILTIN_TYPES or head in ("List", "Dict", "Tuple", "Set"):
            inner = [type_info(module, a) for a in args]
            item = inner[0].dataclass if head in ("list", "tuple", "List", "Tuple") and inner else None
            return TypeInfo(f"{head.lower()}[{', '.join(i.text for i in inner)}]",
                            item=(item, "[].") if item else None)
        raise Unsupported(f"{_where(module, node)}: annotation {ast.unparse(node)!r}")
    name = _name_of(node)
    if name in BUILTIN_TYPES or name == "Any":
        return TypeInfo(name)
    if name == "NoneType":
        return TypeInfo("None")
    found = _lookup(module, name) if isinstance(node, ast.Name) else None
    if found is not None:
        source, definition = found
        if isinstance(definition, ast.ClassDef) and _is_dataclass(definition):
            return TypeInfo(definition.name, dataclass=ClassRef(source, definition.name))
        if isinstance(definition, ast.expr):  # a type alias: ``Mode = Literal["chain", "tree"]``
            return type_info(source, definition)
    raise Unsupported(f"{_where(module, node)}: annotation {ast.unparse(node)!r}")


def _name_of(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _union(*members: TypeInfo) -> TypeInfo:
    flat: list[TypeInfo] = []
    for m in members:
        for part in m.union or (m,):
            if part.text not in [f.text for f in flat]:
                flat.append(part)
    item = next(((m.dataclass, ".") for m in flat if m.dataclass), None) or next(
        (m.item for m in flat if m.item), None)
    return TypeInfo(" | ".join(m.text for m in flat), item=item, union=tuple(flat))


# --- rows ----------------------------------------------------------------------------------------------------


def instance_fields(value: Instance) -> dict[str, Any]:
    """Every init field of a dataclass value: its keyword arguments over the class defaults."""
    return {f.name: value.kwargs.get(f.name, f.default) for f in class_fields(value.cls)}


def plain(value: Any) -> Any:
    """A value as ``specdraft.config.to_dict`` gives it (dataclass values as dicts, tuples as lists)."""
    if isinstance(value, Instance):
        return {k: plain(v) for k, v in instance_fields(value).items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def apply(value: Any, overrides: dict[str, Any]) -> Any:
    """``value`` (an Instance) with nested ``overrides`` (parsed ``key=value``) set."""
    if not overrides:
        return value
    assert isinstance(value, Instance), f"overrides {overrides} on a value that is not a dataclass"
    kwargs = dict(value.kwargs)
    current = instance_fields(value)
    for key, update in overrides.items():
        if isinstance(update, dict) and isinstance(current.get(key), Instance):
            kwargs[key] = apply(current[key], update)
        else:
            kwargs[key] = update
    return Instance(value.cls, kwargs)


def static_rows(ref: str, prefix: str = "", overrides: dict[str, Any] | None = None):
    """(dotted key, type, default value or REQUIRED, description) of every visible field under ``ref``
    (``"module:Class"``), nested dataclasses flattened, defaults with ``overrides`` applied."""
    module, _, name = ref.partition(":")
    cls = ClassRef(module, name)
    yield from _rows(cls, prefix, apply(Instance(cls), overrides or {}))


def _rows(cls: ClassRef, prefix: str, value: Instance | None):
    values = instance_fields(value) if value is not None else None
    for f in class_fields(cls):
        if f.hidden:
            continue
        info = type_info(cls.module, f.annotation)
        key = prefix + f.name
        default = values[f.name] if values is not None else f.default
        if info.dataclass is not None:
            yield from _rows(info.dataclass, key + ".", default if isinstance(default, Instance) else None)
            continue
        yield key, info.text, plain(default) if default is not REQUIRED else REQUIRED, f.description
        if info.item is not None:
            yield from _rows(info.item[0], key + info.item[1], None)
