"""Stage functions outside the flow: prepare resolves the toy target from the shipped prebuilt build."""

from __future__ import annotations

from pathlib import Path

import pytest

import specdraft.toy.build as build_mod
from pipelines.stages import DataSection, RunConfig, TargetSection, prepare
from specdraft.toy.build import compare_with_prebuilt

ROOT = Path(__file__).resolve().parents[2]


def test_prepare_copies_the_prebuilt_toy_target_and_trains_when_asked(monkeypatch, tmp_path):
    def train(*args, **kwargs):
        raise AssertionError("trained the default toy target instead of copying the prebuilt one")

    monkeypatch.setattr(build_mod, "_build_into", train)
    cfg = RunConfig(workdir=str(tmp_path), data=DataSection(prompts=[str(ROOT / "configs/data/toy_prompts.jsonl")]))
    prepared = prepare(cfg)
    assert Path(prepared["target"]).parent == tmp_path / "targets"
    diff = compare_with_prebuilt(prepared["target"])
    assert all(diff["identical_files"].values()) and diff["max_abs_weight_diff"] == 0.0

    class Trains(Exception):
        pass

    def trains(*args, **kwargs):
        raise Trains

    monkeypatch.setattr(build_mod, "_build_into", trains)
    with pytest.raises(Trains):  # target.prebuilt=false: trained here
        prepare(RunConfig(workdir=str(tmp_path / "b"), target=TargetSection(prebuilt=False), data=cfg.data))
