"""The run set-up every trainer shares (``specdraft.run.build_run``) and the recipe registry it reads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdraft.config import ConfigError
from specdraft.features import compute_features
from specdraft.quickstart import SampleSplit
from specdraft.configs.train import OptimConfig, TrainConfig, split_epochs
from specdraft.plan import build_plan
from specdraft.configs.recipes import RECIPES
from specdraft.run import build_run, validate_draft
from specdraft.targets.loading import load_target_model, load_tokenizer
from specdraft.toy.build import PREBUILT_DIR
from specdraft.toy.conversations import generate_conversations


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


class Recorded:
    """A ``MetricLogger`` keeping what it was given."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, float]]] = []

    def log_params(self, params) -> None:
        return None

    def log_metrics(self, metrics, step) -> None:
        self.metrics.append((step, dict(metrics)))

    def close(self) -> None:
        return None


def fit_run(samples, val_fraction: float = 0.1, logger=None):
    from dataclasses import replace

    cfg = TrainConfig(recipe="beagle", epochs=[2, 1], min_steps=0, seed=3, optim=OptimConfig(warmup_steps=0))
    cfg = replace(cfg, reader=replace(cfg.reader, val_fraction=val_fraction))
    splits = {"train": samples[:8], "val": samples[8:]}
    return build_run(cfg, build_plan(cfg), PREBUILT_DIR, lambda split, reader, aux: SampleSplit(splits[split], 4, 0, reader),
                     target_id="toy", logger=logger)


def test_fit_trains_each_stage_on_its_data_epochs_validates_and_logs_each_epoch_end(samples):
    from specdraft.epochs import RunHooks
    from specdraft.training import TrainState

    logger, calls, read = Recorded(), [], []
    run = fit_run(samples, logger=logger)
    hooks = RunHooks(loop_start=lambda r: calls.append("start"), step=lambda r, m: calls.append("step"),
                     epoch_metrics=lambda r: {"extra": float(r.trainer.state.step)},
                     epoch_end=lambda r, e: calls.append(("end", e.stage, e.epoch)), loop_end=lambda r: calls.append("stop"))
    fitted = run.fit(3, 10, validate=("before", "epoch", "after"), hooks=hooks,
                     batches=lambda epoch: read.append(epoch) or run.train.epoch_batches(epoch))
    per_epoch = run.batches_per_epoch
    assert read == [offset + e for offset, s in zip(run.plan.epoch_offsets, run.stages) for e in range(s.epochs)]
    assert read == [0, 1, 2]  # a stage's epochs see new shuffles: the late stage reads data epoch 2, not 0
    assert calls == ["start", *["step"] * per_epoch, ("end", 0, 1), *["step"] * per_epoch, ("end", 0, 2),
                     *["step"] * per_epoch, ("end", 1, 1), "stop"]
    assert [(e.stage, e.kind, e.epoch, e.step, len(e.losses)) for e in fitted.epochs] == [
        (0, run.stages[0].kind, 1, per_epoch, per_epoch), (0, run.stages[0].kind, 2, 2 * per_epoch, per_epoch),
        (1, run.stages[1].kind, 1, 3 * per_epoch, per_epoch)]
    ends = [(step, m) for step, m in logger.metrics if "sim_tau" in m]  # the epoch ends' rows, beside the steps'
    assert [step for step, _ in ends] == [e.step for e in fitted.epochs]
    for (step, logged), end in zip(ends, fitted.epochs):
        assert logged == end.metrics and logged["extra"] == step and logged["sim_tau"] == end.counts.sim_tau
        assert [logged[f"alpha_{i}"] for i in (1, 2, 3)] == end.counts.alpha
    assert fitted.before is not None and fitted.loop_s >= fitted.val_s > 0
    again = validate_draft(run.draft, run.val, 3, 10, "cpu")  # "after" is the trained draft's
    assert torch.equal(fitted.after.accepted, again.accepted) and torch.equal(fitted.after.reached, again.reached)

    run.trainer.state = TrainState(stage=1)  # a run resumed at the late stage trains it alone, from its data epoch
    read.clear()
    resumed = run.fit(3, 10, validate=(), batches=lambda epoch: read.append(epoch) or run.train.epoch_batches(epoch))
    assert read == [run.plan.epoch_offsets[1]] and [(e.stage, e.epoch) for e in resumed.epochs] == [(1, 1)]
    assert resumed.before is None and resumed.after is None and resumed.epochs[0].counts is None
    assert resumed.epochs[0].metrics == {} and resumed.val_s == 0  # nothing validated: nothing logged at its end
    with pytest.raises(ValueError, match="'each'"):
        run.fit(3, 10, validate=("each",))


def test_fit_logs_no_acceptance_when_nothing_is_held_out(samples):
    logger = Recorded()
    run = fit_run(samples, val_fraction=0.0, logger=logger)
    assert run.val is None
    fitted = run.fit(3, 10, validate=("epoch", "after"))
    assert len(fitted.epochs) == 3 and all(e.metrics == {} for e in fitted.epochs)
    assert fitted.after.reached.sum() == 0 and not any("sim_tau" in m for _, m in logger.metrics)


def test_build_run_gives_a_block_draft_the_plans_shape(samples):
    """The plan's typed draft shape (``DraftShape``) is the block draft's config: layers, block, mask, attention."""
    def open_split(split, reader, aux):
        return SampleSplit(samples[:8] if split == "train" else samples[8:], 4, 0, reader)

    cfg = TrainConfig(recipe="beagle-dflash", epochs=[1], draft_layers=2, block_size=4, mask_token_id=5, min_steps=0)
    got = build_run(cfg, build_plan(cfg, aux_layers=[1, 2, 3]), PREBUILT_DIR, open_split).draft_config
    assert (got.arch, got.num_layers, got.block_size, got.mask_token_id, got.block_self_attention) == (
        "dflash", 2, 4, 5, False)
    assert got.draft_vocab_size is None and got.aux_layers == [1, 2, 3]  # the target's frozen head
    paper = replace(cfg, recipe="dflash", draft_layers=None)
    got = build_run(paper, build_plan(paper, aux_layers=[1, 2, 3]), PREBUILT_DIR, open_split).draft_config
    assert got.num_layers == 5 and got.block_self_attention  # the recipe's own shape
