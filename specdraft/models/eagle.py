"""EAGLE drafts, one class for both papers' layouts (they differ only in what a slot reads).

EAGLE (EAGLE-1/2, the HASS base: "Learning Harmonized Representations for Speculative Sampling"
§2, Fig. 2), ``arch="eagle"``, reads the target's last layer:

    x_c     = fc(cat(e(t_c), h_{c-1}))            (2d -> d, bias; slots c >= 1)
    h_hat_p = LlamaDecoderLayer(x)_p               (causal self-attention over x_{c<=p})

The draft predicts the target's state at p from the token at p and the state at p-1. As in the
EAGLE reference and the engines that serve it, the decoder layer has no input_layernorm (the fc
output goes straight into q/k/v) and there is no slot before position 1: position 0 has no state
before it, so it is never a query. Drafts written by specdraft 0.1 (``legacy``: an RMSNorm on the
fc output and a zero-state slot at position 0) still load and run.

EAGLE-3 ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test" §3; "SpecForge: A Flexible and Efficient Open-Source Training Framework for Speculative
Decoding" §2.4), ``arch="eagle3"``, reads auxiliary target layers fused by a projection, and has
its own draft vocabulary:

    f_c      = fc(cat(aux_low, aux_mid, aux_high)_c)            (L·d_target -> d, no bias)
    a_c      = cat(input_layernorm(e(t_c)), hidden_norm(f_{c-1}))  (2d: what q/k/v read)
    y_p      = f_{p-1} + o_proj(SelfAttn(a)_p)                    (residual: the feature)
    h_hat_p  = y_p + MLP(post_attention_layernorm(y_p))
    logits_p = lm_head(norm(h_hat_p))                              (over the draft vocabulary)

During drafting (and training-time test) an EAGLE-3 draft's own output h_hat replaces the projected
feature f directly (no fc), so every drafted state lives in the same d-wide space as fc's output.
The lm_head covers ``draft_vocab_size`` target ids (``heads.py``: d2t/t2d). With
``norm_before_residual`` the residual is hidden_norm(f) instead of f (vLLM's flag of that name).
In both, the embedding (and EAGLE's lm_head) is the target's, frozen; the weight names are the
reference layouts' (the exporters and the vLLM plugin read them).

State-index convention shared with Beagle: the slot at position c is built from *state*
u = c-1, so "query p sees states u < p" is the same rule for both drafts. The functions below
serve both layouts: ``slot_forward`` is the training sub-step — each query sees the true slots below
its cutoff plus its own earlier drafted slots (a ``layers.Chain``), and its own input is its
own slot (the last drafted state when there is one, else the true state p-1); ``slot_committed``
is the drafting cache's true slots ("EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees" §4.1: tree attention over the slots of a node's ancestors and itself).
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models import block
from specdraft.configs.draft import DraftConfig
from specdraft.models.heads import Heads
from specdraft.models.layers import KV, Chain, RMSNorm, SwiGLU, prefix_visible, substep_chain, take


class EagleDraft(nn.Module):
    """An EAGLE (``arch="eagle"``) or EAGLE-3 (``arch="eagle3"``) draft: one decoder layer over slots.

    The layouts differ only in the slot's inputs: EAGLE fuses (token, last-layer state) by fc into a
    d-wide slot; EAGLE-3 projects the auxiliary layers by fc (``project``) and keeps the slot as
    cat(e(t), f), 2d wide, normed per half before q/k/v.
    """

    def __init__(self, config: DraftConfig):
        super().__init__()
        assert config.arch in ("eagle", "eagle3"), f"EagleDraft needs arch 'eagle' or 'eagle3', got {config.arch!r}"
        self.config = config
        self.fuses_layers = config.arch == "eagle3"  # EAGLE-3: aux layers projected by fc, slot = cat(e, f)
        d = config.hidden_size
        self.heads = Heads(config)
        # modules in each reference's order (parameter order: initialisation and gradient-norm sums)
        if self.fuses_layers:
            self.fc = nn.Linear(config.feature_size, d, bias=False)
            self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
            block.add_attention(self, config, width=2 * d)  # q/k/v/o_proj, rotary
            self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.fc = nn.Linear(2 * d, d, bias=True)
            if config.legacy:
                self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
            block.add_attention(self, config, width=d)  # q/k/v/o_proj, rotary
        self.mlp = SwiGLU(d, config.intermediate_size)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.heads.logits(h)  # (..., V) or (..., Vd) over a draft vocabulary

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE: the target's last hidden states are the draft's states as they are. EAGLE-3:
        concatenated auxiliary target states (B, T, L·d_target) -> features (B, T, d)."""
        return self.fc(features) if self.fuses_layers else features

    def _attn_input(self, x: torch.Tensor) -> torch.Tensor:
        """What q/k/v read from slot inputs x."""
        if self.fuses_layers:
            e, f = x.split(self.config.hidden_size, dim=-1)
            return torch.cat([self.input_layernorm(e), self.hidden_norm(f)], dim=-1)  # (..., 2d)
        return self.input_layernorm(x) if self.config.legacy else x  # (..., d)

    def encode_inputs(
        self, input_ids: torch.Tensor, prev_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        """Slot inputs x and their keys/values, for tokens (B, S) whose previous position has state
        (feature, or drafted state) ``prev_states`` (B, S, d): EAGLE's fc(cat(e(t), h)) (B, S, d),
        EAGLE-3's cat(e(t), f) (B, S, 2d)."""
        e = self.heads.embed(input_ids).to(prev_states.dtype)  # (B, S, d)
        x = torch.cat([e, prev_states], dim=-1)  # (B, S, 2d)
        if not self.fuses_layers:
            x = self.fc(x)  # (B, S, d)
        return x, block.keys_values(self, self._attn_input(x), positions)

    def attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: KV,
        visible: torch.Tensor,
        extra: list[KV] | None = None,
    ) -> torch.Tensor:
        """The decoder layer for query slots x (B, Q, X) over keys ``kv`` with mask (B, Q, L)."""
        if self.fuses_layers:  # the residual is the feature half of the slot
            f = x[..., self.config.hidden_size :]  # (B, Q, d)
            residual = self.hidden_norm(f) if self.config.norm_before_residual else f
        else:
            residual = x  # (B, Q, d)
        return block.attend(
            self, self._attn_input(x), residual, self.post_attention_layernorm, positions, kv, visible, extra
        )

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

    # -- drafting (decoding/drafting.py): the cache holds keys/values of slots ------------------
    def encode_committed(self, tokens: torch.Tensor, states: torch.Tensor, start: int) -> tuple[torch.Tensor, KV]:
        return slot_committed(self, tokens, states, start)

    def encode_nodes(
        self, tokens: torch.Tensor, parent_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV | None]:
        """Drafted nodes' slots (token, parent's predicted state): the query inputs (1, Q, X) and their
        cache entries, seen by each node itself and its descendants."""
        return self.encode_inputs(tokens, parent_states, positions)

    def encode_drafted(self, h: torch.Tensor, positions: torch.Tensor) -> KV | None:
        """Nothing: a node's predicted state enters the cache through its children's slots."""
        return None


def slot_forward(
    draft,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    features: torch.Tensor,
    query_index: torch.Tensor,
    cutoff: torch.Tensor,
    extras: torch.Tensor | Chain,
) -> torch.Tensor:
    """The training sub-step of a self-attention draft over slots (EAGLE, EAGLE-3).

    True slots c = 1..T-1 are built from (t_c, state c-1) and visible to query q iff state c-1 <
    cutoff[q]; the drafted slots at positions q-E+1 .. q come from (t_c, drafted state c-1) and are
    visible to their own query only. The true slots are encoded once per chain and each sub-step's
    drafted states into slots once; later sub-steps of a chain read their queries' rows of those
    slots. A query whose chain has no true root slot (cutoff 0: nothing true before it, as never
    happens in drafting) returns zeros.
    """
    bsz, t = input_ids.shape
    chain = substep_chain(input_ids, features, query_index, cutoff, extras)
    legacy = draft.config.legacy
    if chain.true is None:  # the true slots: once per chain (or batch: ``chain.shared``)
        chain.set_true(None if chain.shared and chain.shared.source is not None
                       else true_slots(draft, input_ids, positions, features))
    x_true, kv = chain.true  # (B, S, X), KV (B, Hkv, S, Dh)
    visible = prefix_visible(cutoff + 1, t, bsz) if legacy else prefix_visible(cutoff, t - 1, bsz)  # (B, Q, S)

    def encode_slots(drafted: torch.Tensor, u: torch.Tensor):
        """Slots c = u+1 of drafted states (B, Q_v, d) at u (the state at T-1 feeds no slot: its
        row is encoded at a clamped position and never read)."""
        c = (u + 1).clamp(max=t - 1)  # (Q_v,)
        return draft.encode_inputs(input_ids[:, c], drafted, positions[:, c])  # (B, Q_v, X), KV (B, Hkv, Q_v, Dh)

    encoded = chain.encode(encode_slots)
    rows = chain.diagonal(query_index)  # E x (Q,): the slot each query reads
    extra = [kv_v.rows(r) for (_, kv_v), r in zip(encoded, rows)]  # E x (B, Hkv, Q, Dh)
    if rows:  # the query's own slot is its last drafted one
        x_q = take(encoded[-1][0], 1, rows[-1])  # (B, Q, X)
    else:  # its true slot
        x_q = x_true[:, query_index if legacy else (query_index - 1).clamp(min=0)]  # (B, Q, X)
    h = chain.attend(draft.attend, x_q, positions[:, query_index], kv, visible, extra)  # (B, Q, d)
    live = torch.ones_like(cutoff, dtype=torch.bool) if legacy else cutoff >= 1  # the chain has a true root slot
    return h * live[None, :, None].to(h.dtype)


def true_slots(draft, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor):
    """The true slots (B, S, X) and their keys/values: slot c from (t_c, state c-1)."""
    states = draft.project(features)  # (B, T, d)
    if draft.config.legacy:  # slot c = 0..T-1 from state c-1, slot 0 holding a zero state
        prev = torch.cat([states.new_zeros(states.shape[0], 1, states.shape[-1]), states[:, :-1]], dim=1)  # (B, T, d)
        return draft.encode_inputs(input_ids, prev, positions)
    return draft.encode_inputs(input_ids[:, 1:], states[:, :-1], positions[:, 1:])  # slot c = 1..T-1 (s = c-1)


def slot_committed(draft, tokens: torch.Tensor, states: torch.Tensor, start: int) -> tuple[torch.Tensor, KV]:
    """Drafting's true slots: slot c pairs t_c with h_{c-1}, so the committed states ``states`` (1, m, d)
    = h_start .. h_{start+m-1} fill slots start+1 .. start+m of ``tokens`` (1, m+1) = t_start ..
    t_{start+m}; the last is the root's slot, whose input (1, 1, X) is returned with the slots' keys/values.
    A specdraft 0.1 draft also has slot 0 (t_0 with a zero state) at the start of the sequence."""
    m = states.shape[1]
    if draft.config.legacy and start == 0:
        prev = torch.cat([states.new_zeros(1, 1, states.shape[-1]), states], dim=1)  # (1, m+1, d)
        x, kv = draft.encode_inputs(tokens, prev, torch.arange(m + 1, device=states.device)[None])
    else:
        positions = torch.arange(start + 1, start + m + 1, device=states.device)[None]  # (1, m)
        x, kv = draft.encode_inputs(tokens[:, 1:], states, positions)
    return x[:, -1:], kv
