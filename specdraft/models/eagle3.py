"""EAGLE-3 draft ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" §3; "SpecForge: A Flexible and Efficient Open-Source Training Framework for
Speculative Decoding" §2.4): multi-layer features, draft vocabulary.

    f_c      = fc(cat(aux_low, aux_mid, aux_high)_c)            (L·d_target -> d, no bias)
    a_c      = cat(input_layernorm(e(t_c)), hidden_norm(f_{c-1}))  (2d: what q/k/v read)
    y_p      = f_{p-1} + o_proj(SelfAttn(a)_p)                    (residual: the feature)
    h_hat_p  = y_p + MLP(post_attention_layernorm(y_p))
    logits_p = lm_head(norm(h_hat_p))                              (over the draft vocabulary)

Slots follow the EAGLE convention (``eagle.py``, whose ``slot_forward`` and ``slot_committed``
serve this draft too): slot c pairs token t_c with the feature of position c-1, there is no slot
before position 1. During drafting (and training-time test) the draft's own output h_hat replaces
the projected feature f directly (no fc), so every drafted state lives in the same d-wide space as
fc's output. The embedding is the target's, frozen; the lm_head covers ``draft_vocab_size`` target
ids (``heads.py``: d2t/t2d). With ``norm_before_residual`` the residual is hidden_norm(f) instead of
f (vLLM's flag of that name).
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models import block
from specdraft.models.config import DraftConfig
from specdraft.models.eagle import slot_committed, slot_forward
from specdraft.models.heads import Heads
from specdraft.models.layers import KV, Chain, RMSNorm, SwiGLU


class Eagle3Draft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        assert config.arch == "eagle3", f"Eagle3Draft needs arch='eagle3', got {config.arch!r}"
        self.config = config
        d = config.hidden_size
        self.heads = Heads(config)
        self.fc = nn.Linear(config.feature_size, d, bias=False)
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        block.add_attention(self, config, width=2 * d)  # q/k/v/o_proj, rotary
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = SwiGLU(d, config.intermediate_size)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.heads.logits(h)  # (..., Vd): lm_head(norm(h))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated auxiliary target states (B, T, L·d_target) -> features (B, T, d)."""
        return self.fc(features)

    def _attn_input(self, x: torch.Tensor) -> torch.Tensor:
        e, f = x.split(self.config.hidden_size, dim=-1)
        return torch.cat([self.input_layernorm(e), self.hidden_norm(f)], dim=-1)  # (..., 2d)

    def encode_inputs(
        self, input_ids: torch.Tensor, prev_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV]:
        """Slot inputs x = cat(e(t), f) (B, S, 2d) and their keys/values, for tokens (B, S) whose
        previous position has feature (or drafted state) ``prev_states`` (B, S, d)."""
        e = self.heads.embed(input_ids).to(prev_states.dtype)  # (B, S, d)
        x = torch.cat([e, prev_states], dim=-1)  # (B, S, 2d)
        return x, block.keys_values(self, self._attn_input(x), positions)

    def attend(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv: KV,
        visible: torch.Tensor,
        extra: list[KV] | None = None,
    ) -> torch.Tensor:
        """The decoder layer for query slots x (B, Q, 2d) over keys ``kv`` with mask (B, Q, L)."""
        f = x[..., self.config.hidden_size :]  # (B, Q, d)
        residual = self.hidden_norm(f) if self.config.norm_before_residual else f
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
        """Drafted nodes' slots (token, parent's predicted state), seen by each node and its descendants."""
        return self.encode_inputs(tokens, parent_states, positions)

    def encode_drafted(self, h: torch.Tensor, positions: torch.Tensor) -> KV | None:
        """Nothing: a node's predicted state enters the cache through its children's slots."""
        return None
