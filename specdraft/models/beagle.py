"""Beagle draft: one cross-attention block + MLP ("Cross-Attention Speculative Decoding" §4.1, Eq. 1-2).

    y_i     = CrossAttn(q = norm(e(t_i)), kv = norm(h_{j<i})) + e(t_i)
    h_hat_i = MLP(norm(y_i)) + y_i,        logits_i = lm_head(h_hat_i)

No self-attention and no fusion layer: queries come from token embeddings, keys/values
from higher-level states (the target's true states or the draft's own predictions). The
mask is strict (query i sees keys j < i, the diagonal too is hidden). Embedding and
lm_head are the target's, frozen (``heads.py``).

With ``aux_layers`` (the ``beagle3`` recipe, a combination no paper tried) the true states
are the EAGLE-3 features: the concatenated auxiliary target states projected by ``fc`` to d,
and the output goes through ``norm`` + a draft-vocabulary lm_head.

Two uses of the same weights:
* ``forward`` — one training sub-step (§4.2): the true states visible below a per-query cutoff,
  plus the query's own earlier drafted states (a ``layers.Chain``); every stage of
  ``objectives.py`` is a sequence of such calls.
* ``encode_committed`` / ``encode_nodes`` / ``attend`` / ``encode_drafted`` — drafting with a KV
  cache (§4.1: cache the true states; with "concate" append each drafted state after its query,
  for its descendants), driven by ``decoding/drafting.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models import block
from specdraft.configs.draft import DraftConfig
from specdraft.models.heads import Heads
from specdraft.models.layers import KV, Chain, RMSNorm, SwiGLU, prefix_visible, substep_chain


class BeagleDraft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        assert config.arch == "beagle", f"BeagleDraft needs arch='beagle', got {config.arch!r}"
        self.config = config
        d = config.hidden_size
        self.heads = Heads(config)
        if config.aux_layers:
            self.fc = nn.Linear(config.feature_size, d, bias=False)
        self.norm_query = RMSNorm(d, config.rms_norm_eps)
        self.norm_state = RMSNorm(d, config.rms_norm_eps)
        self.norm_mlp = RMSNorm(d, config.rms_norm_eps)
        block.add_attention(self, config, width=d)  # q/k/v/o_proj, rotary
        self.mlp = SwiGLU(d, config.intermediate_size)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.heads.logits(h)  # (..., Vd)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, F) -> true states (B, T, d): fc over aux layers, else as they are."""
        return self.fc(features) if self.config.aux_layers else features

    def encode_states(self, states: torch.Tensor, positions: torch.Tensor) -> KV:
        """Keys/values of ``states`` (B, S, d) at ``positions`` (B, S)."""
        return block.keys_values(self, self.norm_state(states), positions)

    def attend(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KV,
        visible: torch.Tensor,
        extra: list[KV] | None = None,
    ) -> torch.Tensor:
        """Predicted states (B, Q, d) for query tokens ``input_ids`` (B, Q) over keys ``kv`` with mask
        (B, Q, L) (plus per-query ``extra`` keys, see ``layers.attention``)."""
        e = self.heads.embed(input_ids).to(self.q_proj.weight.dtype)  # (B, Q, d)
        return block.attend(self, self.norm_query(e), e, self.norm_mlp, positions, kv, visible, extra)

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
        extras: the draft's own states at positions q-E .. q-1, written at earlier sub-steps and
        visible to their query only — a ``Chain`` (its encodings shared by the sub-steps of one
        backward), or per query (B, Q, E, d). Returns h_hat (B, Q, d).
        """
        bsz, t = input_ids.shape
        chain = substep_chain(input_ids, features, query_index, cutoff, extras)
        if chain.true is None:  # the true states' keys/values, all T positions: once per chain (or batch)
            chain.set_true(None if chain.shared and chain.shared.source is not None
                           else self.encode_states(self.project(features), positions))
        encoded = chain.encode(lambda states, u: self.encode_states(states, positions[:, u]))  # E x (B, Hkv, Q_v, Dh)
        extra = [kv.rows(r) for kv, r in zip(encoded, chain.diagonal(query_index))]  # E x (B, Hkv, Q, Dh)
        visible = prefix_visible(cutoff, t, bsz)  # (B, Q, T)
        ids, pos = input_ids[:, query_index], positions[:, query_index]  # (B, Q)
        return chain.attend(self.attend, ids, pos, chain.true, visible, extra)  # (B, Q, d)

    # -- drafting (decoding/drafting.py): the cache holds keys/values of states ------------------
    def encode_committed(self, tokens: torch.Tensor, states: torch.Tensor, start: int) -> tuple[torch.Tensor, KV]:
        """Cache entries of the committed states ``states`` (1, m, d) = h_start .. h_{start+m-1}, and the
        root query's input: its token, the last of ``tokens`` (1, m+1) = t_start .. t_{start+m}."""
        positions = torch.arange(start, start + states.shape[1], device=states.device)[None]  # (1, m)
        return tokens[:, -1:], self.encode_states(states, positions)

    def encode_nodes(
        self, tokens: torch.Tensor, parent_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV | None]:
        """Drafted nodes' query inputs: their tokens (1, Q). They add no entry before their query."""
        return tokens, None

    def encode_drafted(self, h: torch.Tensor, positions: torch.Tensor) -> KV | None:
        """The nodes' predicted states (1, Q, d) as cache entries, seen by their descendants ("concate")."""
        return self.encode_states(h, positions)
