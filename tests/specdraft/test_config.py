"""The config loader: typed, frozen, unknown keys rejected, key=value overrides."""

from dataclasses import FrozenInstanceError, dataclass, field
from typing import Literal

import pytest

from specdraft.config import ConfigError, config_hash, flatten, from_dict, load, parse_overrides
from specdraft.configs.stages import StageConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Inner:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


@dataclass(frozen=True, kw_only=True, slots=True)
class Outer:
    name: str = "x"
    arch: Literal["beagle", "eagle"] = "beagle"
    inner: Inner = field(default_factory=Inner)
    stages: list[StageConfig] = field(default_factory=list)
    limit: int | None = None


def test_yaml_plus_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\ninner:\n  lr: 0.01\nstages:\n  - kind: early\n    window: 3\n")
    cfg = load(Outer, path, ["inner.betas=[0.8, 0.9]", "arch=eagle", "limit=7"])
    assert cfg.name == "run" and cfg.arch == "eagle" and cfg.limit == 7
    assert cfg.inner == Inner(lr=0.01, betas=(0.8, 0.9))
    assert cfg.stages == [StageConfig(kind="early", window=3)]
    with pytest.raises(FrozenInstanceError):
        cfg.name = "y"


def test_unknown_keys_and_bad_types_are_errors():
    with pytest.raises(ConfigError, match="unknown key.*'lrr'"):
        from_dict(Outer, {"inner": {"lrr": 1}})
    with pytest.raises(ConfigError, match="not one of"):
        from_dict(Outer, {"arch": "medusa"})
    with pytest.raises(ConfigError, match="expected a number"):
        from_dict(Outer, {"inner": {"lr": "fast"}})
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["nonsense"])


def test_a_list_is_given_as_a_b_or_brackets_or_one_item():
    @dataclass(frozen=True, kw_only=True, slots=True)
    class Lists:
        epochs: list[int] | None = None
        paths: list[str] = field(default_factory=list)

    for given, want in (("epochs=1,2", [1, 2]), ("epochs=[1, 2]", [1, 2]), ("epochs=3", [3]), ("epochs=[3]", [3])):
        assert load(Lists, None, [given]).epochs == want, given
    assert load(Lists, None, ["paths=a.jsonl"]).paths == ["a.jsonl"]
    assert load(Lists, None, ["paths=a.jsonl,b.jsonl"]).paths == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ConfigError, match="expected 2 items"):
        from_dict(Outer, {"inner": {"betas": 0.9}})
    with pytest.raises(ConfigError, match="expected a list"):
        from_dict(Lists, {"epochs": {"a": 1}})


def test_flatten_and_hash_are_stable():
    cfg = Outer(inner=Inner(lr=0.5))
    flat = flatten(cfg)
    assert flat["inner.lr"] == 0.5 and flat["arch"] == "beagle"
    assert config_hash(cfg) == config_hash(Outer(inner=Inner(lr=0.5)))
    assert config_hash(cfg) != config_hash(Outer(inner=Inner(lr=0.25)))


def test_nested_override_keeps_the_fields_own_default():
    """Overriding one key of a nested section starts from that field's default (its default_factory),
    not from the nested class's defaults (TrainConfig.reader is ReaderConfig(val_fraction=0.05))."""

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Section:
        a: int = 1
        b: float = 0.0

    @dataclass(frozen=True, kw_only=True, slots=True)
    class Root:
        section: Section = field(default_factory=lambda: Section(b=0.05))

    cfg = from_dict(Root, {"section": {"a": 7}})
    assert cfg.section == Section(a=7, b=0.05)
