"""Every shipped run config loads into the typed schema (unknown keys are errors)."""

from pathlib import Path

import pytest

from pipelines.stages import RunConfig
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
