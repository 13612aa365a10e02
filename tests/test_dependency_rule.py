"""The dependency rule: flows -> pipelines -> specdraft, and specdraft stays pure torch.

The import graph of ``specdraft``, ``pipelines`` and ``flows`` (top-level and in-function imports alike,
as ``python3 ../shared/tools/import_graph.py`` reads it) has no circle and no upward arrow. Layers, bottom up
(a module may import its own layer and the layers below it, never one above):

0. the settings: ``specdraft.config`` (loading, ``ConfigError``) and ``specdraft.configs`` (the settings dataclasses
   and the recipe table) — they import each other and nothing else of the project;
1. ``specdraft.serving`` — the vLLM plugin and its model classes (vLLM loads them; they import no other
   specdraft code) and the engine measurement's settings;
2. the core — every other ``specdraft`` module: models, target, features, store, training, export, ...;
3. ``specdraft.decoding`` — the decoding algorithms (chains, trees, verification, prompt lookup, metrics)
   and the evaluation's settings;
4. ``specdraft.evaluation`` — questions, per-question records, baselines, replicas, report, engine measurement;
5. ``pipelines`` — the Ray / MLflow adapters;
6. ``flows`` — the CLI and the Prefect flows.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "specdraft": {"prefect", "ray", "mlflow", "pipelines", "flows"},
    "pipelines": {"prefect", "flows"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def import_graph(packages=("specdraft", "pipelines", "flows")) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file), for ``packages``."""
    modules = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                parts = base.split(".")
                root = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
                mod = ".".join(x for x in (root, node.module or "") if x)
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            graph[module] |= {r for r in map(resolve, targets) if r and r != module}
    return graph


LAYERS = (("specdraft.config", "specdraft.configs"), "specdraft.serving", "specdraft", "specdraft.decoding",
          "specdraft.evaluation", "pipelines", "flows")  # bottom up: see the module docstring


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest name that is ``module`` or a package above it (an entry of several
    names: packages on one floor)."""
    found = [(len(name), i) for i, entry in enumerate(LAYERS) for name in ((entry,) if isinstance(entry, str) else entry)
             if module == name or module.startswith(name + ".")]
    return max(found)[1]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (a package with only its own children aside:
    an ``__init__`` that re-exports its modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [c for c in found if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if layer(b) > layer(a) and not b.startswith(a + "."))  # a package's __init__ re-exporting


def test_the_import_graph_has_no_circle_and_no_upward_arrow():
    graph = import_graph()
    assert len(graph) > 50 and "specdraft.evaluation.run" in graph["pipelines.evaluate"], "the graph reads imports"
    assert not circles(graph), circles(graph)
    assert not upward_arrows(graph), "\n".join(upward_arrows(graph))


def test_the_graph_checks_catch_circles_and_upward_arrows():
    assert layer("specdraft.decoding.tree") == 3 and layer("specdraft.target") == 2 and layer("flows.cli") == 6
    assert layer("specdraft.serving.vllm_models") == 1 and layer("specdraft.config") == 0
    assert layer("specdraft.configs") == layer("specdraft.configs.train") == 0 and layer("specdraft.plan") == 2
    graph = {"specdraft.decoding.tree": {"specdraft.evaluation.run"}, "specdraft.evaluation.run": {"specdraft.decoding.tree"},
             "specdraft.decoding": {"specdraft.decoding.tree"}, "specdraft.target": {"pipelines.stages"},
             "pipelines.stages": set(), "specdraft.configs.train": {"specdraft.config", "specdraft.configs.recipes",
                                                                    "specdraft.plan"},
             "specdraft.config": set(), "specdraft.configs.recipes": set(), "specdraft.plan": set()}
    assert circles(graph) == [["specdraft.decoding.tree", "specdraft.evaluation.run"]]
    assert upward_arrows(graph) == ["specdraft.configs.train -> specdraft.plan",
                                    "specdraft.decoding.tree -> specdraft.evaluation.run",
                                    "specdraft.target -> pipelines.stages"]


def test_layers_import_only_downwards():
    offenders = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            bad = imported_modules(path) & forbidden
            if bad:
                offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "dependency rule broken:\n" + "\n".join(offenders)


def test_zarr_only_in_the_store():
    users = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "specdraft").rglob("*.py")
        if "zarr" in imported_modules(p)
    ]
    assert users and all(u.startswith("specdraft/store/") for u in users), users


def test_fsspec_only_in_the_store_location():
    """Object-store URLs go through one seam (``specdraft/store/location.py``), also for pipelines."""
    users = [
        p.relative_to(ROOT).as_posix()
        for package in ("specdraft", "pipelines", "flows")
        for p in (ROOT / package).rglob("*.py")
        if {"fsspec", "s3fs"} & imported_modules(p)
    ]
    assert users == ["specdraft/store/location.py"], users


def test_the_store_imports_no_training_code():
    """Storage sits below training: importing every store module loads neither the objectives nor the
    training loop (nor the draft models)."""
    modules = ["specdraft.store", "specdraft.store.location", "specdraft.store.schema", "specdraft.store.writer",
               "specdraft.store.manifest", "specdraft.store.reader"]
    probe = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
             + "print(json.dumps(sorted(m for m in sys.modules if m.startswith('specdraft'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    loaded = set(json.loads(out))
    assert "specdraft.store.reader" in loaded and "specdraft.batch" in loaded, loaded
    training = {"specdraft.objectives", "specdraft.training", "specdraft.losses", "specdraft.models"}
    assert not loaded & training, sorted(loaded & training)


def test_the_rule_checker_sees_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import ray.data\nfrom prefect import flow\nfrom .local import x\n")
    assert imported_modules(probe) == {"ray", "prefect"}


ENGINE_PROCESS = "specdraft/evaluation/engine_process.py"


def test_vllm_only_in_the_serving_side():
    """In the core, vLLM is imported by ``specdraft/serving/`` (the plugin vLLM loads) and the engine process
    of the engine measurement alone, and there only inside functions, in the model module vLLM itself imports
    or in the engine process's entry point (``python -m``, imported by nothing): importing specdraft never
    imports vLLM. (``pipelines/`` may adapt it, as regenerate's vllm replicas do.)"""
    users = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "specdraft").rglob("*.py")
                   if "vllm" in imported_modules(p))
    assert users and all(u.startswith("specdraft/serving/") or u == ENGINE_PROCESS for u in users), users
    importers = [m for m, targets in import_graph().items() if "specdraft.evaluation.engine_process" in targets]
    assert not importers, importers
    top_level = [u for u in users if "vllm" in {
        (n.names[0].name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0]
        for n in ast.parse((ROOT / u).read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))}]
    assert top_level == [ENGINE_PROCESS, "specdraft/serving/vllm_models.py"], top_level


def test_the_freshness_package_loads_neither_torch_nor_zarr():
    """The traffic reader and the freshness decisions read JSON lines and numbers: importing every module of
    ``specdraft.freshness`` (the traffic reader reaches ``specdraft.store.location``) loads neither torch nor zarr,
    while the store's reader does load them (the probe can fail)."""
    modules = sorted(f"specdraft.freshness.{p.stem}" for p in (ROOT / "specdraft" / "freshness").glob("*.py"))
    probe = ("import json, sys\n" + "".join(f"import {m}\n" for m in modules)
             + "light = sorted(m for m in ('torch', 'zarr') if m in sys.modules)\n"
             + "import specdraft.store.reader\n"
             + "print(json.dumps([light, sorted(m for m in ('torch', 'zarr') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout
    light, heavy = json.loads(out)
    assert "specdraft.freshness.traffic" in modules and len(modules) >= 8, modules
    assert light == [] and heavy == ["torch", "zarr"], (light, heavy)
