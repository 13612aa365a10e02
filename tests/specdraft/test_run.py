"""The run set-up every trainer shares (``specdraft.run.build_run``) and the recipe registry it reads."""

from __future__ import annotations

import pytest
import torch

from specdraft.config import ConfigError
from specdraft.features import compute_features
from specdraft.quickstart import SampleSplit
from specdraft.configs.train import TrainConfig
from specdraft.plan import build_plan
from specdraft.recipes import RECIPES, split_epochs
from specdraft.run import build_run, validate_draft
from specdraft.targets.loading import load_target_model, load_tokenizer
from specdraft.toy.build import PREBUILT_DIR
from specdraft.toy.conversations import generate_conversations
from specdraft.training import OptimConfig


@pytest.fixture(scope="module")
def samples():
    if not (PREBUILT_DIR / "model.safetensors").is_file():
        pytest.skip("the shipped toy target is not in this checkout")
    model = load_target_model(PREBUILT_DIR)
    convs = generate_conversations(12, seed=3)
    return compute_features(model, load_tokenizer(PREBUILT_DIR), convs, max_length=96, topk=10, progress=False,
                            aux_layers=[1, 2, 3])


def test_split_epochs_gives_earlier_stages_the_rest():
    assert split_epochs(5, 2) == [3, 2] and split_epochs(6, 3) == [2, 2, 2] and split_epochs(1, 1) == [1]
    with pytest.raises(ConfigError, match="cannot cover"):
        split_epochs(1, 2)


def test_resolved_applies_the_overrides_and_refuses_a_wrong_epoch_count():
    arch, stages = TrainConfig(recipe="beagle", epochs=[2, 1], recompute=True).resolved()
    assert arch == "beagle" and [s.epochs for s in stages] == [2, 1] and all(s.recompute for s in stages)
    assert [s.kind for s in stages] == [s.kind for s in RECIPES["beagle"].stages]
    with pytest.raises(ConfigError, match="one epoch count per stage"):  # refused when the config is built
        TrainConfig(recipe="hass", epochs=[1, 1])


@pytest.mark.parametrize("recipe", ["beagle", "hass", "eagle3"])
def test_build_run_builds_the_recipes_draft_trainer_and_splits(samples, recipe):
    cfg = TrainConfig(recipe=recipe, epochs=[1] * len(RECIPES[recipe].stages), min_steps=0, seed=3,
                      optim=OptimConfig(warmup_steps=0))
    eagle3 = RECIPES[recipe].eagle3_features
    vocab = list(range(0, 320, 2)) if eagle3 else None
    splits = {"train": samples[:8], "val": samples[8:]}
    plan = build_plan(cfg, aux_layers=[1, 2, 3] if eagle3 else (), vocab=vocab)
    asked = []  # the aux layers build_run hands the splits: the plan's
    run = build_run(cfg, plan, PREBUILT_DIR,
                    lambda split, reader, aux: asked.append(aux) or SampleSplit(splits[split], 4, 0, reader),
                    target_id="toy", rank=1)
    assert run.arch == RECIPES[recipe].arch and run.draft_config.arch == run.arch
    assert run.draft_config.aux_layers == ([1, 2, 3] if eagle3 else [])
    assert run.draft_config.draft_vocab_size == (160 if eagle3 else None)
    assert asked == [(1, 2, 3) if eagle3 else ()] * 2  # a draft reading auxiliary layers asks its splits for them
    assert run.batches_per_epoch == 2 and run.trainer.total_steps == 2 * len(run.stages)
    assert run.trainer.draft is run.draft and run.trainer.seed == 3 + 1000  # one device: not wrapped; rank's seed
    assert validate_draft(run.draft, run.val, 3, 10, "cpu").reached.sum() > 0
    torch.manual_seed(99)  # build_run seeds the draft's initial weights itself (cfg.seed)
    again = build_run(cfg, plan, PREBUILT_DIR, lambda split, reader, aux: SampleSplit(splits[split], 4, 0, reader),
                      target_id="toy")
    for (name, a), b in zip(run.draft.state_dict().items(), again.draft.state_dict().values()):
        assert torch.equal(a, b), name
