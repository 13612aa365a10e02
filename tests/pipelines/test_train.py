"""Ray Train job on a toy store: learning, FSDP == DDP == accumulation, resume after a failure (two FSDP
workers; one worker: tests/faults/test_results.py), EAGLE-3 and DFlash on a store with aux layers, a store read
from S3. Gradient sync and sharding inside the workers: tests/pipelines/test_train_sync.py; online features:
tests/pipelines/test_train_online.py (split from this module so that ``--dist loadfile`` can balance the
two workers: one file is one unit of scheduling).

Reference runs that are not about workers run in Ray Train's local mode (``scaling.num_workers=0``:
the same training loop in the test's process), saving a worker group's start-up each."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mlflow.tracking import MlflowClient

from pipelines.tracking import MlflowLogger
from pipelines.train import run_training
from specdraft.features import compute_features, sample_arrays
from specdraft.models import build_draft, draft_config_from_target, load_draft
from specdraft.configs.stages import LossWeights, StageConfig
from pipelines.configs import ClusterTrainConfig, ScalingSection
from specdraft.run import validate_draft
from specdraft.store import FeatureDataset, make_manifest, write_manifest, write_shard
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.loading import load_target_config, load_target_heads, load_target_model, load_tokenizer
from specdraft.toy.conversations import generate_conversations
from specdraft.configs.train import OptimConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def toy_store(tiny_toy_target, tmp_path_factory) -> Path:
    """A two-shard feature store of the tiny toy target, written with the store's own writer."""
    model, tok = load_target_model(tiny_toy_target), load_tokenizer(tiny_toy_target)
    samples = compute_features(model, tok, generate_conversations(96, seed=5), 128, 10, progress=False)
    d = samples[0]["hidden"].shape[-1]
    out = tmp_path_factory.mktemp("store")
    records = []
    for index, part in enumerate([samples[:48], samples[48:]]):
        arrays = sample_arrays(part, [f"s{index}-{i}" for i in range(len(part))])
        records.append(write_shard(out, index, arrays, {"d": d, "k": 10, "hidden_codec": "fp16"}))
    write_manifest(out, make_manifest(header={"target_id": "toy", "d": d, "k": 10, "hidden_codec": "fp16"},
                                      shards=records))
    return out


def small_config(**kw) -> ClusterTrainConfig:
    base = dict(
        recipe="beagle", epochs=[2, 1], seed=0, checkpoint_every=4, sim_depth=4, log_every=1000,
        optim=OptimConfig(lr=3e-3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1),
        reader=ReaderConfig(max_tokens=2048, val_fraction=0.2, seed=0),
    )
    base.update(kw)
    return ClusterTrainConfig(**base)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_learns_and_writes_a_loadable_draft(local_ray, tiny_toy_target, toy_store, tmp_path):
    # the default min_steps (300): batches shrink until the run has them; few checkpoints (each report waits
    # for Ray Train's controller to poll)
    cfg = small_config(epochs=[3, 1], checkpoint_every=100, reader=ReaderConfig(max_tokens=768, val_fraction=0.2, seed=0))
    run = MlflowLogger(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="train-test", run_name="train")
    summary = run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run",
                           tracking={"uri": run.uri, "run_id": run.run_id})
    run.close()
    draft = load_draft(summary["draft"], target=tiny_toy_target)
    logged = MlflowClient(run.uri).get_run(run.run_id).data
    assert logged.params["train.recipe"] == "beagle" and "sim_tau" in logged.metrics and "loss" in logged.metrics
    records = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "metrics"]
    early = [r["loss"] for r in records if r.get("stage") == 0.0]  # the late stage sums 4 weighted steps
    assert np.mean(early[-3:]) < np.mean(early[:3])

    heads = load_target_heads(tiny_toy_target)
    torch.manual_seed(0)
    untrained = build_draft(draft_config_from_target(load_target_config(tiny_toy_target), "beagle"),
                            heads.embed, heads.lm_head)
    val = FeatureDataset([toy_store], cfg.reader, split="val")
    before = validate_draft(untrained, val, 4, 100, "cpu").sim_tau
    after = validate_draft(draft, val, 4, 100, "cpu").sim_tau
    assert after > before + 0.05, (before, after)
    sim = [r["sim_tau"] for r in records if "sim_tau" in r]
    assert len(sim) == 4  # one validation pass per epoch

    # the run's Ray logs (every worker, the train controller and its placement-group cleaner) hold
    # none of the known-harmless lines (pipelines/cluster.py) and no traceback of a crashed monitor
    logs = Path(local_ray._private.worker._global_node.get_session_dir_path()) / "logs"
    text = "".join(p.read_text(errors="ignore") for p in logs.glob("worker-*") if p.is_file())
    assert text  # the workers' logs are there to read
    for line in ("Failed to query Ray Train Controller actor state", "Failed to send resource request",
                 "Found multiple active Ray instances", "Exception in thread PlacementGroupCleanerMonitor"):
        assert line not in text, line


def even_reader(store: Path) -> ReaderConfig:
    """A reader whose global batch plan has an even count and is the same for 1 and 2 workers, so a
    2-worker run trains on exactly the batches of a 1-worker run with grad_accum 2."""
    for max_tokens in (1024, 896, 768, 640, 512):
        reader = ReaderConfig(max_tokens=max_tokens, val_fraction=0.0, seed=0, shuffle=False)
        plan = FeatureDataset([store], reader).global_batches(0)
        if len(plan) % 2 == 0 and FeatureDataset([store], reader, world_size=2).global_batches(0) == plan:
            return reader
    pytest.fail("no batch size gives an even batch count")


def grad_norms(out: Path) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(out) if "grad_norm" in r]


def train_steps(out: Path) -> list[dict]:
    """The optimizer steps' records of a run, in order (a resumed run appends to its killed run's)."""
    return [r for r in read_metrics(out) if r["kind"] == "metrics" and "grad_norm" in r]


def test_fsdp_ddp_and_one_worker_accumulating_train_the_same_weights(local_ray, tiny_toy_target, toy_store, tmp_path):
    """2 workers sharded (FSDP2) == 2 workers replicated (DDP) == grad_accum 2 in one process, with the
    gradients clipped on every step (so a per-shard norm would show), through a detached multi-step
    stage (align), then ttt (several forwards, one backward) on an EAGLE draft, and ttt again with each
    sub-step's decoder layer recomputed in the backward (activation checkpointing inside FSDP)."""
    stages = [StageConfig(kind="align", epochs=1, steps=2, noise_std=0.0, loss=LossWeights(ce=1.0, vloss=1.0)),
              StageConfig(kind="ttt", epochs=1, steps=3, step_decay=0.8, noise_std=0.0,
                          loss=LossWeights(ce=1.0, vloss=1.0)),
              StageConfig(kind="ttt", epochs=1, steps=3, step_decay=0.8, noise_std=0.0, recompute=True,
                          loss=LossWeights(ce=1.0, vloss=1.0))]
    optim = dict(lr=3e-3, warmup_steps=2, max_grad_norm=0.2)
    common = dict(arch="eagle", stages=stages, epochs=None, checkpoint_every=0, min_steps=1, val_max_batches=2,
                  reader=even_reader(toy_store))
    runs = {
        strategy: small_config(**common, optim=OptimConfig(**optim),
                               scaling=ScalingSection(num_workers=2, strategy=strategy))
        for strategy in ("fsdp", "ddp")
    }
    # the reference in Ray Train's local mode (num_workers=0: the same loop, in this process)
    runs["one"] = small_config(**common, optim=OptimConfig(**optim, grad_accum=2),
                               scaling=ScalingSection(num_workers=0))
    drafts = {name: load_draft(run_training(cfg, [toy_store], tiny_toy_target, tmp_path / name)["draft"],
                               target=tiny_toy_target) for name, cfg in runs.items()}
    norms = {name: grad_norms(tmp_path / name) for name in runs}
    assert len(norms["one"]) >= 12 and min(norms["one"]) > 0.2, norms["one"]  # all three stages, always clipped
    reference = drafts["one"].state_dict()
    for name in ("fsdp", "ddp"):
        assert norms[name] == pytest.approx(norms["one"], rel=1e-4), name  # the global norm, not a shard's
        weights = drafts[name].state_dict()
        assert weights.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.allclose(weights[key], value, atol=1e-5, rtol=1e-4), (name, key)


def test_fsdp_run_resumes_from_a_checkpoint_after_a_failure(local_ray, tiny_toy_target, toy_store, tmp_path):
    """The Beagle recipe (noise, random window offsets per rank) on 2 FSDP workers, killed after a
    checkpoint, resumes from it: the steps it re-does repeat the killed run's exactly (loss, global gradient
    norm, learning rate: weights, optimizer, schedule, data order and every rank's random streams restored
    from the checkpoint), and it ends at the planned step count. (One worker restarted by Ray Train after a
    failure is compared with an uninterrupted run in tests/faults/test_results.py.)"""
    cfg = small_config(min_steps=1, val_max_batches=2, checkpoint_every=3, epochs=[1, 1],
                       reader=ReaderConfig(max_tokens=1024, val_fraction=0.2, seed=0),
                       scaling=ScalingSection(num_workers=2, strategy="fsdp"))
    with pytest.raises(Exception, match="injected failure"):
        run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run", fail_at_step=5)
    before = train_steps(tmp_path / "run")
    resumed = run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run")
    steps = train_steps(tmp_path / "run")  # one row per step: the killed run's after the checkpoint were dropped
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    after = [r for r in steps if r not in before]  # the resumed run's rows
    killed = {r["step"]: r for r in before}
    redone = [r for r in after if r["step"] in killed]  # after the last checkpoint (every 3 steps, each epoch end)
    assert sorted(killed) == [1, 2, 3, 4, 5] and 3 < after[0]["step"] <= 5 and redone, (sorted(killed), after[0])
    for again in redone:
        for key in ("loss", "grad_norm", "lr"):
            assert again[key] == pytest.approx(killed[again["step"]][key], rel=1e-6, abs=1e-7), (again["step"], key)
    planned = next(r for r in read_metrics(tmp_path / "run") if r["kind"] == "params")["train.total_steps"]
    assert resumed["metrics"]["state_step"] == after[-1]["step"] == planned > 5
    load_draft(resumed["draft"], target=tiny_toy_target)


@pytest.fixture(scope="module")
def one_worker_run(local_ray, tiny_toy_target, toy_store, tmp_path_factory) -> dict:
    """An uninterrupted run of ``small_config(min_steps=1)`` (the store's own batches: a few steps, noise
    and random window offsets, a checkpoint every 4), in Ray Train's local mode (``num_workers=0``: the
    same training loop in this process; the tests compare it with runs in a Ray Train worker)."""
    cfg = small_config(min_steps=1, scaling=ScalingSection(num_workers=0))
    return run_training(cfg, [toy_store], tiny_toy_target, tmp_path_factory.mktemp("one"))


def same_weights(a: str | Path, b: str | Path, target: Path, atol: float) -> None:
    da, db = load_draft(a, target=target).state_dict(), load_draft(b, target=target).state_dict()
    assert da.keys() == db.keys()
    for name, value in da.items():
        assert torch.allclose(value, db[name], atol=atol, rtol=0), name


def test_eagle3_recipe_trains_on_a_store_dumped_with_aux_layers(local_ray, tiny_toy_target, toy_store, tmp_path):
    """recipe eagle3 end to end: the dump stores aux_hidden, the reader fills Batch.aux_hidden (reader
    with the run plan's aux layers), training runs and writes an EAGLE-3 draft; a store
    without aux states is refused up front with the fix."""
    from pipelines.dump import dump_features
    from specdraft.configs.features import FeaturesConfig
    from specdraft.store import StoreError

    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(generate_conversations(24, seed=9))]
    store = tmp_path / "aux-store"
    dump_features(tiny_toy_target, rows, store, FeaturesConfig(samples_per_shard=12, max_length=128, aux_layers=[0, 1]),
                  progress=False)
    cfg = small_config(recipe="eagle3", epochs=[1], min_steps=4, draft_vocab_size=64, checkpoint_every=0,
                       reader=ReaderConfig(max_tokens=1024, val_fraction=0.2, seed=0),
                       scaling=ScalingSection(num_workers=0))  # Ray Train's local mode: the loop in this process
    summary = run_training(cfg, [store], tiny_toy_target, tmp_path / "run")
    draft = load_draft(summary["draft"], target=tiny_toy_target)
    assert draft.config.arch == "eagle3" and draft.config.aux_layers == [0, 1] and draft.config.draft_vocab_size == 64
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "metrics" and "loss" in r]
    assert len(losses) >= 4 and all(np.isfinite(losses))
    with pytest.raises(StoreError, match="recipe 'eagle3' .* has no aux_hidden .* aux_layers=eagle3"):
        run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "bare")
    block = replace(cfg, recipe="dflash", draft_layers=1, block_size=4)  # the block draft, on the same store
    summary = run_training(block, [store], tiny_toy_target, tmp_path / "block")
    draft = load_draft(summary["draft"], target=tiny_toy_target)
    assert draft.config.arch == "dflash" and draft.config.aux_layers == [0, 1] and draft.config.block_size == 4
    assert not draft.config.own_vocab and not (tmp_path / "block" / "draft_vocab.json").exists()  # the target's head
    rows = [r for r in read_metrics(tmp_path / "block") if r["kind"] == "metrics" and "loss" in r]
    assert len(rows) >= 4 and all(np.isfinite(r["loss"]) for r in rows) and "acc_step3" in rows[-1]


def test_training_reads_a_store_from_s3_like_the_same_store_on_disk(s3_ray, s3_bucket, one_worker_run, tiny_toy_target,
                                                                    toy_store, tmp_path):
    """The store copied to an object-store URL (a real S3 server on 127.0.0.1): the Ray Train worker reads it
    there and trains the same weights, step for step, as from the local copy."""
    import fsspec

    url = f"{s3_bucket}/stores/toy"
    fsspec.filesystem("s3").put(f"{toy_store}/", url[len("s3://"):], recursive=True)
    remote = run_training(small_config(min_steps=1), [url], tiny_toy_target, tmp_path / "s3")
    local = Path(one_worker_run["draft"]).parent
    assert len(grad_norms(tmp_path / "s3")) > 0 and grad_norms(tmp_path / "s3") == pytest.approx(grad_norms(local),
                                                                                                rel=1e-6)
    same_weights(remote["draft"], one_worker_run["draft"], tiny_toy_target, atol=1e-6)
