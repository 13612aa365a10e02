"""Fault injection, issue 22 class 7: no metric reported that was not measured.

An empty held-out split logs no ``sim_tau`` (it says "no held-out batches"); a run with no epoch is a
config error, not an untrained draft; ``min_steps`` is honoured on a store too small for the configured
batch budget; a resumed run's ``metrics.jsonl`` holds one row per step. Real stores written by the store's
writer, real Ray Train."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipelines.train import run_training
from specdraft.config import ConfigError, load
from specdraft.features import compute_features, sample_arrays
from pipelines.configs import ClusterTrainConfig, ScalingSection
from specdraft.run import fit_batches
from specdraft.store import FeatureDataset, make_manifest, write_manifest, write_shard
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.loading import load_target_model, load_tokenizer
from specdraft.toy.conversations import generate_conversations
from specdraft.training import drop_metrics_after
from specdraft.configs.train import OptimConfig


@pytest.fixture(scope="module")
def small_store(tiny_toy_target, tmp_path_factory) -> Path:
    """A one-shard store of 12 conversations of the tiny toy target: far fewer tokens than one batch holds."""
    model, tok = load_target_model(tiny_toy_target), load_tokenizer(tiny_toy_target)
    samples = compute_features(model, tok, generate_conversations(12, seed=11), 128, 10, progress=False)
    header = {"d": samples[0]["hidden"].shape[-1], "k": 10, "hidden_codec": "fp16"}
    arrays = sample_arrays(samples, [f"c{i}" for i in range(len(samples))])
    out = tmp_path_factory.mktemp("small-store")
    write_manifest(out, make_manifest(header={"target_id": "toy", **header},
                                      shards=[write_shard(out, 0, arrays, header)]))
    return out


def config(**kw) -> ClusterTrainConfig:
    base = dict(recipe="beagle", epochs=[1, 1], seed=0, checkpoint_every=0, sim_depth=3, log_every=1000,
                min_steps=1, optim=OptimConfig(lr=3e-3, warmup_steps=1),
                reader=ReaderConfig(max_tokens=4096, val_fraction=0.0, seed=0))
    base.update(kw)
    return ClusterTrainConfig(**base)


def metric_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "metrics"]


def test_no_epochs_is_a_config_error_not_an_untrained_draft():
    for overrides in (["epochs=[0,0]"], ["recipe=hass", "epochs=[0]"]):
        with pytest.raises(ConfigError, match="no stage trains"):
            load(ClusterTrainConfig, None, overrides)


def test_min_steps_is_reached_on_a_store_smaller_than_one_batch(small_store):
    """12 sequences fit one batch of 4096 tokens (2 steps over 2 epochs); min_steps=20 shrinks the batches until
    the run has 20 steps, or one sequence per batch (24 steps here)."""
    cfg = config(min_steps=20)
    dataset = FeatureDataset([small_store], cfg.reader, split="train")
    assert len(dataset.batches(0)) == 1
    reader = fit_batches(dataset, cfg, cfg.resolved()[1])
    steps = 2 * len(FeatureDataset([small_store], reader, split="train").batches(0))
    assert steps >= 20, (steps, reader.max_tokens)


def test_an_empty_held_out_split_logs_no_sim_tau(local_ray, tiny_toy_target, small_store, tmp_path, capfd):
    cfg = config(scaling=ScalingSection(num_workers=0))  # Ray Train's local mode: the loop in this process
    summary = run_training(cfg, [small_store], tiny_toy_target, tmp_path / "run")
    rows = metric_rows(tmp_path / "run")
    assert rows and not [r for r in rows if "sim_tau" in r or "alpha_1" in r], rows
    assert "sim_tau" not in summary["metrics"]
    assert "no held-out batches" in capfd.readouterr().out


def test_a_resumed_run_logs_each_step_once(local_ray, tiny_toy_target, small_store, tmp_path):
    """A worker that fails after a checkpoint is restarted by Ray Train (``max_failures=1``): the new rank-0
    worker resumes from the checkpoint — not from scratch — ends at the uninterrupted run's step count with
    its weights, and logs each step once, to metrics.jsonl and to the MLflow run it attaches to again (a
    real SQLite store), which already holds the steps it re-does. (A rerun of the command resumes the same
    way: the flow and FSDP tests fail and rerun.)"""
    from mlflow.tracking import MlflowClient

    from pipelines.tracking import MlflowLogger
    from specdraft.models import load_draft

    cfg = config(epochs=[2, 1], checkpoint_every=3, reader=ReaderConfig(max_tokens=512, val_fraction=0.2, seed=0),
                 min_steps=8, max_failures=1)
    # the uninterrupted reference in Ray Train's local mode (the same loop, in this process)
    reference = run_training(replace(cfg, scaling=ScalingSection(num_workers=0)), [small_store], tiny_toy_target,
                             tmp_path / "reference")
    mlflow = MlflowLogger(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="resume", run_name="train")
    resumed = run_training(cfg, [small_store], tiny_toy_target, tmp_path / "run", fail_at_step=5,
                           tracking=mlflow.ref())
    mlflow.close()
    assert (tmp_path / "run" / ".failed-once").is_file()  # it failed at step 5, after the checkpoint of step 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "params" for r in records) == 1  # resumed from the checkpoint, not started over
    assert resumed["metrics"]["state_step"] == reference["metrics"]["state_step"] > 5
    weights, expected = (load_draft(r["draft"], target=tiny_toy_target).state_dict() for r in (resumed, reference))
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.allclose(weights[name], value, atol=1e-5, rtol=0), name
    rows = metric_rows(tmp_path / "run")
    steps = Counter((r["step"], "sim_tau" in r) for r in rows)  # a step's training row and its validation row
    assert all(n == 1 for n in steps.values()), sorted(k for k, n in steps.items() if n > 1)
    trained = sorted(step for step, val in steps if not val)
    assert trained == list(range(1, trained[-1] + 1)) and trained[-1] > 5, trained

    client = MlflowClient(mlflow.uri)
    for key in ("loss", "grad_norm", "lr", "sim_tau"):
        history = client.get_metric_history(mlflow.run_id, key)
        logged = sorted(m.step for m in history)
        assert logged == sorted(r["step"] for r in rows if key in r), key  # today: the re-done steps twice
        by_step = {m.step: m.value for m in history}
        for r in rows:  # the values of metrics.jsonl (the re-done steps repeat the killed run's exactly)
            if key in r:
                assert by_step[r["step"]] == pytest.approx(r[key], rel=1e-6), (key, r["step"])


def test_drop_metrics_after_keeps_params_and_earlier_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "params", "a": 1}] + [{"kind": "metrics", "step": s, "loss": 1.0} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "metrics", "st')  # cut by the crash
    with path.open("a") as appender:  # the run's logger holds the file open for appending
        assert drop_metrics_after(path, 2) == 3
        appender.write(json.dumps({"kind": "metrics", "step": 3, "loss": 0.5}) + "\n")
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == rows[:3] + [{"kind": "metrics", "step": 3, "loss": 0.5}]
