"""Decoding settings: token choice (temperature, top-k, top-p; "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees" §2), the speculative loop's chain or EAGLE-2 tree (§4), and the prompt-lookup floor
(Saxena 2023). The algorithms are in ``specdraft/decoding/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdraft.config import ConfigError

Mode = Literal["chain", "tree"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeConfig:
    mode: Mode = "tree"
    gamma: int = 5  # chain: draft tokens per round
    depth: int = 6  # tree: drafted levels
    topk: int = 10  # tree: children per expanded node and nodes expanded per level
    total_tokens: int = 60  # tree: drafted nodes kept after reranking (root excluded)
    concate: bool = True  # Beagle: append drafted states to the draft cache
    temperature: float = 0.0
    top_k: int = 0  # sampling warper (0 = off)
    top_p: float = 1.0  # sampling warper (1 = off)
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        if self.mode not in ("chain", "tree"):
            raise ConfigError(f"mode: must be 'chain' or 'tree', got {self.mode!r}")
        for name in ("gamma", "depth", "topk", "total_tokens", "max_new_tokens"):  # each drafts or emits >= 1 token
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def max_depth(self) -> int:
        return self.gamma if self.mode == "chain" else self.depth

    @property
    def max_nodes(self) -> int:
        """The most tree nodes a round verifies (root included)."""
        return 1 + (self.gamma if self.mode == "chain" else self.total_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptLookupConfig:
    enabled: bool = True  # evaluation: also measure the PLD floor (one more generation per turn)
    gamma: int | None = None  # tokens proposed per round; None: the draft's max depth (chain γ / tree depth)
    max_ngram: int = 3  # longest suffix n-gram matched
    min_ngram: int = 1  # shortest suffix n-gram matched

    def __post_init__(self) -> None:
        if self.gamma is not None and self.gamma < 1:
            raise ConfigError(f"gamma={self.gamma}: must be >= 1 (or null: the draft's max depth)")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}: need 1 <= min_ngram <= max_ngram")

    def resolved_gamma(self, decode: DecodeConfig) -> int:
        return self.gamma if self.gamma is not None else decode.max_depth
