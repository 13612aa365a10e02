"""Draft geometry: what a draft needs to rebuild itself from its own directory.

The attention geometry (heads, kv heads, head_dim, RoPE) is copied from the target's
config ("Cross-Attention Speculative Decoding" (Beagle) §4.1; EAGLE uses one decoder layer of the
target's shape), and is
saved as ``config.json`` beside the weights so a draft loads from its directory alone.

Features and vocabulary ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" §3; "SpecForge: A Flexible and Efficient Open-Source Training Framework for
Speculative Decoding" §2.4; README "Serving a draft"):
* ``aux_layers`` empty: the draft reads the target's last hidden state (d per token);
  otherwise the concatenated states of those target layers (HF ``output_hidden_states``
  indices: i = the state entering decoder layer i), projected by ``fc`` to d.
* ``draft_vocab_size`` None: the draft predicts over the target's whole vocabulary with the
  target's frozen lm_head; otherwise over a draft vocabulary of that size with its own
  trainable lm_head after a final norm (``d2t``/``t2d`` maps saved with the weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Arch = Literal["beagle", "eagle", "eagle3"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DraftConfig:
    arch: Arch
    vocab_size: int  # the target's vocabulary (token ids the draft reads and emits)
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    target_id: str = ""
    target_fingerprint: str = ""  # specdraft.target.target_fingerprint of the target it was trained on ("": before fingerprints)
    target_hidden_size: int | None = None  # None: hidden_size
    aux_layers: list[int] = field(default_factory=list)  # HF hidden_states indices; empty: last hidden state
    draft_vocab_size: int | None = None  # None: the target's vocabulary and frozen lm_head
    norm_before_residual: bool = False  # eagle3: residual from hidden_norm(feature) instead of the feature
    legacy: bool = False  # eagle: specdraft 0.1 layout (RMSNorm on the fc output, zero-state slot at 0)

    def __post_init__(self) -> None:
        assert self.arch in ("beagle", "eagle", "eagle3"), f"unknown draft arch {self.arch!r}"
        assert self.num_attention_heads % self.num_key_value_heads == 0, (
            f"num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={self.num_key_value_heads}"
        )
        if self.arch == "eagle3":
            assert self.aux_layers, "an eagle3 draft reads auxiliary target layers: aux_layers must not be empty"
            assert self.draft_vocab_size, "an eagle3 draft needs draft_vocab_size (its own lm_head)"
        if self.arch == "eagle":
            assert not self.aux_layers and self.draft_vocab_size is None, (
                "an eagle (EAGLE-1/2) draft reads the last hidden state with the target's lm_head; "
                "use arch eagle3 for auxiliary layers or a draft vocabulary"
            )
        if self.draft_vocab_size is not None:
            assert 1 <= self.draft_vocab_size <= self.vocab_size, (
                f"draft_vocab_size {self.draft_vocab_size} outside [1, vocab_size={self.vocab_size}]"
            )
        assert self.aux_layers or self.feature_size == self.hidden_size, (
            "without aux_layers the draft reads the target's last hidden state, so target_hidden_size must equal "
            f"hidden_size ({self.target_hidden_size} != {self.hidden_size})"
        )
        assert not self.legacy or self.arch == "eagle", "legacy applies to eagle drafts only"

    @property
    def feature_size(self) -> int:
        """Width of the per-token target features the draft reads."""
        width = self.target_hidden_size or self.hidden_size
        return width * len(self.aux_layers) if self.aux_layers else width

    @property
    def needs_root_state(self) -> bool:
        """Self-attention drafts over slots (EAGLE family): a chain needs a true root slot, i.e. a true
        state before it, so a query whose true cutoff is 0 has no input and is never trained."""
        return self.arch in ("eagle", "eagle3") and not self.legacy

    @property
    def own_vocab(self) -> bool:
        """Whether the draft has its own (trainable) lm_head over a draft vocabulary."""
        return self.draft_vocab_size is not None

    @property
    def output_vocab_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size


def draft_config_from_target(
    target_config: Any,
    arch: Arch,
    *,
    intermediate_size: int | None = None,
    target_id: str = "",
    target_fingerprint: str = "",
    aux_layers: list[int] | None = None,
    draft_vocab_size: int | None = None,
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
        target_fingerprint=target_fingerprint,
        target_hidden_size=cfg.hidden_size,
        aux_layers=list(aux_layers or []),
        draft_vocab_size=draft_vocab_size,
    )
