"""The attention block every draft is built from: a Llama decoder layer's attention and MLP.

    y = residual + o_proj(Attn(q = rope(q_proj(a_q)), k = rope(k_proj(a_kv)), v = v_proj(a_kv)))
    h = y + MLP(mlp_norm(y))

The drafts differ only in what the projections read and in the residual:
* Beagle ("Cross-Attention Speculative Decoding" §4.1, Eq. 1-2): cross-attention — queries from the
  token's normed embedding, keys/values from normed states, the embedding as residual;
* EAGLE (the HASS base, "Learning Harmonized Representations for Speculative Sampling" §2, Fig. 2):
  self-attention over fused slots fc(cat(e(t_c), h_{c-1})), the slot as residual;
* EAGLE-3 ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
  Test" §3): self-attention over 2d-wide slots cat(norm(e(t_c)), norm(f_{c-1})), the feature as
  residual.

The block's weights are the draft's own, at its top level (``add_attention``): ``q_proj.weight``,
``mlp.up_proj.weight``, ... are the names of the serving engines' decoder layer, which saved drafts,
resume checkpoints and exports keep. So the block is two functions over a draft holding them
(``Block``), not a module of its own.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from specdraft.configs.draft import DraftConfig
from specdraft.models.layers import KV, Rotary, SwiGLU, attention, matmul_input


class Block(Protocol):
    """A draft holding the block's weights (``add_attention``, plus its ``mlp``)."""

    config: DraftConfig
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    rotary: Rotary
    mlp: SwiGLU


def add_attention(draft: nn.Module, config: DraftConfig, width: int) -> None:
    """Give ``draft`` the block's attention weights over inputs ``width`` wide (q/k/v/o projections,
    no bias) and the target's RoPE."""
    heads, kv_heads, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    draft.q_proj = nn.Linear(width, heads * dh, bias=False)
    draft.k_proj = nn.Linear(width, kv_heads * dh, bias=False)
    draft.v_proj = nn.Linear(width, kv_heads * dh, bias=False)
    draft.o_proj = nn.Linear(heads * dh, config.hidden_size, bias=False)
    draft.rotary = Rotary(
        head_dim=dh,
        num_heads=heads,
        rope_parameters=config.rope_parameters,
        max_position_embeddings=config.max_position_embeddings,
    )


def keys_values(block: Block, a: torch.Tensor, positions: torch.Tensor) -> KV:
    """Keys (RoPE at ``positions`` (B, S)) and values of the attention inputs ``a`` (B, S, A)."""
    bsz, n, _ = a.shape
    cfg = block.config
    a = matmul_input(a)  # one cast copy for k and v
    k = block.k_proj(a).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
    v = block.v_proj(a).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
    return KV(block.rotary(k, positions), v)


def attend(
    block: Block,
    a: torch.Tensor,
    residual: torch.Tensor,
    mlp_norm: nn.Module,
    positions: torch.Tensor,
    kv: KV,
    visible: torch.Tensor,
    extra: list[KV] | None = None,
) -> torch.Tensor:
    """The block for queries whose attention inputs are ``a`` (B, Q, A) at ``positions`` (B, Q), over
    ``kv`` where ``visible`` (B, Q, L) says so, plus each query's own ``extra`` keys (one per earlier
    sub-step, ``layers.attention``). Returns (B, Q, d)."""
    bsz, nq, _ = a.shape
    cfg = block.config
    q = block.q_proj(a).view(bsz, nq, cfg.num_attention_heads, cfg.head_dim)  # (B, Q, H, Dh)
    q = block.rotary(q.transpose(1, 2), positions)  # (B, H, Q, Dh)
    o = attention(q, kv, visible, extra)  # (B, H, Q, Dh)
    y = residual + block.o_proj(o.transpose(1, 2).reshape(bsz, nq, -1))  # (B, Q, d)
    return y + block.mlp(mlp_norm(y))  # (B, Q, d)
