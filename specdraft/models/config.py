"""Draft geometry: what a draft needs to rebuild itself from its own directory.

The attention geometry (heads, kv heads, head_dim, RoPE) is copied from the target's
config ("Cross-Attention Speculative Decoding" (Beagle) §4.1; EAGLE uses one decoder layer of the
target's shape), and is
saved as ``config.json`` beside the weights so a draft loads from its directory alone.

Features and vocabulary ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" §3; "SpecForge: A Flexible and Efficient Open-Source Training Framework for
Speculative Decoding" §2.4; docs/serving.md):
* ``aux_layers`` empty: the draft reads the target's last hidden state (d per token);
  otherwise the concatenated states of those target layers (HF ``output_hidden_states``
  indices: i = the state entering decoder layer i), projected by ``fc`` to d.
* ``draft_vocab_size`` None: the draft predicts over the target's whole vocabulary with the
  target's frozen lm_head; otherwise over a draft vocabulary of that size with its own
  trainable lm_head after a final norm (``d2t``/``t2d`` maps saved with the weights).

Block drafts ("DFlash: Block Diffusion for Flash Speculative Decoding" §3-4, arch ``dflash``):
``num_layers`` decoder layers fill a block of ``block_size`` positions — the anchor token, then
``block_size - 1`` copies of ``mask_token_id`` (a target token id: its frozen embedding is the mask)
— in one forward, conditioned on the auxiliary target layers; a final norm always precedes the
output head. ``block_self_attention`` False is the Beagle-style variant (``beagle-dflash``): the
block's positions attend to the target's context states only, never to each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Arch = Literal["beagle", "eagle", "eagle3", "dflash"]


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
    num_layers: int = 1  # dflash: decoder layers (the other drafts are one layer)
    block_size: int = 16  # dflash: positions per drafted block (anchor + block_size - 1 masks)
    mask_token_id: int | None = None  # dflash: the target token id whose frozen embedding fills masked positions
    block_self_attention: bool = True  # dflash: block positions attend to each other (False: context only)

    def __post_init__(self) -> None:
        assert self.arch in ("beagle", "eagle", "eagle3", "dflash"), f"unknown draft arch {self.arch!r}"
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
        if self.arch == "dflash":
            assert self.aux_layers, "a dflash draft reads auxiliary target layers: aux_layers must not be empty"
            assert self.num_layers >= 1, f"num_layers={self.num_layers}: a dflash draft has at least one layer"
            assert self.block_size >= 2, f"block_size={self.block_size}: a block is the anchor plus >= 1 mask"
            assert self.mask_token_id is not None and 0 <= self.mask_token_id < self.vocab_size, (
                f"mask_token_id={self.mask_token_id}: a dflash draft needs a target token id in [0, {self.vocab_size})"
            )
        else:
            assert self.num_layers == 1, f"num_layers={self.num_layers}: only dflash drafts have several layers"

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
    def reads_parent_states(self) -> bool:
        """Whether a drafted node's input reads its parent's predicted state (the EAGLE family's slots);
        Beagle's queries read only their tokens, so drafting need not keep predicted states for it."""
        return self.arch in ("eagle", "eagle3")

    @property
    def drafts_blocks(self) -> bool:
        """Whether the draft fills whole blocks in one forward (block drafts), not one token per query."""
        return self.arch == "dflash"

    @property
    def head_norm(self) -> bool:
        """Whether a final norm precedes the output head (an own head, and every block draft)."""
        return self.own_vocab or self.drafts_blocks

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
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    block_self_attention: bool = True,
) -> DraftConfig:
    """Derive a draft's geometry from a transformers target config (Llama/Qwen2/Qwen3/Mistral).

    ``mask_token_id`` (dflash) None: the target's ``pad_token_id`` when it has one, else its last
    vocabulary id (an unused row in Llama-3's and Qwen's tables)."""
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
        **(dict(num_layers=num_layers, block_size=block_size, block_self_attention=block_self_attention,
                mask_token_id=default_mask_token(cfg) if mask_token_id is None else mask_token_id)
           if arch == "dflash" else {}),
    )


def default_mask_token(cfg: Any) -> int:
    """The mask token a block draft uses when none is given: the target's pad token, else its last id."""
    pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return int(pad) if pad is not None and 0 <= int(pad) < cfg.vocab_size else int(cfg.vocab_size) - 1
