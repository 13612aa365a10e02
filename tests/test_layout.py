"""The layout rules of "One home for each job": adapters stay thin and use each other's public names only.

* no ``pipelines/`` module imports another ``pipelines/`` module's private (``_``-prefixed) names, nor
  reaches them through an imported module (``dump._x``);
* ``pipelines/train.py`` is the Ray Train adapter alone (<= 300 lines: the run set-up is ``specdraft.run``)
  and ``benchmarks/train_quality.py`` measures, it does not re-implement the set-up (<= 300 lines);
* no benchmark edits ``sys.path``: each runs from a clean checkout as ``python -m benchmarks.NAME``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def private_uses(path: Path) -> list[str]:
    """``module:name`` of every private name of another ``pipelines`` module that ``path`` uses."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = f"pipelines.{path.stem}"
    modules: dict[str, str] = {}  # local alias -> pipelines module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if node.module == "pipelines":
                    modules[alias.asname or alias.name] = f"pipelines.{alias.name}"
                elif node.module.startswith("pipelines.") and node.module != own and alias.name.startswith("_"):
                    found.append(f"{node.module}:{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pipelines.") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and modules.get(node.value.id, own) != own):
            found.append(f"{modules[node.value.id]}:{node.attr}")
    return found


def test_no_pipelines_module_uses_another_ones_private_names():
    offenders = [f"{p.relative_to(ROOT)} uses {name}" for p in sorted((ROOT / "pipelines").glob("*.py"))
                 for name in private_uses(p)]
    assert not offenders, "private names used across pipelines modules:\n" + "\n".join(offenders)


@pytest.mark.parametrize("path", ["pipelines/train.py", "benchmarks/train_quality.py"])
def test_thin_modules_stay_thin(path):
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= 300, f"{path} has {lines} lines (at most 300): the run set-up belongs in specdraft.run"


def test_no_benchmark_edits_sys_path():
    offenders = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "benchmarks run as `python -m benchmarks.NAME`, without sys.path edits: " + ", ".join(offenders)
