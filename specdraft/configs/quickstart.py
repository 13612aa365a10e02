"""The quickstart's settings (``specdraft quickstart``, ``specdraft/quickstart.py``): the toy target, the recipe and
its epochs, the in-memory features and the optimizer of a short run on one CPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdraft.config import ConfigError
from specdraft.configs.toy import ToyTargetConfig
from specdraft.configs.train import OptimConfig, TrainConfig
from specdraft.configs.recipes import RECIPES


@dataclass(frozen=True, kw_only=True, slots=True)
class QuickstartConfig:
    seed: int = 0
    toy: ToyTargetConfig = field(default_factory=ToyTargetConfig)
    recipe: str = "beagle"  # a recipe of specdraft.configs.recipes
    # the target layers an EAGLE-3 recipe reads (as the dump's features.aux_layers; None: eagle3)
    aux_layers: Literal["eagle3"] | list[int] | None = None
    epochs: int = 5  # in all, split over the recipe's stages (earlier stages take the rest)
    num_train: int = 768
    num_eval: int = 96
    max_length: int = 192
    topk: int = 10
    batch_size: int = 16
    depth: int = 5  # simulated chain depth for alpha_i
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1)
    )

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ConfigError(f"recipe: unknown recipe {self.recipe!r}; known: {sorted(RECIPES)}")
        if self.epochs < len(RECIPES[self.recipe].stages):
            raise ConfigError(f"epochs={self.epochs}: at least one per stage of recipe {self.recipe!r}")

    def train_config(self) -> TrainConfig:
        """The ``train`` config of this run: the recipe, its epochs shortened, this optimizer and seed."""
        return TrainConfig(recipe=self.recipe, epochs=self.epochs, optim=self.optim,  # the total, split over the stages
                           min_steps=0, seed=self.seed)  # batches of batch_size sequences: not fitted
