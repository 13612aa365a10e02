"""Ray Train job: learning on a toy store, DDP == accumulation, resume after a failure."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mlflow.tracking import MlflowClient

from pipelines.tracking import MlflowLogger
from pipelines.train import ScalingSection, TrainConfig, run_training, validate_draft
from specdraft.models import build_draft, draft_config_from_target, load_draft
from specdraft.objectives import LossWeights, StageConfig
from specdraft.quickstart import compute_features
from specdraft.store import FeatureDataset, ReaderConfig, make_manifest, write_manifest, write_shard
from specdraft.target import load_target_config, load_target_heads, load_target_model, load_tokenizer
from specdraft.toy.conversations import generate_conversations
from specdraft.training import OptimConfig

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
        lengths = [s["input_ids"].shape[0] for s in part]
        arrays = {
            "input_ids": torch.cat([s["input_ids"] for s in part]).numpy().astype(np.int32),
            "loss_mask": torch.cat([s["loss_mask"] for s in part]).numpy().astype(np.uint8),
            "hidden": torch.cat([s["hidden"] for s in part]).numpy(),
            "topk_ids": torch.cat([s["topk_ids"] for s in part]).numpy().astype(np.int32),
            "topk_logits": torch.cat([s["topk_logp"] for s in part]).numpy().astype(np.float16),
            "logsumexp": np.zeros(sum(lengths), np.float32),  # top-K already normalised
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "sample_ids": np.array([f"s{index}-{i}" for i in range(len(part))]),
        }
        records.append(write_shard(out, index, arrays, {"d": d, "k": 10, "hidden_codec": "fp16"}))
    write_manifest(out, make_manifest(header={"target_id": "toy", "d": d, "k": 10, "hidden_codec": "fp16"},
                                      shards=records))
    return out


def small_config(**kw) -> TrainConfig:
    base = dict(
        recipe="beagle", epochs=[2, 1], seed=0, checkpoint_every=4, sim_depth=4, log_every=1000,
        optim=OptimConfig(lr=3e-3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1),
        reader=ReaderConfig(max_tokens=2048, val_fraction=0.2, seed=0),
    )
    base.update(kw)
    return TrainConfig(**base)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_learns_and_writes_a_loadable_draft(local_ray, tiny_toy_target, toy_store, tmp_path):
    cfg = small_config(epochs=[3, 1], reader=ReaderConfig(max_tokens=768, val_fraction=0.2, seed=0))
    run = MlflowLogger(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="train-test", run_name="train")
    summary = run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run",
                           tracking={"uri": run.uri, "run_id": run.run_id})
    run.close()
    draft = load_draft(summary["draft"])
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


def test_two_worker_ddp_equals_one_worker_with_double_accumulation(local_ray, tiny_toy_target, toy_store, tmp_path):
    stage = StageConfig(kind="align", epochs=1, steps=2, noise_std=0.0, loss=LossWeights(ce=1.0, vloss=1.0))
    # an even global batch count, so both runs train on exactly the same batches
    for max_tokens in (2048, 1792, 1536, 1280, 1024):
        reader = ReaderConfig(max_tokens=max_tokens, val_fraction=0.0, seed=0, shuffle=False)
        plan = FeatureDataset([toy_store], reader).global_batches(0)
        if len(plan) % 2 == 0 and FeatureDataset([toy_store], reader, world_size=2).global_batches(0) == plan:
            break
    else:
        pytest.fail("no batch size gives an even batch count")
    common = dict(stages=[stage], epochs=None, checkpoint_every=0, reader=reader)
    two = small_config(**common, scaling=ScalingSection(num_workers=2))
    one = small_config(**common, optim=OptimConfig(lr=3e-3, warmup_steps=5, grad_accum=2))
    a = load_draft(run_training(two, [toy_store], tiny_toy_target, tmp_path / "two")["draft"])
    b = load_draft(run_training(one, [toy_store], tiny_toy_target, tmp_path / "one")["draft"])
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-5, rtol=1e-4), name


def test_failed_run_resumes_from_checkpoint_with_same_step_count(local_ray, tiny_toy_target, toy_store, tmp_path):
    cfg = small_config()
    with pytest.raises(Exception, match="injected failure"):
        run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run", fail_at_step=6)
    steps_before = [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "metrics"]
    resumed = run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run")
    reference = run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "reference")
    assert resumed["metrics"]["state_step"] == reference["metrics"]["state_step"]
    steps_after = [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "metrics"]
    assert max(steps_before) >= 6 and min(s for s in steps_after[len(steps_before):]) > 4  # resumed, not restarted
    a, b = load_draft(resumed["draft"]), load_draft(reference["draft"])
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-5), name
