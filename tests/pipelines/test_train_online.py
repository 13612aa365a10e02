"""Online features (``train.features=online``: the target run on each batch, no store): the driver's plan (aux
layers resolved as the dump resolves them, the draft vocabulary counted from the conversations), and
``specdraft train --conversations`` against the dump stage's store of the same conversations (split from
tests/pipelines/test_train.py, whose ``small_config`` and ``read_metrics`` it shares)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from pipelines.configs import ScalingSection
from specdraft.configs.reader import ReaderConfig
from specdraft.models import load_draft
from specdraft.store import FeatureDataset
from specdraft.targets.loading import load_target_model
from specdraft.toy.conversations import generate_conversations
from tests.pipelines.test_train import read_metrics, small_config

pytestmark = pytest.mark.slow


def test_online_feature_plan_resolves_the_aux_layers_and_counts_the_vocabulary(tiny_toy_target, tmp_path):
    """On the driver, no Ray: train.online.aux_layers resolved as the dump resolves it (eagle3 does not fit a
    2-layer target: the error names the setting), the draft vocabulary counted from the tokenized
    conversations, written to out/draft_vocab.json and reused from there on resume."""
    from pipelines.conversations import write_conversations
    from specdraft.configs.features import FeaturesConfig
    from pipelines.train import feature_plan, online_conversations
    from specdraft.vocab import select_vocab

    rows = [{"id": f"c{i:03d}", "source": "toy", "messages": m} for i, m in enumerate(generate_conversations(12, 2))]
    conversations = write_conversations(tmp_path / "conversations.parquet", rows)
    cfg = small_config(recipe="eagle3", epochs=[1], features="online", conversations=[str(conversations)],
                       draft_vocab_size=32,
                       online=FeaturesConfig(max_length=96, aux_layers="eagle3"))
    with pytest.raises(ValueError, match=r"train.online.aux_layers='eagle3'.*N=2 layers"):
        feature_plan(cfg, [], tiny_toy_target, tmp_path)
    cfg = replace(cfg, online=replace(cfg.online, aux_layers=[0, 1]))
    layers, ids = feature_plan(cfg, [], tiny_toy_target, tmp_path)
    counts = online_conversations(cfg, tiny_toy_target)[0].predicted_token_counts(320)
    assert layers == [0, 1] and ids == select_vocab(counts, 32).tolist()
    record = json.loads((tmp_path / "draft_vocab.json").read_text())
    assert record["target_ids"] == ids and record["counted_tokens"] == counts.sum() > 0
    assert record["size"] == 32 and record["vocab_size"] == 320  # what the summary's vocab line says
    assert record["coverage"] == pytest.approx(counts[ids].sum() / counts.sum()) and 0 < record["coverage"] < 1
    (tmp_path / "draft_vocab.json").write_text(json.dumps({**record, "target_ids": list(range(32))}))
    assert feature_plan(cfg, [], tiny_toy_target, tmp_path) == ([0, 1], list(range(32)))  # resumed: kept


# the online-vs-store runs: recipe -> the target, the conversations (how many, seed), the dump's aux layers,
# the run's stages, Ray Train workers (0: local mode, in this process) and the draft vocabulary (None: the default)
ONLINE_VS_STORE = {
    "beagle": dict(target="tiny_toy_target", conversations=(40, 9), samples_per_shard=16, aux_layers=None,
                   epochs=[1, 1], workers=2, val_max_batches=2, draft_vocab_size=None),
    "eagle3": dict(target="deep_toy_target", conversations=(24, 4), samples_per_shard=12, aux_layers="eagle3",
                   epochs=[1], workers=0, val_max_batches=1, draft_vocab_size=64),
}


@pytest.mark.parametrize("recipe", list(ONLINE_VS_STORE))
def test_online_features_train_like_the_dumped_store(recipe, local_ray, request, tmp_path):
    """``specdraft train --recipe R --conversations`` (online features) against the dump stage's store of the
    same conversations: every rank gets the same batch plan from both, and rank 0's first step, set up as the
    worker sets it up (``build_run``: draft seed, rank-0 generator — noise, window offsets), has the online run's
    first-step loss on the store and online. Beagle on two Ray Train workers; EAGLE-3 (no aux layers configured:
    they default to eagle3) in local mode, on the 7-layer target, with the aux layers and draft vocabulary of the
    store dumped with aux_layers=eagle3. The dump prefills its own length groups, so features can differ in the
    last float bits (absorbed by the float16 rounding: measured equal); the bound is 1e-5. (In process: an
    offline Ray Train run would add half the test's time.)"""
    import yaml

    from flows.cli import main
    from pipelines.conversations import write_conversations
    from pipelines.dump import dump_features
    from pipelines.train import online_conversations
    from specdraft.config import to_dict
    from specdraft.configs.features import FeaturesConfig
    from specdraft.online import OnlineDataset
    from specdraft.plan import build_plan
    from specdraft.run import build_run
    from specdraft.store import predicted_token_counts, read_manifest
    from specdraft.vocab import select_vocab

    case = ONLINE_VS_STORE[recipe]
    target = request.getfixturevalue(case["target"])
    count, seed = case["conversations"]
    rows = [{"id": f"c{i:03d}", "source": "toy", "messages": m} for i, m in enumerate(generate_conversations(count, seed))]
    conversations = write_conversations(tmp_path / "conversations" / "part-00000.parquet", rows)
    features = FeaturesConfig(max_length=96, samples_per_shard=case["samples_per_shard"], batch_tokens=1024)
    store = tmp_path / "store"
    dump_features(target, rows, store, replace(features, aux_layers=case["aux_layers"]), progress=False)
    cfg = small_config(recipe=recipe, epochs=case["epochs"], min_steps=1, checkpoint_every=0,
                       val_max_batches=case["val_max_batches"], online=features, reader=ReaderConfig(max_tokens=512, val_fraction=0.2, seed=0),
                       scaling=ScalingSection(num_workers=case["workers"]),
                       **{k: case[k] for k in ("draft_vocab_size",) if case[k] is not None})
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    argv = ["train", "--recipe", recipe, "--conversations", str(conversations.parent), "--target", str(target),
            "--out", str(tmp_path / "online"), "--config", str(tmp_path / "train.yaml")]
    assert main(argv) == 0

    draft = load_draft(tmp_path / "online" / "draft", target=target)
    records = read_metrics(tmp_path / "online")
    params = next(r for r in records if r["kind"] == "params")
    losses = [r["loss"] for r in records if r["kind"] == "metrics" and "loss" in r]
    assert params["train.features"] == "online" and params["train.max_tokens_used"] == 512
    assert draft.config.arch == recipe and all(np.isfinite(losses))
    layers, vocab = None, None
    if case["aux_layers"]:
        layers = read_manifest(store)["aux_layers"]
        assert layers == [2, 3, 4] and draft.config.aux_layers == layers
        assert params["train.online.aux_layers"] == "eagle3"
        vocab = json.loads((tmp_path / "online" / "draft_vocab.json").read_text())["target_ids"]
        assert vocab == select_vocab(predicted_token_counts(store, 320), case["draft_vocab_size"]).tolist()

    model = load_target_model(target)
    data = online_conversations(replace(cfg, conversations=[str(conversations.parent)]), target)[0]
    world = max(1, case["workers"])
    opened = {  # the split of rank ``rank`` of ``world`` on the store and online, as a worker opens it
        "store": lambda split, reader, aux, rank=0: FeatureDataset([store], reader, split=split, rank=rank,
                                                                   world_size=world, aux_layers=aux),
        "online": lambda split, reader, aux, rank=0: OnlineDataset(model, data, reader, topk=features.topk, split=split,
                                                                   rank=rank, world_size=world, aux_layers=aux),
    }
    reader, aux = cfg.reader, tuple(layers or ())
    for rank in range(world):
        offline, online = opened["store"]("train", reader, aux, rank), opened["online"]("train", reader, aux, rank)
        assert offline.sample_ids == online.sample_ids, rank
        for epoch in range(len(case["epochs"])):
            assert offline.batches(epoch) == online.batches(epoch), (rank, epoch)
    per_epoch = len(opened["store"]("train", reader, aux).batches(0))
    assert params["train.batches_per_epoch"] == per_epoch
    assert len(losses) == params["train.total_steps"] == sum(case["epochs"]) * per_epoch >= 2, (losses, per_epoch)

    first = {}
    for source, open_split in opened.items():  # rank 0's first step in process, as build_run sets it up
        run = build_run(cfg, build_plan(cfg, aux_layers=layers or (), vocab=vocab), target, open_split, fingerprint="")
        run.trainer.run(lambda stage, epoch: [run.train.load(run.train.batches(0)[0])],
                        on_step=lambda tr, metrics: first.setdefault(source, metrics["loss"]))
    assert first["store"] > 0 and losses[0] == pytest.approx(first["store"], abs=1e-5, rel=0), (losses[0], first)
    assert first["online"] == pytest.approx(first["store"], abs=1e-5, rel=0), first
