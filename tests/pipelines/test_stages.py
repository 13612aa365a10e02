"""Stage functions outside the flow: prepare resolves the toy target from the shipped prebuilt build;
the stage records are frozen dataclasses whose dicts are the DONE files' and the flow's; the train stage
with online features trains on the regenerated conversations (no store), with the run's ``features``
section as the online feature settings, and a run config setting ``train.online`` is refused."""

from __future__ import annotations

import json
import pickle
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

import specdraft.toy.build as build_mod
from pipelines.conversations import write_conversations
from specdraft.configs.features import FeaturesConfig
from pipelines.records import Dumped, Evaluated, Exported, Prepared, Regenerated, Registered, Trained
from pipelines.configs import ClusterTrainConfig, DataSection, RunConfig, ScalingSection, TargetSection, core_features
from pipelines.stages import prepare, train, train_config
from specdraft.config import ConfigError, load
from specdraft.plan import reads_eagle3_features
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.identity import target_id
from specdraft.toy.build import compare_with_prebuilt
from specdraft.toy.conversations import generate_conversations

ROOT = Path(__file__).resolve().parents[2]


def test_prepare_copies_the_prebuilt_toy_target_and_trains_when_asked(monkeypatch, tmp_path):
    def train(*args, **kwargs):
        raise AssertionError("trained the default toy target instead of copying the prebuilt one")

    monkeypatch.setattr(build_mod, "_build_into", train)
    cfg = RunConfig(workdir=str(tmp_path), data=DataSection(prompts=[str(ROOT / "configs/data/toy_prompts.jsonl")]))
    prepared = prepare(cfg)
    assert Path(prepared.target).parent == tmp_path / "targets"
    assert [p.path for p in prepared.prompts] == [str((ROOT / "configs/data/toy_prompts.jsonl").resolve())]
    assert list(prepared.to_dict()) == ["target", "target_id", "prompts", "wall_s", "traffic"]
    assert list(prepared.to_dict()["prompts"][0]) == ["path", "digest", "reuse"]
    assert prepared.traffic is None and not prepared.prompts[0].reuse  # no data.traffic
    diff = compare_with_prebuilt(prepared.target)
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
        regenerated.append(Regenerated(key=f"key{part}", prompt=f"p{part}.jsonl", conversations=str(out), summary={},
                                       wall_s=0.0))
    cfg = RunConfig(workdir=str(tmp_path / "runs"), features=FeaturesConfig(max_length=80, topk=4),
                    train=ClusterTrainConfig(recipe="beagle-early", epochs=[1], features="online", min_steps=1,
                                      checkpoint_every=0, val_max_batches=1,
                                      reader=ReaderConfig(max_tokens=1024, val_fraction=0.2),
                                      # Ray Train's local mode (the loop in this process): online features in
                                      # Ray Train workers are tests/pipelines/test_train.py's
                                      scaling=ScalingSection(num_workers=0)))
    prepared = Prepared(target=str(tiny_toy_target), target_id=target_id(tiny_toy_target), prompts=[], wall_s=0.0)

    record = train(cfg, prepared, regenerated)
    assert not record.skipped and (Path(record.draft) / "model.safetensors").is_file()
    params = json.loads(Path(record.metrics_file).read_text().splitlines()[0])
    assert params["train.features"] == "online" and params["train.online.topk"] == 4  # the run's features section
    assert params["train.online.max_length"] == 80
    again = train(cfg, prepared, regenerated)  # same inputs: done, the record read back from its DONE file
    assert again.skipped and again == Trained.from_dict({**record.to_dict(), "skipped": True})
    done = json.loads((Path(cfg.workdir) / "train" / record.key / "DONE").read_text())
    assert done == json.loads(json.dumps({k: v for k, v in record.to_dict().items() if k != "skipped"}))


def test_the_default_recipe_reads_eagle3_features_the_run_computes_unless_its_features_name_layers():
    """``beagle3``, the default recipe, trains on EAGLE-3 features: a run whose features section names no
    auxiliary layers dumps (or computes online) the ``eagle3`` ones instead of failing at training; a list is
    kept, and a recipe without them computes none."""
    from pipelines.stages import run_features

    assert ClusterTrainConfig().recipe == "beagle3" and reads_eagle3_features(ClusterTrainConfig())
    assert run_features(RunConfig()).aux_layers == "eagle3"
    assert run_features(RunConfig(features=FeaturesConfig(aux_layers=[0, 2]))).aux_layers == [0, 2]
    assert run_features(RunConfig(train=ClusterTrainConfig(recipe="hass"))).aux_layers is None
    online = RunConfig(train=ClusterTrainConfig(features="online"))
    records = [Regenerated(key="a", prompt="a.jsonl", conversations="/c/a", summary={}, wall_s=0.0)]
    assert train_config(online, records).online.aux_layers == "eagle3"


def test_run_config_refuses_train_online_naming_the_features_section():
    """``specdraft run`` configures features in one place: a ``train.online.*`` it would replace is refused."""
    toy = ROOT / "configs" / "toy.yaml"
    with pytest.raises(ConfigError, match=r"set features\.max_length, features\.topk instead of "
                                          r"train\.online\.max_length, train\.online\.topk"):
        load(RunConfig, toy, ["train.features=online", "train.online.topk=4", "train.online.max_length=80"])
    with pytest.raises(ConfigError, match=r"train\.online: .*set features\.aux_layers"):  # offline too: never read
        load(RunConfig, toy, ["train.online.aux_layers=eagle3"])
    with pytest.raises(ConfigError, match=r"train\.conversations: .*set data\.prompts"):
        load(RunConfig, toy, ["train.conversations=[c.jsonl]"])

    cfg = load(RunConfig, toy, ["train.features=online", "features.topk=4", "features.aux_layers=eagle3"])
    records = [Regenerated(key=k, prompt=f"{k}.jsonl", conversations=f"/c/{k}", summary={}, wall_s=0.0)
               for k in ("b", "a")]
    online = train_config(cfg, records)  # what the worker trains with, and what MLflow's train run logs
    assert online.online == core_features(cfg.features) and online.online.topk == 4 and online.online.aux_layers == "eagle3"
    assert online.conversations == ["/c/a", "/c/b"]  # ordered by key
    offline = load(RunConfig, toy, ["features.topk=4"])
    assert train_config(offline, []) is offline.train


def test_records_are_frozen_pickle_and_give_the_flow_dicts():
    """The dicts MLflow, the DONE files and ``specdraft run`` see: keys in their order, values as given."""
    records = [
        (Regenerated(key="k", prompt="p", conversations="c", summary={"rows": 3}, wall_s=1.5),
         ["key", "prompt", "conversations", "summary", "wall_s", "skipped"]),
        (Dumped(key="k", store="s", summary={"tokens": 9}, wall_s=2.0, skipped=True),
         ["key", "store", "summary", "wall_s", "skipped"]),
        (Trained(key="k", draft="d", metrics={"loss": 1.0}, metrics_file="m", wall_s=3.0),
         ["key", "draft", "metrics", "metrics_file", "wall_s", "nodes", "skipped"]),
        (Evaluated(key="k", eval_key="e", report="r", tau={"toy": 2.0}, mean_tau=2.0, tau_pld={"toy": 1.6},
                   tau_over_pld={"toy": 1.25}, mean_tau_pld=1.6, lossless_mismatches=0, wall_s=4.0),
         ["key", "eval_key", "report", "tau", "mean_tau", "tau_pld", "tau_over_pld", "mean_tau_pld", "engine_tau",
          "mean_engine_tau", "engine_speedup", "engine_warnings", "engine_best", "lossless_mismatches", "wall_s",
          "nodes", "skipped"]),
        (Exported(key="k", arch="eagle3", exports={"sglang": "x"}, note="", wall_s=0.5),
         ["key", "arch", "exports", "note", "wall_s", "skipped"]),
    ]
    for record, keys in records:
        data = record.to_dict()
        assert list(data) == keys, type(record).__name__
        assert type(record).from_dict(json.loads(json.dumps(data))) == record  # a DONE file reads back
        assert pickle.loads(pickle.dumps(record)) == record  # Prefect passes them between tasks
    with pytest.raises(FrozenInstanceError):
        Trained(key="k", draft="d", metrics={}, metrics_file="m", wall_s=0.0).key = "other"
    with pytest.raises(ConfigError, match="unknown key"):
        Dumped.from_dict({"key": "k", "store": "s", "summary": {}, "wall_s": 0.0, "stores": []})
    # an eval DONE file written before the prompt-lookup floor existed still reads
    assert Evaluated.from_dict({"key": "k", "eval_key": "e", "report": "r", "tau": {}, "mean_tau": None,
                                "lossless_mismatches": 0, "wall_s": 1.0}).tau_pld == {}
    decision = {"model_name": "m", "version": 2, "run_id": "r", "mean_tau": 2.0, "alias": "champion",
                "promoted": True, "champion_version": 2, "champion_mean_tau": None, "mean_tau_pld": None,
                "reason": "already registered (same trained draft)"}
    registered = Registered(**decision, exports={}, export_note="", serving_champion=2, serve={}, wall_s=0.0)
    assert {k: registered.to_dict()[k] for k in decision} == decision and registered.registered
