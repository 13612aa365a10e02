"""A draft's geometry from its target ("Cross-Attention Speculative Decoding" (Beagle) §4.1; EAGLE uses one decoder
layer of the target's shape): ``draft_config_from_target`` copies the attention geometry (heads, kv heads, head_dim,
RoPE) from the target's config, and ``default_mask_token`` picks a block draft's mask token ("DFlash: Block
Diffusion for Flash Speculative Decoding" §3). The settings class itself, ``DraftConfig`` (saved as ``config.json``
beside the weights, so a draft loads from its directory alone), is ``specdraft/configs/draft.py``.
"""

from __future__ import annotations

from typing import Any

from specdraft.configs.draft import DEFAULT_BLOCK_SIZE, Arch, DraftConfig



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
    block_size: int = DEFAULT_BLOCK_SIZE,
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
