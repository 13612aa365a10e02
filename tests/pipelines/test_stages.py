"""Stage functions outside the flow: prepare resolves the toy target from the shipped prebuilt build;
the train stage with online features trains on the regenerated conversations (no store), with the
run's ``features`` section as the online feature settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specdraft.toy.build as build_mod
from pipelines.conversations import write_conversations
from specdraft.features import FeaturesConfig
from pipelines.stages import DataSection, RunConfig, TargetSection, prepare, train
from specdraft.recipes import TrainConfig
from specdraft.store import ReaderConfig
from specdraft.target import target_id
from specdraft.toy.build import compare_with_prebuilt
from specdraft.toy.conversations import generate_conversations

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


@pytest.mark.slow
def test_train_stage_with_online_features_reads_the_regenerated_conversations(local_ray, tiny_toy_target, tmp_path):
    regenerated = []
    for part in range(2):  # two prompt files, two regenerate outputs
        rows = [{"id": f"p{part}-{i}", "source": f"p{part}", "messages": m}
                for i, m in enumerate(generate_conversations(12, seed=part))]
        out = tmp_path / "regenerate" / f"key{part}"
        write_conversations(out / "part-00000.parquet", rows)
        regenerated.append({"key": f"key{part}", "conversations": str(out)})
    cfg = RunConfig(workdir=str(tmp_path / "runs"), features=FeaturesConfig(max_length=80, topk=4),
                    train=TrainConfig(recipe="beagle-early", epochs=[1], features="online", min_steps=1,
                                      checkpoint_every=0, val_max_batches=1,
                                      reader=ReaderConfig(max_tokens=1024, val_fraction=0.2)))
    prepared = {"target": str(tiny_toy_target), "target_id": target_id(tiny_toy_target)}

    record = train(cfg, prepared, regenerated)
    assert not record["skipped"] and (Path(record["draft"]) / "model.safetensors").is_file()
    params = json.loads(Path(record["metrics_file"]).read_text().splitlines()[0])
    assert params["train.features"] == "online" and params["train.online.topk"] == 4  # the run's features section
    assert params["train.online.max_length"] == 80
    assert train(cfg, prepared, regenerated)["skipped"]  # same inputs: done
