"""Draft geometry: what a draft needs to rebuild itself from its own directory (saved as its ``config.json``).

The attention geometry (heads, kv heads, head_dim, RoPE) is copied from the target's
config ("Cross-Attention Speculative Decoding" (Beagle) §4.1; EAGLE uses one decoder layer of the
target's shape). Features and vocabulary ("EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test" §3; SpecForge §2.4):
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

from specdraft.config import ConfigError

Arch = Literal["beagle", "eagle", "eagle3", "dflash"]
DEFAULT_BLOCK_SIZE = 16  # DFlash App. A.1: blocks of 16 (the anchor and 15 masks)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


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
    target_fingerprint: str = ""  # specdraft.targets.identity.target_fingerprint of the target it was trained on ("": before fingerprints)
    target_hidden_size: int | None = None  # None: hidden_size
    aux_layers: list[int] = field(default_factory=list)  # HF hidden_states indices; empty: last hidden state
    draft_vocab_size: int | None = None  # None: the target's vocabulary and frozen lm_head
    norm_before_residual: bool = False  # eagle3: residual from hidden_norm(feature) instead of the feature
    legacy: bool = False  # eagle: specdraft 0.1 layout (RMSNorm on the fc output, zero-state slot at 0)
    num_layers: int = 1  # dflash: decoder layers (the other drafts are one layer)
    block_size: int = DEFAULT_BLOCK_SIZE  # dflash: positions per drafted block (anchor + block_size - 1 masks)
    mask_token_id: int | None = None  # dflash: the target token id whose frozen embedding fills masked positions
    block_self_attention: bool = True  # dflash: block positions attend to each other (False: context only)

    def __post_init__(self) -> None:
        _check(self.arch in ("beagle", "eagle", "eagle3", "dflash"), f"unknown draft arch {self.arch!r}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, (
            f"num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={self.num_key_value_heads}"
        ))
        if self.arch == "eagle3":
            _check(self.aux_layers, "an eagle3 draft reads auxiliary target layers: aux_layers must not be empty")
            _check(self.draft_vocab_size, "an eagle3 draft needs draft_vocab_size (its own lm_head)")
        if self.arch == "eagle":
            _check(not self.aux_layers and self.draft_vocab_size is None, (
                "an eagle (EAGLE-1/2) draft reads the last hidden state with the target's lm_head; "
                "use arch eagle3 for auxiliary layers or a draft vocabulary"
            ))
        if self.draft_vocab_size is not None:
            _check(1 <= self.draft_vocab_size <= self.vocab_size, (
                f"draft_vocab_size {self.draft_vocab_size} outside [1, vocab_size={self.vocab_size}]"
            ))
        _check(self.aux_layers or self.feature_size == self.hidden_size, (
            "without aux_layers the draft reads the target's last hidden state, so target_hidden_size must equal "
            f"hidden_size ({self.target_hidden_size} != {self.hidden_size})"
        ))
        _check(not self.legacy or self.arch == "eagle", "legacy applies to eagle drafts only")
        if self.arch == "dflash":
            _check(self.aux_layers, "a dflash draft reads auxiliary target layers: aux_layers must not be empty")
            _check(self.num_layers >= 1, f"num_layers={self.num_layers}: a dflash draft has at least one layer")
            _check(self.block_size >= 2, f"block_size={self.block_size}: a block is the anchor plus >= 1 mask")
            _check(self.mask_token_id is not None and 0 <= self.mask_token_id < self.vocab_size, (
                f"mask_token_id={self.mask_token_id}: a dflash draft needs a target token id in [0, {self.vocab_size})")
            )
        else:
            _check(self.num_layers == 1, f"num_layers={self.num_layers}: only dflash drafts have several layers")

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
