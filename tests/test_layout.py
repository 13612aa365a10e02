"""The layout rules of "One home for each job": adapters stay thin and use each other's public names only.

* no ``pipelines/`` module imports another ``pipelines/`` module's private (``_``-prefixed) names, nor
  reaches them through an imported module (``dump._x``);
* ``pipelines/train.py`` is the Ray Train adapter alone (<= 300 lines: the run set-up is ``specdraft.run``)
  and ``benchmarks/train_quality.py`` measures, it does not re-implement the set-up (<= 300 lines);
* no benchmark edits ``sys.path``: each runs from a clean checkout as ``python -m benchmarks.NAME``;
* no public function or class name is defined in two product modules (``specdraft``, ``pipelines``, ``flows``)
  unless both do the same job (``SAME_JOB``: a thin adapter and what it adapts, or one interface twice).
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


PRODUCT = ("specdraft", "pipelines", "flows")
SAME_JOB = {  # name -> why the modules defining it do one job
    "evaluate": "flows.commands: the eval command over pipelines.evaluate",
    "regenerate": "flows.commands: the regenerate command over pipelines.regenerate",
    "train": "flows.commands: the train command; pipelines.stages: the flow's train stage — both run_training",
    "rollback": "flows.commands: the rollback command over specdraft.freshness.handoff",
    "feature_plan": "pipelines.train: specdraft.run's, online conversations read as the Ray adapter reads them",
    "main": "each program's entry point",
    "generate_conversation": "specdraft.toy: one generator interface, two corpora",
    "generate_conversations": "specdraft.toy: one generator interface, two corpora",
    "generate_prompts": "specdraft.toy: one generator interface, two corpora",
    "remove": "specdraft.store.location: specdraft.files' local job, or the same at an object-store URL",
    "write_bytes": "specdraft.store.location: specdraft.files' local job, or the same at an object-store URL",
    "write_directory": "specdraft.store.location: specdraft.files' local job, or the same at an object-store URL",
    "write_text": "specdraft.store.location: specdraft.files' local job, or the same at an object-store URL",
}


def public_definitions() -> dict[str, list[str]]:
    """Public top-level function and class name -> the product modules defining it."""
    found: dict[str, list[str]] = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.parse(path.read_text(), filename=str(path)).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name[0] != "_":
                    found.setdefault(node.name, []).append(module)
    return found


def test_a_public_name_says_one_thing():
    twice = {name: modules for name, modules in public_definitions().items() if len(modules) > 1}
    assert "load_target_config" in public_definitions() and "write_text" in twice, "the walk reads definitions"
    unexplained = [f"{name}: {', '.join(modules)}" for name, modules in sorted(twice.items()) if name not in SAME_JOB]
    assert not unexplained, "defined in two product modules for different jobs (rename one):\n" + "\n".join(unexplained)
    stale = sorted(set(SAME_JOB) - set(twice))
    assert not stale, f"SAME_JOB names no longer defined twice: {stale}"
