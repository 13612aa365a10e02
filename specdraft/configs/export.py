"""The choices of an export for a serving engine (``specdraft export``, the register stage's ``register.serving``):
the written dtype, K and the verifier a speculators config names. The writers are ``specdraft/export/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdraft.config import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportConfig:
    """The choices of an export (``specdraft export``, the register stage's ``register.serving``)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # of the written tensors; None: the target's
    # K drafted per step: the speculators proposal and the printed serve commands (None: 3; a block draft: its
    # block's block_size - 1 masked positions)
    speculative_tokens: int | None = None
    verifier: str = ""  # how engines find the target in a speculators config (hub id or path); empty: its path

    def __post_init__(self) -> None:
        if self.speculative_tokens is not None and self.speculative_tokens < 1:
            raise ConfigError(f"speculative_tokens={self.speculative_tokens}: must be >= 1 (or null)")
