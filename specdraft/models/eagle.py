"""EAGLE draft (EAGLE-1/2, the HASS base; papers/hass-… §2 and Fig. 2), in the reference layout.

    x_c     = fc(cat(e(t_c), h_{c-1}))            (2d -> d, bias; slots c >= 1)
    h_hat_p = LlamaDecoderLayer(x)_p               (causal self-attention over x_{c<=p})

The draft predicts the target's state at p from the token at p and the state at p-1.
Embedding and lm_head are the target's, frozen. As in the EAGLE reference and the engines
that serve it (SERVING.md), the decoder layer has no input_layernorm (the fc output goes
straight into q/k/v) and there is no slot before position 1: position 0 has no state before
it, so it is never a query. Drafts written by specdraft 0.1 (``legacy``: an RMSNorm on the fc
output and a zero-state slot at position 0) still load and run.

State-index convention shared with Beagle: the slot at position c is built from *state*
u = c-1, so "query p sees states u < p" is the same rule for both drafts. A training
sub-step (``slot_forward``, shared with EAGLE-3) gives each query the true states below its
cutoff plus its own earlier drafted states (``extras``); the query's own input is its own
slot — the last drafted state when there is one, else the true state p-1.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models.config import DraftConfig
from specdraft.models.heads import Heads
from specdraft.models.layers import (
    KV, Chain, RMSNorm, Rotary, SwiGLU, attention, diagonals, gather_positions, matmul_input, prefix_visible, take,
)


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
        self.heads = Heads(config)
        self.fc = nn.Linear(2 * d, d, bias=True)
        if config.legacy:
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
        return self.heads.logits(h)  # (..., V)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's last hidden states are the draft's states as they are."""
        return features

    def _attn_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x) if self.config.legacy else x

    def encode_inputs(
        self, input_ids: torch.Tensor, prev_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        """Fused inputs x (B, S, d) and their keys/values for tokens (B, S) with previous states (B, S, d)."""
        bsz, n = input_ids.shape
        cfg = self.config
        e = self.heads.embed(input_ids).to(prev_states.dtype)  # (B, S, d)
        x = self.fc(torch.cat([e, prev_states], dim=-1))  # (B, S, d)
        a = matmul_input(self._attn_input(x))  # one cast copy for k and v
        k = self.k_proj(a).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        v = self.v_proj(a).view(bsz, n, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        return x, KV(self.rotary(k, positions), v)

    def attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: KV,
        visible: torch.Tensor,
        extra: list[KV] | None = None,
    ) -> torch.Tensor:
        """Decoder layer for query inputs x (B, Q, d) over keys ``kv`` with mask (B, Q, L)."""
        bsz, nq, _ = x.shape
        cfg = self.config
        q = self.q_proj(self._attn_input(x)).view(bsz, nq, cfg.num_attention_heads, cfg.head_dim)
        q = self.rotary(q.transpose(1, 2), positions)  # (B, H, Q, Dh)
        o = attention(q, kv, visible, extra)  # (B, H, Q, Dh)
        y = x + self.o_proj(o.transpose(1, 2).reshape(bsz, nq, -1))  # (B, Q, d)
        return y + self.mlp(self.post_attention_layernorm(y))  # (B, Q, d)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        query_index: torch.Tensor,
        cutoff: torch.Tensor,
        extras: torch.Tensor | Chain,
    ) -> torch.Tensor:
        """One training sub-step (same contract as ``BeagleDraft.forward``)."""
        return slot_forward(self, input_ids, positions, features, query_index, cutoff, extras)


def slot_forward(
    draft,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    features: torch.Tensor,
    query_index: torch.Tensor,
    cutoff: torch.Tensor,
    extras: torch.Tensor,
) -> torch.Tensor:
    """The training sub-step of a self-attention draft over slots (EAGLE, EAGLE-3).

    True slots c = 1..T-1 are built from (t_c, state c-1) and visible to query q iff state c-1 <
    cutoff[q]; the drafted slots at positions q-E+1 .. q come from (t_c, extras) and are visible to
    their own query only. With ``Chain`` extras (a chain trained by one backward: ttt) the true
    slots are encoded once per batch and each sub-step's drafted states into slots once, and later
    sub-steps read their queries' rows of those slots. A query whose chain has no true root slot
    (cutoff 0: nothing true before it, as never happens in drafting) returns zeros.
    """
    bsz, t = input_ids.shape
    nq = query_index.numel()
    assert features.shape[:2] == (bsz, t), f"features {tuple(features.shape)} vs input_ids {(bsz, t)}"
    assert cutoff.shape == (nq,), "cutoff does not match the queries"
    legacy = draft.config.legacy
    if legacy and isinstance(extras, Chain):
        extras = (  # (B, Q, E, d): legacy slots are encoded per query
            extras.gather(query_index) if extras.states else features.new_zeros(bsz, nq, 0, draft.config.hidden_size)
        )
    chain = isinstance(extras, Chain)  # one chain, one backward: every state encoded once per batch
    if legacy:  # slot c = 0..T-1 from state c-1, slot 0 holding a zero state
        states = draft.project(features)  # (B, T, d)
        prev = torch.cat([states.new_zeros(bsz, 1, states.shape[-1]), states[:, :-1]], dim=1)  # (B, T, d)
        x_true, kv = draft.encode_inputs(input_ids, prev, positions)
        visible = prefix_visible(cutoff + 1, t, bsz)  # slot s holds state s-1
    else:  # slot c = 1..T-1 (index s = c-1 holds state s)
        true = extras.true if chain else None
        if true is None:
            states = draft.project(features)  # (B, T, d)
            true = draft.encode_inputs(input_ids[:, 1:], states[:, :-1], positions[:, 1:])
            if chain:
                extras.true = true
        x_true, kv = true
        visible = prefix_visible(cutoff, t - 1, bsz)
    extra = None
    if chain:
        ne = len(extras.states)

        def encode_slots(drafted: torch.Tensor, u: torch.Tensor):
            """Slots c = u+1 of drafted states (B, Q_v, d) at u (the state at T-1 feeds no slot: its
            row is encoded at a clamped position and never read)."""
            c = (u + 1).clamp(max=t - 1)  # (Q_v,)
            return draft.encode_inputs(input_ids[:, c], drafted, positions[:, c])  # (B, Q_v, X), KV (B, Hkv, Q_v, Dh)

        encoded = extras.encode(encode_slots)
        if ne:
            rows = extras.diagonal(query_index)  # E x (Q,): the slot each query reads
            extra = [kv_v.rows(r) for (_, kv_v), r in zip(encoded, rows)]  # E x (B, Hkv, Q, Dh)
            x_q = take(encoded[-1][0], 1, rows[-1])  # (B, Q, X): the query's own slot is its last extra
    else:
        ne = extras.shape[2]
        assert extras.shape[:2] == (bsz, nq), "extras do not match the queries"
        if ne:
            at = query_index[:, None] - ne + 1 + torch.arange(ne, device=query_index.device)  # (Q, E): slot positions
            ids_e = gather_positions(input_ids, at).reshape(bsz, nq * ne)  # (B, Q*E)
            pos_e = gather_positions(positions, at).reshape(bsz, nq * ne)  # (B, Q*E)
            x_e, kv_e = draft.encode_inputs(ids_e, extras.reshape(bsz, nq * ne, -1), pos_e)
            k = kv_e.k.reshape(bsz, -1, nq, ne, draft.config.head_dim)  # (B, Hkv, Q, E, Dh)
            extra = diagonals(KV(k, kv_e.v.reshape(k.shape)))
            x_q = x_e.reshape(bsz, nq, ne, -1)[:, :, -1]  # (B, Q, X): the query's own slot is its last extra
    if not ne:
        own = query_index if legacy else (query_index - 1).clamp(min=0)  # (Q,)
        x_q = x_true[:, own]  # (B, Q, X)
    args = (x_q, positions[:, query_index], kv, visible, extra)
    h = extras.attend(draft.attend, *args) if chain else draft.attend(*args)  # (B, Q, d)
    live = torch.ones_like(cutoff, dtype=torch.bool) if legacy else cutoff >= 1  # the chain has a true root slot
    return h * live[None, :, None].to(h.dtype)
