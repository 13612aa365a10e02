"""A draft's training settings (the ``train`` section): the recipe and its overrides, the optimizer, the
reader, the draft's shape and, for online features, the feature settings. What a run of them trains (the
architecture, the stage schedule with its epochs, the draft's shape and vocabulary) is resolved once by
``specdraft.plan``; the Ray side (workers, GPUs, checkpoints, failures) is
``pipelines.configs.ClusterTrainConfig``. Schedules: Beagle §4.2 and App. A.3; HASS §3; EAGLE-3 §3; DFlash §4."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from specdraft.config import ConfigError
from specdraft.configs.draft import DEFAULT_BLOCK_SIZE, Arch
from specdraft.configs.features import FeaturesConfig
from specdraft.configs.reader import ReaderConfig
from specdraft.configs.stages import StageConfig
from specdraft.configs.recipes import RECIPES, Recipe, recipe_named

DEFAULT_DRAFT_VOCAB = 32000


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """Defaults that learn on the data given: the warmup is a fraction of the run's optimizer steps
    (capped at the papers' 2000), then cosine decay. Long runs on large stores often prefer a lower
    peak lr (EAGLE/HASS 3e-5, SpecForge 1e-4 over hundreds of thousands of steps)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # None: warmup_ratio of the run's optimizer steps, at most WARMUP_CAP
    warmup_ratio: float = 0.05
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 0.5
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio}: must be in [0, 1)")
        if self.grad_accum < 1:
            raise ConfigError(f"grad_accum={self.grad_accum}: must be >= 1")


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
    block_size: int = DEFAULT_BLOCK_SIZE  # block drafts: positions per block (anchor + block_size - 1 masks); serve with K = block_size - 1
    mask_token_id: int | None = None  # block drafts: target token whose embedding is the mask (None: pad token, else last id)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on GPU (fp32 master weights)
    loss_chunk: int = 1024  # rows per output-head chunk
    # ttt stages: recompute each sub-step's decoder layer in the backward (activation checkpointing):
    # ~one more layer forward per sub-step for a chain that keeps only its states' encodings per step
    recompute: bool = False
    seed: int = 0
    sim_depth: int = 5
    val_max_batches: int = 64
    log_every: int = 20
    # offline: read feature stores; online: every worker runs the target on each batch (no store)
    features: Literal["offline", "online"] = "offline"
    conversations: list[str] = field(default_factory=list)  # online: conversation files/dirs, as `specdraft dump` reads
    # online: tokenization and target forward, as a dump with these settings would store them (max_length,
    # overlong, topk, hidden_codec rounding, aux_layers — EAGLE-3 recipes: None means eagle3 —, dtype,
    # logits_chunk, attn_implementation, trust_remote_code)
    online: FeaturesConfig = field(default_factory=FeaturesConfig)
    # warm start: a draft directory of the same architecture whose weights and draft vocabulary (d2t/t2d,
    # kept as they are) the run starts from; "" trains from scratch; `specdraft run`: "champion", the registered one
    init_from: str = ""
    # the warm start's vocabulary must cover this share of the new data's predicted tokens, else the run falls back
    # to a fresh vocabulary and fresh weights (and says so)
    init_min_coverage: float = 0.9
    # the epochs of a run that warm-starts (init_from resolved and its vocabulary kept), as `epochs` is given (a
    # total split over the stages, or one count per stage); None: a quarter of each stage's fresh epochs, rounded
    # up (WARM_SHARE; a run that does not warm-start trains `epochs`)
    warm_epochs: int | list[int] | None = None

    def __post_init__(self) -> None:
        """Every check that needs no file: a bad key or value is a ``ConfigError`` naming it, raised when the
        config is loaded (before any cluster, model or data), so a run never fails on it after the expensive part."""

        if self.recipe not in RECIPES and not self.stages:
            raise ConfigError(f"recipe: unknown recipe {self.recipe!r}; known: {sorted(RECIPES)}")
        if self.features not in ("offline", "online"):
            raise ConfigError(f"features: must be offline or online, got {self.features!r}")
        for name in ("sim_depth", "val_max_batches", "log_every", "loss_chunk", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.min_steps < 0:
            raise ConfigError(f"min_steps={self.min_steps}: must be >= 0")
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: a block is the anchor plus at least one mask")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ConfigError(f"draft_layers={self.draft_layers}: must be >= 1")
        if not 0.0 <= self.init_min_coverage <= 1.0:
            raise ConfigError(f"init_min_coverage={self.init_min_coverage}: must be between 0 and 1")
        if self.draft_vocab_size < 1:
            raise ConfigError(f"draft_vocab_size={self.draft_vocab_size}: must be >= 1")
        _check_draft_vocab(self)
        resolve_stages(self, warm=True)  # the epoch counts against the recipe's stages, then the warm start's

    def resolved(self) -> tuple[Arch, list[StageConfig]]:
        """(draft architecture, stage schedule): ``resolve_stages``."""
        return resolve_stages(self)


def reads_eagle3_of(cfg: TrainConfig, recipe: Recipe) -> bool:
    """Whether ``cfg`` (of ``recipe``, its row) trains a draft reading auxiliary target layers."""
    return cfg.arch in ("eagle3", "dflash") or recipe.eagle3_features


def own_vocab_of(cfg: TrainConfig, recipe: Recipe, arch: Arch, eagle3: bool) -> bool:
    """An EAGLE-3 draft always; else ``train.draft_vocab`` when set, the recipe's when it says, else as its
    features (a draft reading the EAGLE-3 features predicts over a draft vocabulary)."""
    if arch == "eagle3":
        return True
    if cfg.draft_vocab is not None:
        return cfg.draft_vocab
    return eagle3 if recipe.own_vocab is None else recipe.own_vocab


def _check_draft_vocab(cfg: TrainConfig) -> None:
    """A draft vocabulary (its own head) only where a draft carries one and vLLM serves it: the drafts that read
    the EAGLE-3 features (vLLM serves a reduced head on its EAGLE-3 path only, through ``d2t``; an EAGLE-1/2 or a
    Beagle draft over the last hidden state shares the target's lm_head there)."""
    recipe = recipe_named(cfg.recipe)
    arch = cfg.arch or recipe.arch
    eagle3 = reads_eagle3_of(cfg, recipe)
    if not own_vocab_of(cfg, recipe, arch, eagle3):
        return
    if eagle3 and arch == "eagle":
        raise ConfigError(f"arch={arch!r}: an EAGLE-1/2 draft reads the target's last hidden state with its lm_head; "
                          f"recipe {cfg.recipe!r} reads the EAGLE-3 features with a draft vocabulary: arch eagle3")
    if eagle3:
        return
    raise ConfigError(
        f"draft_vocab={cfg.draft_vocab}: recipe {cfg.recipe!r} trains a draft (arch {arch!r}) over the target's last "
        "hidden state, which predicts with the target's lm_head; a draft vocabulary needs a recipe that reads the "
        "EAGLE-3 features — vLLM serves a reduced head only on its EAGLE-3 path — (beagle3, eagle3, eagle3-hass for "
        "HASS's training), or leave draft_vocab unset")


WARM_SHARE = 0.25  # a warm start's default epochs: this share of each stage's fresh epochs (the goal: a warm night <= 40 %
# of from-scratch compute; a quarter leaves room for the replayed rows, data.traffic.replay 0.2 by default)


def resolve_stages(cfg: TrainConfig, *, warm: bool = False) -> tuple[Arch, list[StageConfig]]:
    """(draft architecture, stage schedule): the recipe's, with the config's overrides applied (``epochs`` a
    total split over the stages, or one count per stage; ``recompute``); a count that fits no schedule is a
    ``ConfigError`` naming ``epochs``. ``warm`` (the run warm-starts): ``warm_epochs`` instead, by default
    each stage's fresh epochs cut to ``warm_epochs`` (a quarter, rounded up)."""
    recipe = recipe_named(cfg.recipe)
    arch = cfg.arch or recipe.arch
    stages = list(cfg.stages) if cfg.stages else list(recipe.stages)
    stages = _with_epochs(cfg, stages, cfg.epochs, "epochs")
    if warm:
        given = cfg.warm_epochs is not None
        epochs = cfg.warm_epochs if given else [warm_epochs(s.epochs) for s in stages]
        stages = _with_epochs(cfg, stages, epochs, "warm_epochs" if given else "epochs")
    if cfg.recompute:
        stages = [replace(s, recompute=True) for s in stages]
    return arch, stages


def warm_epochs(fresh: int) -> int:
    """A stage's default epochs on a warm start: ``WARM_SHARE`` of its fresh epochs, rounded up (a stage that
    does not train stays at 0)."""
    return math.ceil(WARM_SHARE * fresh)


def _with_epochs(cfg: TrainConfig, stages: list[StageConfig], epochs: int | list[int] | None,
                 key: str) -> list[StageConfig]:
    """``stages`` with ``epochs`` (the setting ``key``: a total split over them, one count per stage, or None:
    theirs); a count that fits no schedule is a ``ConfigError`` naming ``key``."""
    kinds = ", ".join(s.kind for s in stages)
    if isinstance(epochs, int):  # the total over the stages
        if epochs < len(stages):
            raise ConfigError(f"{key}={epochs}: a total of {epochs} cannot give each of the {len(stages)} stage(s) "
                              f"of recipe {cfg.recipe!r} ({kinds}) an epoch; give at least {len(stages)}, or one "
                              f"count per stage as a list")
        epochs = split_epochs(epochs, len(stages))
    if epochs is not None:
        if len(epochs) != len(stages):
            raise ConfigError(f"{key}={epochs}: recipe {cfg.recipe!r} has {len(stages)} stage(s) ({kinds}): give "
                              f"one epoch count per stage, or one number: the total, split over the stages")
        if any(e < 0 for e in epochs):
            raise ConfigError(f"{key}={epochs}: an epoch count must be >= 0")
        stages = [replace(s, epochs=e) for s, e in zip(stages, epochs)]
    if sum(s.epochs for s in stages) == 0:  # no step would run: the "draft" would be its initial weights
        raise ConfigError(f"{key if epochs is not None else 'stages'}="
                          f"{[s.epochs for s in stages]}: no stage trains (every epoch count is 0)")
    return stages


def split_epochs(total: int, stages: int) -> list[int]:
    """``total`` epochs over ``stages`` stages as evenly as possible (earlier stages take the rest)."""
    if not total >= stages >= 1:
        raise ConfigError(f"epochs={total}: {total} epochs cannot cover {stages} stages")
    return [total // stages + (1 if i < total % stages else 0) for i in range(stages)]
