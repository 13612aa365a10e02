"""Training recipes: the table ``train.recipe`` picks from (``RECIPES``).

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

``RECIPES`` is the one place a recipe is added. ``TrainConfig`` (``specdraft.configs.train``, the ``train``
section of the configs) chooses a recipe and overrides its parts; ``specdraft.plan`` resolves what a run
trains from the two — checked on the driver before any worker starts. This module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdraft.config import ConfigError
from specdraft.configs.draft import Arch
from specdraft.configs.stages import LossWeights, StageConfig

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
    if not total >= stages >= 1:
        raise ConfigError(f"epochs={total}: {total} epochs cannot cover {stages} stages")
    return [total // stages + (1 if i < total % stages else 0) for i in range(stages)]
