"""Training recipes and the training config that picks one.

A recipe names a draft architecture, whether it reads the EAGLE-3 features (auxiliary target layers
and a draft vocabulary), and its stage schedule with the losses and default epochs of each stage:

* ``beagle``: "Cross-Attention Speculative Decoding" (Beagle), §4.2 — the early stage
  (k-step windows) then the late stage (s chained steps), vloss coefficient 10 (App. A.3);
  ``beagle-early`` the early stage alone, ``beagle-topk`` both stages with HASS's top-K distillation.
* ``eagle``: "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", §3 — one plain stage.
* ``hass``: "Learning Harmonized Representations for Speculative Sampling" (HASS), §3 — harmonized
  context alignment over 3 steps with top-K distillation, on the EAGLE draft.
* ``eagle3``: "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
  Test", §3 — training-time test over 7 steps, step weights 0.8^(j-1), ce over the draft vocabulary;
  ``eagle3-hass`` HASS's alignment on the EAGLE-3 draft; ``beagle3`` Beagle's two stages with
  cross-attention keys/values from the fused EAGLE-3 features.
* ``dflash``: "DFlash: Block Diffusion for Flash Speculative Decoding", §3-4 and App. A.1 — a 5-layer
  block draft over auxiliary target layers with the target's frozen head, trained on blocks of 16 from
  512 anchors per sequence, depth weights exp(-(k-1)/7) (Eq. 4), soft cross-entropy against the
  target's distribution; ``beagle-dflash`` the same draft and training with Beagle's cross-attention
  ("Cross-Attention Speculative Decoding" §4.1): block positions attend to the target's states only.

``RECIPES`` is the one place a recipe is added. ``TrainConfig`` (the ``train`` section of the
configs) chooses a recipe and overrides its parts; ``TrainConfig.resolved`` gives the draft
architecture and stage schedule a run trains — checked on the driver before any worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from specdraft.config import ConfigError
from specdraft.features import FeaturesConfig
from specdraft.models.config import Arch
from specdraft.objectives import LossWeights, StageConfig
from specdraft.store import ReaderConfig
from specdraft.training import OptimConfig
from specdraft.vocab import DEFAULT_DRAFT_VOCAB

_PAPER_LOSS = LossWeights(ce=1.0, vloss=10.0)  # Beagle App. A.3: vloss coefficient 10
_HASS_LOSS = LossWeights(ce=1.0, topk=1.0, vloss=10.0)
# DFlash §4.2 Eq. 4 and App. A.1: 512 anchors per sequence, depth k weighted exp(-(k-1)/gamma), gamma = 7 for blocks
# of 16 (5 for 10, 4 for 8); soft cross-entropy against the target's distribution (the paper's hard labels are the
# target's own sampled tokens: a one-sample estimate of the same objective)
_DFLASH_STAGE = StageConfig(kind="block", epochs=20, anchors=512, step_decay=math.exp(-1 / 7), noise_std=0.0,
                            loss=LossWeights(ce=1.0))


@dataclass(frozen=True, slots=True)
class Recipe:
    """A draft architecture, whether it reads the EAGLE-3 features (auxiliary target layers, a draft
    vocabulary), and its stage schedule (kinds, losses, default epochs)."""

    arch: Arch
    eagle3_features: bool
    stages: list[StageConfig]
    own_vocab: bool | None = None  # a draft vocabulary with its own head (None: as eagle3_features)
    draft_layers: int = 1  # decoder layers (block drafts)
    block_self_attention: bool = True  # block drafts: block positions attend to each other


RECIPES: dict[str, Recipe] = {
    "beagle": Recipe("beagle", False, [
        StageConfig(kind="early", epochs=10, window=5, noise_std=0.2, loss=_PAPER_LOSS),
        StageConfig(kind="late", epochs=10, steps=4, noise_std=0.2, loss=_PAPER_LOSS),
    ]),
    "beagle-early": Recipe("beagle", False, [
        StageConfig(kind="early", epochs=10, window=5, noise_std=0.2, loss=_PAPER_LOSS),
    ]),
    "beagle-topk": Recipe("beagle", False, [
        StageConfig(kind="early", epochs=10, window=5, noise_std=0.2, loss=_HASS_LOSS),
        StageConfig(kind="late", epochs=10, steps=4, noise_std=0.2, loss=_HASS_LOSS),
    ]),
    "eagle": Recipe("eagle", False, [StageConfig(kind="plain", epochs=20, noise_std=0.2, loss=_PAPER_LOSS)]),
    "hass": Recipe("eagle", False, [StageConfig(kind="align", epochs=20, steps=3, noise_std=0.2, loss=_HASS_LOSS)]),
    # EAGLE-3 (SpecForge §2.4): training-time test over 7 steps, weights 0.8^(j-1), ce over the draft vocabulary
    "eagle3": Recipe("eagle3", True, [
        StageConfig(kind="ttt", epochs=20, steps=7, step_decay=0.8, noise_std=0.0, loss=LossWeights(ce=1.0)),
    ]),
    # HASS on the EAGLE-3 draft: harmonized context alignment (detached, per step) + top-K distillation
    "eagle3-hass": Recipe("eagle3", True, [
        StageConfig(kind="align", epochs=20, steps=3, noise_std=0.0, loss=LossWeights(ce=1.0, topk=1.0)),
    ]),
    # Beagle's two-stage training with cross-attention keys/values from the fused EAGLE-3 features
    "beagle3": Recipe("beagle", True, [
        StageConfig(kind="early", epochs=10, window=5, noise_std=0.0, loss=LossWeights(ce=1.0)),
        StageConfig(kind="late", epochs=10, steps=4, noise_std=0.0, loss=LossWeights(ce=1.0)),
    ]),
    # DFlash: a block draft of 5 layers over the auxiliary target layers, the target's frozen head (the paper's)
    "dflash": Recipe("dflash", True, [_DFLASH_STAGE], own_vocab=False, draft_layers=5),
    # Beagle's cross-attention in the block draft: block positions see the target's states, never each other
    "beagle-dflash": Recipe("dflash", True, [_DFLASH_STAGE], own_vocab=False, draft_layers=5,
                            block_self_attention=False),
}


def split_epochs(total: int, stages: int) -> list[int]:
    """``total`` epochs over ``stages`` stages as evenly as possible (earlier stages take the rest)."""
    assert total >= stages >= 1, f"{total} epochs cannot cover {stages} stages"
    return [total // stages + (1 if i < total % stages else 0) for i in range(stages)]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalingSection:
    # 0: Ray Train's local mode — the training loop runs in this process, without worker actors (a
    # laptop, a debugger, a quick check); its checkpoints are not kept for a rerun, which starts over
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    strategy: Literal["ddp", "fsdp"] = "ddp"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    # the default, beagle3 (Beagle's two stages over EAGLE-3 features), wins the held-out benchmark
    # (benchmarks/results/train_quality_cpu.json) and vLLM serves it with specdraft's plugin; it reads
    # stores dumped with aux_layers (specdraft dump ... aux_layers=eagle3)
    recipe: str = "beagle3"
    arch: Arch | None = None  # None: the recipe's draft
    stages: list[StageConfig] | None = None  # None: the recipe's stages
    # epochs: one number is the total, split over the recipe's stages (earlier stages take the rest), so it
    # fits any recipe; a list gives one count per stage; None: the recipe's own
    epochs: int | list[int] | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    reader: ReaderConfig = field(default_factory=lambda: ReaderConfig(val_fraction=0.05))
    intermediate_size: int | None = None  # draft MLP width (None: the target's)
    min_steps: int = 300  # small stores: batches shrink (down to one sequence) until the run has this many steps
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB  # EAGLE-3 features: the most frequent predicted tokens
    draft_vocab: bool | None = None  # None: the recipe's (EAGLE-3 recipes: own head; dflash: the target's frozen head)
    draft_layers: int | None = None  # block drafts: decoder layers (None: the recipe's, dflash 5)
    block_size: int = 16  # block drafts: positions per block (anchor + block_size - 1 masks); serve with K = block_size - 1
    mask_token_id: int | None = None  # block drafts: target token whose embedding is the mask (None: pad token, else last id)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on GPU (fp32 master weights)
    loss_chunk: int = 1024  # rows per output-head chunk
    # ttt stages: recompute each sub-step's decoder layer in the backward (activation checkpointing):
    # ~one more layer forward per sub-step for a chain that keeps only its states' encodings per step
    recompute: bool = False
    seed: int = 0
    checkpoint_every: int = 500  # optimizer steps between checkpoints (epoch ends always checkpoint)
    keep_checkpoints: int = 2
    sim_depth: int = 5
    val_max_batches: int = 64
    log_every: int = 20
    max_failures: int = 0
    scaling: ScalingSection = field(default_factory=ScalingSection)
    # offline: read feature stores; online: every worker runs the target on each batch (no store)
    features: Literal["offline", "online"] = "offline"
    conversations: list[str] = field(default_factory=list)  # online: conversation files/dirs, as `specdraft dump` reads
    # online: tokenization and target forward, as a dump with these settings would store them (max_length,
    # overlong, topk, hidden_codec rounding, aux_layers — EAGLE-3 recipes: None means eagle3 —, dtype,
    # logits_chunk, attn_implementation, trust_remote_code)
    online: FeaturesConfig = field(default_factory=FeaturesConfig)
    # warm start (issue 33): a draft directory of the same architecture whose weights and draft vocabulary (d2t/t2d,
    # kept as they are) the run starts from; "" trains from scratch; `specdraft run`: "champion", the registered one
    init_from: str = ""
    # the warm start's vocabulary must cover this share of the new data's predicted tokens, else the run falls back
    # to a fresh vocabulary and fresh weights (and says so)
    init_min_coverage: float = 0.9

    def __post_init__(self) -> None:
        """Every check that needs no file: a bad key or value is a ``ConfigError`` naming it, raised when the
        config is loaded (before any cluster, model or data), so a run never fails on it after the expensive part."""
        if self.recipe not in RECIPES and not self.stages:
            raise ConfigError(f"recipe: unknown recipe {self.recipe!r}; known: {sorted(RECIPES)}")
        if self.features not in ("offline", "online"):
            raise ConfigError(f"features: must be offline or online, got {self.features!r}")
        for name in ("sim_depth", "val_max_batches", "log_every", "keep_checkpoints", "loss_chunk", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("min_steps", "checkpoint_every", "max_failures"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: a block is the anchor plus at least one mask")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"draft_layers={self.draft_layers}: must be >= 1")
        if not 0.0 <= self.init_min_coverage <= 1.0:
            raise ConfigError(f"init_min_coverage={self.init_min_coverage}: must be between 0 and 1")
        if self.scaling.num_workers < 0:
            raise ConfigError(f"scaling.num_workers={self.scaling.num_workers}: 0 (in this process) or more workers")
        self.resolved()  # the epoch counts against the recipe's stages

    def resolved(self) -> tuple[Arch, list[StageConfig]]:
        """(draft architecture, stage schedule): the recipe's, with this config's overrides applied."""
        recipe = RECIPES.get(self.recipe, Recipe("beagle", False, []))
        arch = self.arch or recipe.arch
        stages = list(self.stages) if self.stages else list(recipe.stages)
        kinds = ", ".join(s.kind for s in stages)
        epochs = self.epochs
        if isinstance(epochs, int):  # the total over the stages
            if epochs < len(stages):
                raise ConfigError(f"epochs={epochs}: a total of {epochs} cannot give each of the {len(stages)} stage(s) "
                                  f"of recipe {self.recipe!r} ({kinds}) an epoch; give at least {len(stages)}, or one "
                                  f"count per stage as a list")
            epochs = split_epochs(epochs, len(stages))
        if epochs is not None:
            if len(epochs) != len(stages):
                raise ConfigError(f"epochs={epochs}: recipe {self.recipe!r} has {len(stages)} stage(s) ({kinds}): give "
                                  f"one epoch count per stage, or one number: the total, split over the stages")
            if any(e < 0 for e in epochs):
                raise ConfigError(f"epochs={epochs}: an epoch count must be >= 0")
            stages = [replace(s, epochs=e) for s, e in zip(stages, epochs)]
        if sum(s.epochs for s in stages) == 0:  # no step would run: the "draft" would be its initial weights
            raise ConfigError(f"{'epochs' if self.epochs is not None else 'stages'}="
                              f"{[s.epochs for s in stages]}: no stage trains (every epoch count is 0)")
        if self.recompute:
            stages = [replace(s, recompute=True) for s in stages]
        return arch, stages

    @property
    def eagle3_features(self) -> bool:
        """Whether the draft reads auxiliary target layers (and, unless ``own_vocab`` says otherwise, predicts
        over a draft vocabulary)."""
        recipe = RECIPES.get(self.recipe)
        return self.arch in ("eagle3", "dflash") or (recipe is not None and recipe.eagle3_features)

    @property
    def own_vocab(self) -> bool:
        """Whether the draft predicts over a draft vocabulary with its own head."""
        if self.resolved()[0] == "eagle3":
            return True
        if self.draft_vocab is not None:
            return self.draft_vocab
        recipe = RECIPES.get(self.recipe)
        own = recipe.own_vocab if recipe is not None else None
        return self.eagle3_features if own is None else own

    def draft_shape(self) -> dict[str, Any]:
        """The block-draft fields of ``draft_config_from_target`` (empty for the one-layer drafts)."""
        if self.resolved()[0] != "dflash":
            return {}
        recipe = RECIPES.get(self.recipe, Recipe("dflash", True, []))
        return {"num_layers": self.draft_layers or recipe.draft_layers, "block_size": self.block_size,
                "mask_token_id": self.mask_token_id, "block_self_attention": recipe.block_self_attention}
