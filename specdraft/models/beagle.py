"""Beagle draft: one cross-attention block + MLP (papers/beagle-… §4.1, Eq. 1–2).

    y_i     = CrossAttn(q = norm(e(t_i)), kv = norm(h_{j<i})) + e(t_i)
    h_hat_i = MLP(norm(y_i)) + y_i,        logits_i = lm_head(h_hat_i)

No self-attention and no fusion layer: queries come from token embeddings, keys/values
from higher-level states (the target's true states or the draft's own predictions). The
mask is strict (query i sees keys j < i, the diagonal too is hidden). Embedding and
lm_head are the target's, frozen (``heads.py``).

With ``aux_layers`` (the ``beagle3`` recipe, a combination no paper tried) the true states
are the EAGLE-3 features: the concatenated auxiliary target states projected by ``fc`` to d,
and the output goes through ``norm`` + a draft-vocabulary lm_head.

Entry points sharing the same weights:
* ``forward`` — one training sub-step: true states visible below a per-query cutoff plus the
  query's own earlier drafted states (``extras``); every stage of ``objectives.py`` is a
  sequence of such calls.
* ``encode_states`` + ``attend`` — incremental drafting with a ``KVCache`` (§4.1: cache true
  states, optionally append drafted ones — "concate").
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models.config import DraftConfig
from specdraft.models.heads import Heads
from specdraft.models.layers import (
    KV, Chain, RMSNorm, Rotary, SwiGLU, attention, diagonals, gather_positions, prefix_visible,
)


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
        self.heads = Heads(config)
        if config.aux_layers:
            self.fc = nn.Linear(config.feature_size, d, bias=False)
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
        return self.heads.logits(h)  # (..., Vd)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, F) -> true states (B, T, d): fc over aux layers, else as they are."""
        return self.fc(features) if self.config.aux_layers else features

    def encode_states(self, states: torch.Tensor, positions: torch.Tensor) -> KV:
        """Keys/values of ``states`` (B, S, d) at ``positions`` (B, S)."""
        bsz, n, _ = states.shape
        cfg = self.config
        x = self.norm_state(states)
        k = self.k_proj(x).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        v = self.v_proj(x).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        return KV(self.rotary(k, positions), v)

    def attend(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KV,
        visible: torch.Tensor,
        extra: list[KV] | None = None,
    ) -> torch.Tensor:
        """Predicted states for query tokens ``input_ids`` (B, Q) over keys ``kv`` with mask (B, Q, L)
        (plus per-query ``extra`` keys, see ``layers.attention``)."""
        bsz, nq = input_ids.shape
        cfg = self.config
        e = self.heads.embed(input_ids).to(self.q_proj.weight.dtype)  # (B, Q, d)
        q = self.q_proj(self.norm_query(e)).view(bsz, nq, cfg.num_attention_heads, cfg.head_dim)
        q = self.rotary(q.transpose(1, 2), positions)  # (B, H, Q, Dh)
        o = attention(q, kv, visible, extra)  # (B, H, Q, Dh)
        y = self.o_proj(o.transpose(1, 2).reshape(bsz, nq, -1)) + e  # (B, Q, d)
        return self.mlp(self.norm_mlp(y)) + y  # (B, Q, d)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        query_index: torch.Tensor,
        cutoff: torch.Tensor,
        extras: torch.Tensor | Chain,
    ) -> torch.Tensor:
        """One training sub-step.

        input_ids (B, T), positions (B, T); features (B, T, F) the target's (noised) features;
        query_index (Q,) positions to compute; cutoff (Q,): query q sees the true states u < cutoff[q];
        extras (B, Q, E, d): the draft's own states at positions q-E .. q-1 (written at earlier
        sub-steps), visible to their query only — or, in a chain trained by one backward (ttt),
        the ``Chain`` states of sub-steps 1..E, which this reads the same way. Returns h_hat (B, Q, d).
        """
        bsz, t = input_ids.shape
        nq = query_index.numel()
        ne = len(extras.states) if isinstance(extras, Chain) else extras.shape[2]
        assert features.shape[:2] == (bsz, t), f"features {tuple(features.shape)} vs input_ids {(bsz, t)}"
        assert cutoff.shape == (nq,), "cutoff does not match the queries"
        chain = isinstance(extras, Chain)  # one chain, one backward: every state encoded once per batch
        extra = None
        if chain:
            if extras.true is None:
                extras.true = self.encode_states(self.project(features), positions)  # true states: all T positions
            kv = extras.true
            encoded = extras.encode(lambda states, u: self.encode_states(states, positions[:, u]))  # E x (B, Hkv, Q_v, Dh)
            extra = [e.rows(r) for e, r in zip(encoded, extras.diagonal(query_index))]  # E x (B, Hkv, Q, Dh)
        else:
            kv = self.encode_states(self.project(features), positions)  # true states: all T positions
            if ne:
                assert extras.shape[:2] == (bsz, nq), "extras do not match the queries"
                at = query_index[:, None] - ne + torch.arange(ne, device=query_index.device)  # (Q, E)
                pos_e = gather_positions(positions, at).reshape(bsz, nq * ne)  # (B, Q*E)
                kv_e = self.encode_states(extras.reshape(bsz, nq * ne, -1), pos_e)
                k = kv_e.k.reshape(bsz, -1, nq, ne, self.config.head_dim)  # (B, Hkv, Q, E, Dh)
                extra = diagonals(KV(k, kv_e.v.reshape(k.shape)))
        args = (input_ids[:, query_index], positions[:, query_index], kv, prefix_visible(cutoff, t, bsz), extra)
        return extras.attend(self.attend, *args) if chain else self.attend(*args)
