"""Warm start from the champion (issue 33, Deliver 4): ``train.init_from`` keeps the champion's draft vocabulary
(its d2t/t2d maps byte-identical, never recomputed from the new data) and its weights; a vocabulary that no longer
covers the new data's predicted tokens falls back to a fresh one, said in draft_vocab.json; a draft of another
shape is refused naming the fields. The driver's plan trains the warm schedule (train.warm_epochs, by default a
quarter of the epochs) only when the run does warm-start, and says so in schedule.json and the summary."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from pipelines.conversations import write_conversations
from pipelines.summary import warm_rows
from pipelines.train import feature_plan, online_conversations
from specdraft.configs.features import FeaturesConfig
from specdraft.models import build_draft, draft_config_from_target, save_draft
from specdraft.plan import plan_run
from specdraft.run import load_warm
from specdraft.targets.loading import load_target_config, load_target_heads
from specdraft.toy.conversations import generate_conversations
from specdraft.vocab import select_vocab
from tests.pipelines.test_train import small_config

VD = 32


def _draft(target, ids, seed: int):
    torch.manual_seed(seed)
    heads = load_target_heads(target)
    config = draft_config_from_target(load_target_config(target), "eagle3", aux_layers=[0, 1],
                                      draft_vocab_size=len(ids))
    return build_draft(config, heads.embed, heads.lm_head, vocab=torch.tensor(sorted(ids)))


@pytest.fixture
def plan(tiny_toy_target, tmp_path):
    rows = [{"id": f"c{i:03d}", "source": "toy", "messages": m} for i, m in enumerate(generate_conversations(12, 2))]
    conversations = write_conversations(tmp_path / "conversations.parquet", rows)
    cfg = small_config(recipe="eagle3", epochs=[1], features="online", conversations=[str(conversations)],
                       draft_vocab_size=VD, online=FeaturesConfig(max_length=96, aux_layers=[0, 1]))
    counts = online_conversations(cfg, tiny_toy_target)[0].predicted_token_counts(320)
    return cfg, counts


def test_the_champion_vocabulary_and_weights_are_kept_byte_identical(tiny_toy_target, tmp_path, plan):
    cfg, counts = plan
    fresh = select_vocab(counts, VD).tolist()
    extra = [i for i in range(319, -1, -1) if i not in fresh][:2]
    kept = sorted(fresh[2:] + extra)  # the champion's vocabulary: not what the new data would choose
    champion = save_draft(_draft(tiny_toy_target, kept, seed=1), tmp_path / "champion")
    warm = replace(cfg, init_from=str(champion), init_min_coverage=0.5)
    (tmp_path / "run").mkdir()
    layers, ids = feature_plan(warm, [], tiny_toy_target, tmp_path / "run")
    assert ids == kept != fresh  # kept, not recomputed
    record = json.loads((tmp_path / "run" / "draft_vocab.json").read_text())
    assert record["init_from"] == str(champion) and record["coverage"] >= 0.5
    draft = _draft(tiny_toy_target, ids, seed=2)  # what build_run builds, then warm-starts
    load_warm(draft, champion)
    mine = load_file(str(save_draft(draft, tmp_path / "warm") / "model.safetensors"))
    theirs = load_file(str(champion / "model.safetensors"))
    assert mine.keys() == theirs.keys()
    for name in ("heads.d2t", "heads.t2d"):
        assert mine[name].numpy().tobytes() == theirs[name].numpy().tobytes()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # every weight from the champion
    cfg8 = replace(warm, epochs=[8])
    plan = plan_run(cfg8, *feature_plan(cfg8, [], tiny_toy_target, tmp_path / "run"), tmp_path / "run")  # the driver
    assert plan.start == "warm" and [s.epochs for s in plan.stages] == [2] and list(plan.vocab) == kept
    schedule = json.loads((tmp_path / "run" / "schedule.json").read_text())
    assert schedule["epochs"] == [2] and schedule["init_from"] == str(champion)
    [(label, text)] = warm_rows(tmp_path / "run")  # the summary's warm line says the schedule and why
    assert label == "warm" and "vocabulary kept" in text and "schedule: epochs [2] over ttt (warm start" in text


def test_low_coverage_falls_back_and_another_shape_is_refused(tiny_toy_target, tmp_path, plan):
    cfg, counts = plan
    rare = [int(i) for i in torch.argsort(torch.as_tensor(counts), stable=True)[:VD]]  # the least predicted tokens
    champion = save_draft(_draft(tiny_toy_target, rare, seed=1), tmp_path / "champion")
    warm = replace(cfg, init_from=str(champion))
    (tmp_path / "run").mkdir()
    layers, ids = feature_plan(warm, [], tiny_toy_target, tmp_path / "run")
    assert ids == select_vocab(counts, VD).tolist()  # a fresh vocabulary
    record = json.loads((tmp_path / "run" / "draft_vocab.json").read_text())
    assert "init_from" not in record and "< train.init_min_coverage 90%" in record["warm_start_fallback"]
    cfg8 = replace(warm, epochs=[8])
    plan = plan_run(cfg8, *feature_plan(cfg8, [], tiny_toy_target, tmp_path / "run"), tmp_path / "run")
    assert plan.start == "fresh" and [s.epochs for s in plan.stages] == [8]  # no warm start: the fresh schedule
    assert "no warm start" in warm_rows(tmp_path / "run")[0][1] and "(fresh start: train.epochs)" in warm_rows(
        tmp_path / "run")[0][1]
    other = save_draft(_draft(tiny_toy_target, list(range(16)), seed=1), tmp_path / "small")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        load_warm(_draft(tiny_toy_target, ids, seed=2), other)
