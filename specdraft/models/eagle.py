"""EAGLE draft (EAGLE-1/2, the HASS base; papers/hass-… §2 and Fig. 2).

    x_c     = fc(cat(e(t_c), h_{c-1}))            (2d -> d; h_{-1} = 0)
    h_hat_p = LlamaDecoderLayer(x)_p               (causal self-attention over x_{c<=p})

The draft predicts the target's state at p from the token at p and the state at p-1.
Embedding and lm_head are the target's, frozen.

State-index convention shared with Beagle: the slot at position c is built from *state*
u = c-1, so "query p sees states u < p" is the same rule for both drafts, and a training
stage is a visibility grid over (query, state version, state index) — see
``specdraft/masks.py``. Slot 0 (state u = -1, a zero vector) is always visible.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models.config import DraftConfig
from specdraft.models.layers import KV, RMSNorm, Rotary, SwiGLU, masked_attention


class EagleDraft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        assert config.arch == "eagle", f"EagleDraft needs arch='eagle', got {config.arch!r}"
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
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
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

    def encode_inputs(
        self, input_ids: torch.Tensor, prev_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        """Fused inputs x (B, S, d) and their keys/values for tokens (B, S) with previous states (B, S, d)."""
        bsz, n = input_ids.shape
        cfg = self.config
        x = self.fc(torch.cat([self.embed(input_ids), prev_states], dim=-1))  # (B, S, d)
        normed = self.input_layernorm(x)
        k = self.k_proj(normed).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        v = self.v_proj(normed).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        return x, KV(self.rotary(k, positions), v)

    def attend(self, x: torch.Tensor, positions: torch.Tensor, kv: KV, visible: torch.Tensor) -> torch.Tensor:
        """Decoder layer for query inputs x (B, Q, d) over keys ``kv`` with mask (B, Q, L)."""
        bsz, nq, _ = x.shape
        cfg = self.config
        q = self.q_proj(self.input_layernorm(x)).view(bsz, nq, cfg.num_attention_heads, cfg.head_dim)
        q = self.rotary(q.transpose(1, 2), positions)  # (B, H, Q, Dh)
        o = masked_attention(q, kv, visible)  # (B, H, Q, Dh)
        y = x + self.o_proj(o.transpose(1, 2).reshape(bsz, nq, -1))  # (B, Q, d)
        return y + self.mlp(self.post_attention_layernorm(y))  # (B, Q, d)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        states: torch.Tensor,
        query_index: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Parallel training forward (same contract as ``BeagleDraft.forward``).

        states (V, B, T, d) are indexed by state position u; visible (B, Q, V, T) says
        whether query q may use state u of version v (u < p). The query's own input uses
        the version of state p-1 that is visible to it.
        """
        nver, bsz, t, d = states.shape
        nq = query_index.numel()
        assert input_ids.shape == (bsz, t), f"input_ids {tuple(input_ids.shape)} vs states {tuple(states.shape)}"
        assert visible.shape == (bsz, nq, nver, t), f"bad visibility shape {tuple(visible.shape)}"
        zero = states.new_zeros(nver, bsz, 1, d)
        prev = torch.cat([zero, states[:, :, :-1]], dim=2)  # (V, B, T, d): slot c <- state c-1
        flat_prev = prev.permute(1, 0, 2, 3).reshape(bsz, nver * t, d)  # (B, V*T, d)
        x_all, kv = self.encode_inputs(input_ids.repeat(1, nver), flat_prev, positions.repeat(1, nver))
        # slot (v, c) is visible iff state (v, c-1) is; slot (0, 0) (the zero state) always.
        slot0 = torch.zeros(bsz, nq, nver, 1, dtype=torch.bool, device=visible.device)
        slot0[:, :, 0] = True
        slots = torch.cat([slot0, visible[..., :-1]], dim=-1)  # (B, Q, V, T)
        # the query's own input: slot p of the version in which state p-1 is visible (0 for p = 0)
        p = query_index.to(visible.device)
        index = (p - 1).clamp(min=0).view(1, nq, 1, 1).expand(bsz, nq, nver, 1)
        prev_vis = visible.gather(3, index).squeeze(-1)  # (B, Q, V)
        version = torch.where(p > 0, prev_vis.to(torch.int64).argmax(dim=-1), torch.zeros_like(p))  # (B, Q)
        x_q = x_all[torch.arange(bsz)[:, None], version * t + p]  # (B, Q, d)
        return self.attend(x_q, positions[:, query_index], kv, slots.reshape(bsz, nq, nver * t))
