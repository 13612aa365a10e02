"""A training stage's settings ("Cross-Attention Speculative Decoding" (Beagle) §4.2; HASS §3.2; EAGLE-3 §3;
DFlash §4.2): its kind, epochs, windows and steps, and its loss weights. What each kind trains is
``specdraft/objectives.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdraft.config import ConfigError

StageKind = Literal["plain", "early", "late", "align", "ttt", "block"]
CHAINED = ("late", "align", "ttt")  # stages whose later steps read earlier steps' outputs


@dataclass(frozen=True, kw_only=True, slots=True)
class LossWeights:
    ce: float = 1.0
    topk: float = 0.0
    vloss: float = 0.0
    topk_k: int = 10  # K when the batch carries no stored top-K (or the draft has its own vocabulary)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageConfig:
    kind: StageKind = "plain"
    epochs: int = 1
    window: int = 5  # early: k
    steps: int = 4  # late: s (windows of s); align: n; ttt: k
    step_decay: float = 1.0  # align/ttt: weight of step j is step_decay ** (j - 1); block: of depth k, ** (k - 1)
    anchors: int = 512  # block: blocks (anchors) drawn per sequence and batch
    # ttt: recompute each sub-step's decoder layer in the backward instead of keeping its
    # activations (activation checkpointing): one more layer forward per sub-step, and the chain then
    # keeps per step only its states' encodings and head inputs
    recompute: bool = False
    noise_std: float = 0.2  # Gaussian noise on the true input states (0 disables)
    loss: LossWeights = field(default_factory=LossWeights)

    def __post_init__(self) -> None:
        if self.kind not in ("plain", "early", "late", "align", "ttt", "block"):
            raise ConfigError(f"kind: unknown stage kind {self.kind!r}; known: plain, early, late, align, ttt, block")
        for name in ("window", "steps", "anchors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.epochs < 0:
            raise ConfigError(f"epochs={self.epochs}: must be >= 0")

    @property
    def period(self) -> int:
        """Window length whose random offset eps is drawn per batch (1 = no offset)."""
        return {"early": self.window, "late": self.steps}.get(self.kind, 1)

    @property
    def num_substeps(self) -> int:
        return self.steps if self.kind in CHAINED else 1
