"""How the feature-store reader batches a store (``specdraft/store/reader.py``): token budget, split, order,
prefetch and what a corrupt chunk does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdraft.config import ConfigError

ON_CORRUPT = ("error", "skip")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReaderConfig:
    max_tokens: int = 16384  # padded tokens per batch (B * T); a longer sequence gets a batch of its own
    max_length: int | None = None  # sequences are truncated to this many tokens (>= 2: a token and the next)
    max_batch_size: int | None = None
    val_fraction: float = 0.0  # fraction of sample ids held out (by hash) for validation
    seed: int = 0
    shuffle: bool = True  # False: batches in length order, same every epoch
    bucket_size: int = 1024  # sequences sorted by length within windows of this many
    prefetch: int = 2  # batches read ahead on a background thread (0: read in the consumer's thread)
    # a chunk that fails its checksum or is missing: "error" (StoreError naming store, shard, array and
    # chunk) or "skip" (the sequences it holds are skipped, their loss masked out, and counted)
    on_corrupt: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        if self.on_corrupt not in ON_CORRUPT:
            raise ConfigError(f"reader.on_corrupt={self.on_corrupt!r} not in {ON_CORRUPT}")
        for name in ("max_tokens", "bucket_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_length is not None and self.max_length < 2:  # a draft learns a position from its next token
            raise ConfigError(f"max_length={self.max_length}: must be >= 2 (a sequence of one token predicts nothing)")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"val_fraction={self.val_fraction}: must be in [0, 1)")
        if self.prefetch < 0:
            raise ConfigError(f"prefetch={self.prefetch}: must be >= 0")
