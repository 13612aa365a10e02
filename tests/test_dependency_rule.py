"""The dependency rule: flows -> pipelines -> specdraft, and specdraft stays pure torch."""

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


def test_vllm_only_in_the_serving_side():
    """In the core, vLLM is imported by ``specdraft/serving/`` alone (the plugin vLLM loads, the engine
    measurement), and there only inside functions or in the model module vLLM itself imports: importing
    specdraft never imports vLLM. (``pipelines/`` may adapt it, as Ray Data's LLM processor.)"""
    users = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "specdraft").rglob("*.py")
                   if "vllm" in imported_modules(p))
    assert users and all(u.startswith("specdraft/serving/") for u in users), users
    top_level = [u for u in users if "vllm" in {
        (n.names[0].name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0]
        for n in ast.parse((ROOT / u).read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))}]
    assert top_level == ["specdraft/serving/vllm_models.py"], top_level
