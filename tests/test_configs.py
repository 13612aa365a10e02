"""Every shipped run config loads into the typed schema (unknown keys are errors), and the settings import
nothing heavy (issue 30, item 1: ``specdraft/configs/``, ``pipelines/configs.py``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.configs import RunConfig
from specdraft.config import ConfigError, load

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path):
    cfg = load(RunConfig, path)
    arch, stages = cfg.train.resolved()
    assert stages and arch in ("beagle", "eagle")
    assert cfg.data.prompts and cfg.eval.questions


def test_toy_config_points_at_shipped_files():
    root = Path(__file__).resolve().parents[1]
    cfg = load(RunConfig, root / "configs" / "toy.yaml")
    assert all((root / p).is_file() for p in cfg.data.prompts + cfg.eval.questions)
    assert cfg.target.path == "" and cfg.ray.address is None


def test_unknown_key_in_a_run_config_is_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  recipee: beagle\n")
    with pytest.raises(ConfigError, match="recipee"):
        load(RunConfig, bad)
    with pytest.raises(ConfigError, match="not one of"):
        load(RunConfig, None, ["train.scaling.strategy=zero3"])


SETTINGS_MODULES = ["specdraft.configs", "specdraft.config", "specdraft.plan", "pipelines.configs",
                    *(f"specdraft.configs.{p.stem}" for p in sorted(
                        (Path(__file__).resolve().parents[1] / "specdraft" / "configs").glob("[!_]*.py")))]
HEAVY = ("torch", "ray", "zarr", "transformers", "mlflow", "prefect", "numpy")


@pytest.mark.parametrize("module", SETTINGS_MODULES)
def test_importing_the_settings_loads_no_torch_ray_or_zarr(module):
    """Each settings module, imported alone in a fresh interpreter, leaves every heavy library unloaded."""
    script = (f"import importlib, json, sys; importlib.import_module({module!r}); "
              f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_every_settings_dataclass_lives_in_a_settings_module():
    """No ``*Config`` / ``*Settings`` dataclass is defined outside ``specdraft/configs/`` and ``pipelines/configs.py``
    (the ones the core hands between its own functions are not settings: ``WorkerConfig`` is the driver's message)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    homes = {root / "pipelines" / "configs.py", *(root / "specdraft" / "configs").glob("*.py")}
    stray = []
    for path in sorted(p for d in ("specdraft", "pipelines", "flows") for p in (root / d).rglob("*.py")):
        if path in homes:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ClassDef) and node.name.endswith(("Config", "Settings", "Section"))
                    and node.name not in ("WorkerConfig", "BoundTorchConfig")  # a message; Ray's backend hook
                    and any("dataclass" in ast.unparse(d) for d in node.decorator_list)):
                stray.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    assert stray == []


def settings_homes(root: Path) -> dict[str, str]:
    """Settings class -> the module that defines it (``specdraft/configs/*.py``, ``pipelines/configs.py``)."""
    import ast

    paths = [*sorted((root / "specdraft" / "configs").glob("[!_]*.py")), root / "pipelines" / "configs.py"]
    return {node.name: ".".join(path.relative_to(root).with_suffix("").parts)
            for path in paths for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}


def second_addresses(source: str, homes: dict[str, str]) -> list[str]:
    """``module.Name`` for each settings class ``source`` imports from a project module other than its home."""
    import ast

    return [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in ("specdraft", "pipelines", "flows")
            for alias in node.names if alias.name in homes and homes[alias.name] != node.module]


def test_every_settings_class_has_one_import_address_and_no_shim_re_exports_one():
    root = Path(__file__).resolve().parents[1]
    homes = settings_homes(root)
    assert homes["TrainConfig"] == "specdraft.configs.train" and homes["RunConfig"] == "pipelines.configs"
    assert second_addresses("from specdraft.store import ReaderConfig\nfrom specdraft.configs.reader import "
                            "ReaderConfig\ndef f():\n    from specdraft.models import DraftConfig\n", homes) == [
        "specdraft.store.ReaderConfig", "specdraft.models.DraftConfig"]  # the check sees both, in functions too
    stray, shims = [], []
    for path in sorted(p for d in ("specdraft", "pipelines", "flows", "benchmarks", "tests") for p in (root / d).rglob("*.py")):
        text = path.read_text()
        stray += [f"{path.relative_to(root)}: {a}" for a in second_addresses(text, homes)]
        if path.parts[len(root.parts)] != "tests":
            shims += [f"{path.relative_to(root)}:{i}" for i, line in enumerate(text.splitlines(), 1) if "noqa: F401" in line]
    assert stray == [] and shims == []
