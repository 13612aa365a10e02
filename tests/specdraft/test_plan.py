"""The run plan (``specdraft/plan.py``, issue 30 item 3): resolved once from the ``train`` settings and the recipe
table, carried to the workers as plain data, and the one place the EAGLE-3 aux-layer default is decided."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specdraft.config import ConfigError, from_dict, to_dict
from specdraft.configs.train import TrainConfig
from specdraft.configs.recipes import RECIPES
from specdraft.configs.stages import StageConfig
from specdraft.plan import (
    DraftShape,
    RunPlan,
    aux_layers_setting,
    build_plan,
    draft_arch,
    has_own_vocab,
    reads_eagle3_features,
)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_plan_splits_the_epochs_and_offsets_each_stage(recipe):
    stages = len(RECIPES[recipe].stages)
    plan = build_plan(TrainConfig(recipe=recipe, epochs=2 * stages + 1))
    assert plan.arch == RECIPES[recipe].arch and len(plan.stages) == stages
    assert [s.epochs for s in plan.stages] == [3] + [2] * (stages - 1)  # earlier stages take the rest
    assert plan.epoch_offsets == tuple(sum(s.epochs for s in plan.stages[:i]) for i in range(stages))
    assert plan.epochs == 2 * stages + 1 and plan.eagle3_features == RECIPES[recipe].eagle3_features
    assert (plan.draft_shape is not None) == (RECIPES[recipe].arch == "dflash")
    assert plan.own_vocab == has_own_vocab(TrainConfig(recipe=recipe))  # the plan and the driver's question agree


def test_the_plan_travels_as_plain_data():
    plan = build_plan(TrainConfig(recipe="beagle-dflash", epochs=[4], block_size=8), aux_layers=[1, 2], vocab=[0, 3])
    assert plan.draft_shape == DraftShape(num_layers=5, block_size=8, mask_token_id=None, block_self_attention=False)
    assert plan.draft_shape.as_kwargs() == {"num_layers": 5, "block_size": 8, "mask_token_id": None,
                                            "block_self_attention": False}  # draft_config_from_target's keywords
    assert plan.aux_layers == (1, 2) and plan.vocab == (0, 3) and not plan.own_vocab
    assert from_dict(RunPlan, to_dict(plan)) == plan  # what a Ray worker receives is what the driver built


def test_a_config_with_its_own_stages_under_an_unknown_name_gets_the_one_fallback_recipe():
    """One fallback row (``CUSTOM``): a one-layer draft, EAGLE-3 features only when the arch reads them, a block
    draft of one layer whose positions attend to each other."""
    stages = [StageConfig(kind="plain", epochs=2)]
    plain = build_plan(TrainConfig(recipe="mine", stages=stages))
    assert (plain.arch, plain.eagle3_features, plain.own_vocab, plain.draft_shape) == ("beagle", False, False, None)
    assert draft_arch(TrainConfig(recipe="mine", stages=stages)) == "beagle"
    block = build_plan(TrainConfig(recipe="mine", arch="dflash", stages=[StageConfig(kind="block", epochs=1)]))
    assert block.eagle3_features and block.own_vocab and block.draft_shape == DraftShape(
        num_layers=1, block_size=TrainConfig().block_size, mask_token_id=None, block_self_attention=True)
    eagle3 = TrainConfig(recipe="mine", arch="eagle3", stages=stages, draft_vocab=False)
    assert reads_eagle3_features(eagle3) and has_own_vocab(eagle3)  # an EAGLE-3 draft has its own head always
    with pytest.raises(ConfigError, match="unknown recipe 'mine'"):
        TrainConfig(recipe="mine")  # an unknown name without stages


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_draft_vocabulary_is_refused_where_no_engine_serves_one(recipe):
    """vLLM serves a reduced head only on its EAGLE-3 path (``d2t``): a draft over the target's last hidden state
    (eagle, hass, beagle, beagle-early, beagle-topk) shares the target's lm_head there, so asking it for a draft
    vocabulary is refused when the settings are built, naming the key; the EAGLE-3-feature recipes take one."""
    eagle3 = RECIPES[recipe].eagle3_features
    assert has_own_vocab(TrainConfig(recipe=recipe, draft_vocab=False)) == (RECIPES[recipe].arch == "eagle3")
    if eagle3:
        assert has_own_vocab(TrainConfig(recipe=recipe, draft_vocab=True, draft_vocab_size=4096))
    else:
        with pytest.raises(ConfigError, match=rf"^draft_vocab=True: recipe '{recipe}' .*beagle3, eagle3, eagle3-hass"):
            TrainConfig(recipe=recipe, draft_vocab=True)
        assert not has_own_vocab(TrainConfig(recipe=recipe))  # its default: the target's head
    with pytest.raises(ConfigError, match="^draft_vocab_size=0: must be >= 1"):
        TrainConfig(recipe=recipe, draft_vocab_size=0)
    assert TrainConfig(recipe=recipe, draft_vocab_size=1).draft_vocab_size == 1


def test_an_eagle_arch_over_the_eagle3_features_is_refused_naming_the_arch():
    with pytest.raises(ConfigError, match="^arch='eagle': .*recipe 'eagle3-hass' reads the EAGLE-3 features"):
        TrainConfig(recipe="eagle3-hass", arch="eagle")
    assert TrainConfig(recipe="eagle3-hass", arch="eagle3").arch == "eagle3"
    assert not has_own_vocab(TrainConfig(recipe="beagle3", arch="eagle", draft_vocab=False))  # no head asked: no refusal


def test_the_eagle3_aux_layer_default_is_decided_by_the_plan_alone():
    assert aux_layers_setting(TrainConfig(recipe="eagle3"), None) == "eagle3"
    assert aux_layers_setting(TrainConfig(recipe="beagle3"), [1, 2]) == [1, 2]  # a given setting wins
    assert aux_layers_setting(TrainConfig(recipe="hass"), None) is None  # a recipe without EAGLE-3 features
    assert aux_layers_setting(TrainConfig(recipe="hass", arch="eagle3"), None) == "eagle3"  # the arch reads them


def test_a_warm_start_trains_fewer_epochs_and_an_explicit_count_wins():
    cfg = TrainConfig(recipe="beagle3", epochs=[10, 6])
    fresh, warm = build_plan(cfg), build_plan(cfg, warm=True)
    assert [s.epochs for s in fresh.stages] == [10, 6] and fresh.start == "fresh"
    assert [s.epochs for s in warm.stages] == [3, 2] and warm.start == "warm"  # a quarter of each, rounded up
    assert warm.epoch_offsets == (0, 3) and warm.schedule()["epochs"] == [3, 2]
    assert warm.schedule()["why"].startswith("warm start") and fresh.schedule()["why"].startswith("fresh start")
    assert [s.epochs for s in build_plan(TrainConfig(recipe="eagle3", epochs=1), warm=True).stages] == [1]
    given = TrainConfig(recipe="beagle3", epochs=[10, 6], warm_epochs=5)  # the warm total, split as epochs is
    assert [s.epochs for s in build_plan(given, warm=True).stages] == [3, 2]
    assert [s.epochs for s in build_plan(given).stages] == [10, 6]  # a fresh start ignores warm_epochs
    assert [s.epochs for s in build_plan(replace(given, warm_epochs=[4, 0]), warm=True).stages] == [4, 0]
    with pytest.raises(ConfigError, match="warm_epochs"):
        TrainConfig(recipe="beagle3", warm_epochs=[1, 1, 1])
    with pytest.raises(ConfigError, match="warm_epochs"):
        TrainConfig(recipe="beagle3", warm_epochs=[0, 0])
