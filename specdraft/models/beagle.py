"""Beagle draft: one cross-attention block + MLP (papers/beagle-… §4.1, Eq. 1–2).

    y_i     = CrossAttn(q = norm(e(t_i)), kv = norm(h_{j<i})) + e(t_i)
    h_hat_i = MLP(norm(y_i)) + y_i,        logits_i = lm_head(h_hat_i)

No self-attention and no fusion layer: queries come from token embeddings, keys/values
from higher-level states (the target's true states or the draft's own predictions). The
mask is strict (query i sees keys j < i, the diagonal too is hidden). Embedding and
lm_head are the target's, frozen.

Three entry points share the same weights:
* ``forward`` — parallel training over a grid of state *versions* (true states, draft
  buffers) with an explicit visibility mask; every training stage is one such call.
* ``encode_states`` + ``attend`` — incremental drafting with a ``KVCache`` of key/value
  states (§4.1: cache true states, optionally append drafted ones — "concate").
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models.config import DraftConfig
from specdraft.models.layers import KV, RMSNorm, Rotary, SwiGLU, masked_attention


class BeagleDraft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        assert config.arch == "beagle", f"BeagleDraft needs arch='beagle', got {config.arch!r}"
        self.config = config
        d, heads, kv_heads, dh = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.embed = nn.Embedding(config.vocab_size, d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.embed.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.norm_query = RMSNorm(d, config.rms_norm_eps)
        self.norm_state = RMSNorm(d, config.rms_norm_eps)
        self.norm_mlp = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, heads * dh, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * dh, bias=False)
        self.o_proj = nn.Linear(heads * dh, d, bias=False)
        self.mlp = SwiGLU(d, config.intermediate_size)
        self.rotary = Rotary(
            head_dim=dh,
            num_heads=heads,
            rope_parameters=config.rope_parameters,
            max_position_embeddings=config.max_position_embeddings,
        )

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)  # (..., V)

    def encode_states(self, states: torch.Tensor, positions: torch.Tensor) -> KV:
        """Keys/values of ``states`` (B, S, d) at ``positions`` (B, S)."""
        bsz, n, _ = states.shape
        cfg = self.config
        x = self.norm_state(states)
        k = self.k_proj(x).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        v = self.v_proj(x).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        return KV(self.rotary(k, positions), v)

    def attend(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KV, visible: torch.Tensor
    ) -> torch.Tensor:
        """Predicted states for query tokens ``input_ids`` (B, Q) over keys ``kv`` with mask (B, Q, L)."""
        bsz, nq = input_ids.shape
        cfg = self.config
        e = self.embed(input_ids)  # (B, Q, d)
        q = self.q_proj(self.norm_query(e)).view(bsz, nq, cfg.num_attention_heads, cfg.head_dim)
        q = self.rotary(q.transpose(1, 2), positions)  # (B, H, Q, Dh)
        o = masked_attention(q, kv, visible)  # (B, H, Q, Dh)
        y = self.o_proj(o.transpose(1, 2).reshape(bsz, nq, -1)) + e  # (B, Q, d)
        return self.mlp(self.norm_mlp(y)) + y  # (B, Q, d)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        states: torch.Tensor,
        query_index: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Parallel training forward.

        input_ids (B, T), positions (B, T); states (V, B, T, d): version 0 = true states,
        later versions = draft buffers; query_index (Q,) positions to compute; visible
        (B, Q, V, T): may query q use state u of version v. Returns h_hat (B, Q, d).
        """
        nver, bsz, t, d = states.shape
        assert input_ids.shape == (bsz, t), f"input_ids {tuple(input_ids.shape)} vs states {tuple(states.shape)}"
        assert visible.shape == (bsz, query_index.numel(), nver, t), f"bad visibility shape {tuple(visible.shape)}"
        flat = states.permute(1, 0, 2, 3).reshape(bsz, nver * t, d)  # (B, V*T, d)
        kv = self.encode_states(flat, positions.repeat(1, nver))
        return self.attend(
            input_ids[:, query_index], positions[:, query_index], kv, visible.reshape(bsz, -1, nver * t)
        )
