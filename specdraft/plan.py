"""A run's plan, resolved once on the driver from its ``train`` settings and the recipe table (torchtitan's
trainer resolves its job config once and hands the pieces down): the draft architecture, the stage schedule
with its epochs split, whether the draft reads the EAGLE-3 features ("EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", §3) and predicts over its own vocabulary, and
the block draft's shape ("DFlash: Block Diffusion for Flash Speculative Decoding", §3-4), and whether it
warm-starts (issue 33 Deliver 4: fewer epochs then).

``build_plan`` makes the frozen ``RunPlan`` once on the driver — with the auxiliary layers and the draft
vocabulary the driver read from the stores or the target (``specdraft.run.feature_plan``) — and the workers,
the quickstart and the benchmarks train from it (``specdraft.run.build_run``); none of them re-derives a part.
Every rule that turns a recipe and its overrides into what a run trains is here, once (the stage schedule's
checks: ``specdraft.configs.train.resolve_stages``, run when the settings are built); the recipes themselves
are ``specdraft.configs.recipes.RECIPES``. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdraft.configs.draft import Arch
from specdraft.configs.features import EAGLE3
from specdraft.configs.stages import StageConfig
from specdraft.configs.train import TrainConfig, resolve_stages
from specdraft.configs.recipes import RECIPES, recipe_named


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    """What a run trains, resolved once on the driver and handed to every worker."""

    recipe: str
    arch: Arch  # the draft architecture (the recipe's, or train.arch)
    stages: tuple[StageConfig, ...]  # the stage schedule, epochs split over the stages and recompute applied
    epoch_offsets: tuple[int, ...]  # the data epoch each stage starts at (a stage's epochs see new shuffles)
    eagle3_features: bool  # the draft reads auxiliary target layers
    own_vocab: bool  # the draft predicts over a draft vocabulary with its own head
    draft_shape: dict[str, Any] = field(default_factory=dict)  # block drafts: layers, block size, mask, attention
    aux_layers: tuple[int, ...] = ()  # HF hidden_states indices the draft reads (the stores' or the target's)
    vocab: tuple[int, ...] | None = None  # the draft vocabulary's target ids (None: the target's whole vocabulary)
    start: str = "fresh"  # "warm": the run starts from train.init_from (its vocabulary kept) and trains warm_epochs

    def schedule(self) -> dict[str, Any]:
        """The schedule as the train stage's ``schedule.json``, its MLflow params and the summary say it: epochs
        per stage and why (a warm or a fresh start)."""
        return {"start": self.start, "epochs": [s.epochs for s in self.stages],
                "stages": [s.kind for s in self.stages], "total": self.epochs,
                "why": ("warm start: train.warm_epochs (default: a quarter of each stage's train.epochs, rounded up)"
                        if self.start == "warm" else "fresh start: train.epochs")}

    @property
    def epochs(self) -> int:
        return sum(s.epochs for s in self.stages)


def build_plan(cfg: TrainConfig, *, aux_layers: list[int] | tuple[int, ...] = (),
               vocab: list[int] | tuple[int, ...] | None = None, warm: bool = False) -> RunPlan:
    """The plan of ``cfg``: its recipe resolved (``resolve_stages``, ``reads_eagle3_features``, ``has_own_vocab``,
    ``draft_shape``), with the auxiliary layers and draft vocabulary the driver decided; ``warm`` (the driver
    found the run warm-starts: ``specdraft.run.warm_start``) trains the warm schedule (``train.warm_epochs``)."""
    arch, stages = resolve_stages(cfg, warm=warm)
    offsets = tuple(sum(s.epochs for s in stages[:i]) for i in range(len(stages)))
    return RunPlan(recipe=cfg.recipe, arch=arch, stages=tuple(stages), epoch_offsets=offsets,
                   eagle3_features=reads_eagle3_features(cfg), own_vocab=has_own_vocab(cfg),
                   draft_shape=draft_shape(cfg), aux_layers=tuple(int(i) for i in aux_layers),
                   vocab=None if vocab is None else tuple(int(i) for i in vocab), start="warm" if warm else "fresh")


def aux_layers_setting(cfg: TrainConfig, aux_layers: str | list[int] | None) -> str | list[int] | None:
    """The ``aux_layers`` setting a run's features are computed with: as given, or ``eagle3`` (EAGLE-3's default
    triple) when the recipe reads the EAGLE-3 features and none is given — the one place that default is decided
    (the run's dump, online training and the quickstart all ask here)."""
    return EAGLE3 if aux_layers is None and reads_eagle3_features(cfg) else aux_layers


def reads_eagle3_features(cfg: TrainConfig) -> bool:
    """Whether the draft reads auxiliary target layers (and, unless ``own_vocab`` says otherwise, predicts
    over a draft vocabulary)."""
    recipe = RECIPES.get(cfg.recipe)
    return cfg.arch in ("eagle3", "dflash") or (recipe is not None and recipe.eagle3_features)


def has_own_vocab(cfg: TrainConfig) -> bool:
    """Whether the draft predicts over a draft vocabulary with its own head."""
    if resolve_stages(cfg)[0] == "eagle3":
        return True
    if cfg.draft_vocab is not None:
        return cfg.draft_vocab
    recipe = RECIPES.get(cfg.recipe)
    own = recipe.own_vocab if recipe is not None else None
    return reads_eagle3_features(cfg) if own is None else own


def draft_shape(cfg: TrainConfig) -> dict[str, Any]:
    """The block-draft fields of ``draft_config_from_target`` (empty for the one-layer drafts)."""
    if resolve_stages(cfg)[0] != "dflash":
        return {}
    recipe = recipe_named(cfg.recipe)
    return {"num_layers": cfg.draft_layers or recipe.draft_layers, "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id, "block_self_attention": recipe.block_self_attention}
