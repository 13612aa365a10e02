"""A run's plan, resolved once on the driver from its ``train`` settings and the recipe table (torchtitan's
trainer resolves its job config once and hands the pieces down): the draft architecture, the stage schedule
with its epochs split, whether the draft reads the EAGLE-3 features ("EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", §3) and predicts over its own vocabulary, the
block draft's shape ("DFlash: Block Diffusion for Flash Speculative Decoding", §3-4), and whether it
warm-starts (then fewer epochs: ``train.warm_epochs``).

``plan_run`` makes the frozen ``RunPlan`` on the driver — with the auxiliary layers and the draft vocabulary the
driver read from the stores or the target (``specdraft.run.feature_plan``), whether it warm-starts
(``warm_start``) and its ``schedule.json`` — through ``build_plan``, which looks the recipe up once
(``specdraft.configs.recipes``) and resolves the stage schedule once (``specdraft.configs.train.resolve_stages``:
what ``epochs``/``warm_epochs`` mean, checked when the settings are built). The workers, the quickstart and the
benchmarks train from the plan (``specdraft.run.build_run``); none of them re-derives a part. The questions a
driver asks before it has a plan (``reads_eagle3_features``, ``has_own_vocab``, ``aux_layers_setting``,
``draft_arch``) read the same recipe row the same way. This module imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdraft import files
from specdraft.configs.draft import Arch
from specdraft.configs.features import EAGLE3
from specdraft.configs.recipes import recipe_named
from specdraft.configs.stages import StageConfig
from specdraft.configs.train import TrainConfig, own_vocab_of, reads_eagle3_of, resolve_stages


@dataclass(frozen=True, kw_only=True, slots=True)
class DraftShape:
    """A block draft's shape (DFlash §3-4): the fields of ``draft_config_from_target`` a block draft sets."""

    num_layers: int  # decoder layers (train.draft_layers, else the recipe's)
    block_size: int  # positions per block: the anchor and block_size - 1 masks
    mask_token_id: int | None  # the mask's token (None: the draft config's default)
    block_self_attention: bool  # block positions attend to each other (beagle-dflash: no)

    def as_kwargs(self) -> dict[str, Any]:
        """The shape as ``draft_config_from_target``'s keyword arguments."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunPlan:
    """What a run trains, resolved once on the driver and handed to every worker."""

    recipe: str
    arch: Arch  # the draft architecture (the recipe's, or train.arch)
    stages: tuple[StageConfig, ...]  # the stage schedule, epochs split over the stages and recompute applied
    epoch_offsets: tuple[int, ...]  # the data epoch each stage starts at (a stage's epochs see new shuffles)
    eagle3_features: bool  # the draft reads auxiliary target layers
    own_vocab: bool  # the draft predicts over a draft vocabulary with its own head
    draft_shape: DraftShape | None = None  # block drafts only
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
    """The plan of ``cfg``: its recipe looked up and its stage schedule resolved, once, with the auxiliary layers
    and draft vocabulary the driver decided; ``warm`` (the run warm-starts: ``warm_start``) trains the warm
    schedule (``train.warm_epochs``)."""
    recipe = recipe_named(cfg.recipe)
    arch, stages = resolve_stages(cfg, warm=warm)
    eagle3 = reads_eagle3_of(cfg, recipe)
    shape = None if arch != "dflash" else DraftShape(
        num_layers=cfg.draft_layers or recipe.draft_layers, block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id, block_self_attention=recipe.block_self_attention)
    return RunPlan(recipe=cfg.recipe, arch=arch, stages=tuple(stages),
                   epoch_offsets=tuple(sum(s.epochs for s in stages[:i]) for i in range(len(stages))),
                   eagle3_features=eagle3, own_vocab=own_vocab_of(cfg, recipe, arch, eagle3), draft_shape=shape,
                   aux_layers=tuple(int(i) for i in aux_layers),
                   vocab=None if vocab is None else tuple(int(i) for i in vocab), start="warm" if warm else "fresh")


def plan_run(cfg: TrainConfig, aux_layers: list[int], vocab: list[int] | None, out: Path) -> RunPlan:
    """The run's plan on the driver, from the feature plan (``specdraft.run.feature_plan``: aux layers, draft
    vocabulary): whether it warm-starts (``warm_start``) and so its schedule (``build_plan``: ``train.warm_epochs``
    on a warm start), written to ``out/schedule.json`` (epochs per stage, warm or fresh and why, ``init_from``
    when warm)."""
    warm = warm_start(cfg, vocab)
    plan = build_plan(cfg, aux_layers=aux_layers, vocab=vocab, warm=warm)
    schedule = {**plan.schedule(), **({"init_from": str(cfg.init_from)} if warm else {})}
    files.write_text(Path(out) / "schedule.json", json.dumps(schedule, indent=2))
    print(f"[specdraft] schedule: {schedule['why']}: epochs {schedule['epochs']} ({', '.join(schedule['stages'])})",
          flush=True)
    return plan


def warm_start(cfg: TrainConfig, vocab: list[int] | tuple[int, ...] | None) -> bool:
    """Whether a run of ``cfg`` with the draft vocabulary ``vocab`` (``feature_plan``'s) starts from
    ``cfg.init_from``: one is given and its vocabulary was kept (a draft over the target's vocabulary keeps it
    always); a fallback to a fresh vocabulary starts fresh. The driver's plan (``plan_run``: the warm schedule)
    and ``specdraft.run.build_run`` (the weights loaded) both ask here."""
    return bool(cfg.init_from) and (vocab is None or list(vocab) == draft_vocab_ids(cfg.init_from))


def draft_vocab_ids(init_from: str | Path) -> list[int]:
    """The draft vocabulary's target ids of the draft directory ``init_from``, from its stored ``d2t``."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(Path(init_from) / "model.safetensors"), framework="numpy") as fh:
        d2t = fh.get_tensor("heads.d2t")  # (Vd,) offsets: target id = draft id + d2t
    return (np.arange(d2t.size, dtype=np.int64) + d2t).tolist()


def aux_layers_setting(cfg: TrainConfig, aux_layers: str | list[int] | None) -> str | list[int] | None:
    """The ``aux_layers`` setting a run's features are computed with: as given, or ``eagle3`` (EAGLE-3's default
    triple) when the recipe reads the EAGLE-3 features and none is given — the one place that default is decided
    (the run's dump, online training and the quickstart all ask here)."""
    return EAGLE3 if aux_layers is None and reads_eagle3_features(cfg) else aux_layers


def draft_arch(cfg: TrainConfig) -> Arch:
    """The draft architecture of ``cfg``: ``train.arch``, else its recipe's."""
    return cfg.arch or recipe_named(cfg.recipe).arch


def reads_eagle3_features(cfg: TrainConfig) -> bool:
    """Whether the draft reads auxiliary target layers (and, unless ``own_vocab`` says otherwise, predicts
    over a draft vocabulary)."""
    return reads_eagle3_of(cfg, recipe_named(cfg.recipe))


def has_own_vocab(cfg: TrainConfig) -> bool:
    """Whether the draft predicts over a draft vocabulary with its own head."""
    recipe = recipe_named(cfg.recipe)
    return own_vocab_of(cfg, recipe, cfg.arch or recipe.arch, reads_eagle3_of(cfg, recipe))
