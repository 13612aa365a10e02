"""Draft geometry: what a draft needs to rebuild itself from its own directory.

The attention geometry (heads, kv heads, head_dim, RoPE) is copied from the target's
config (Beagle paper §4.1; EAGLE uses one decoder layer of the target's shape), and is
saved as ``config.json`` beside the weights so a draft loads from its directory alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Arch = Literal["beagle", "eagle"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DraftConfig:
    arch: Arch
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    target_id: str = ""

    def __post_init__(self) -> None:
        assert self.arch in ("beagle", "eagle"), f"unknown draft arch {self.arch!r}"
        assert self.num_attention_heads % self.num_key_value_heads == 0, (
            f"num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={self.num_key_value_heads}"
        )


def draft_config_from_target(
    target_config: Any, arch: Arch, *, intermediate_size: int | None = None, target_id: str = ""
) -> DraftConfig:
    """Derive a draft's geometry from a transformers target config (Llama/Qwen2/Qwen3/Mistral)."""
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = getattr(cfg, "rope_parameters", None)
    if not rope:
        rope = {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_theta", 10000.0))}
        if getattr(cfg, "rope_scaling", None):
            rope.update(cfg.rope_scaling)
    return DraftConfig(
        arch=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
        rope_parameters=dict(rope),
        target_id=target_id,
    )
