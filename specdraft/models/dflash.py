"""DFlash block draft ("DFlash: Block Diffusion for Flash Speculative Decoding", §3: the draft model and
its target-conditioned KV injection; §4.2: block-parallel training): ``num_layers`` decoder layers
that fill a whole block of positions in one forward.

    c_u      = hidden_norm(fc(cat(aux states)_u))                 (L·d_target -> d, no bias; context u < a)
    x^0      = e(cat(t_a, m, ..., m))                              (anchor token + S-1 masks, target's frozen e)
    layer l:  a = input_layernorm(x^l)
              K, V = [k_norm(k_proj(c)), v_proj(c)] ++ [k_norm(k_proj(a)), v_proj(a)]   (context ++ block)
              x' = x^l + o_proj(Attn(q = q_norm(q_proj(a)), K, V))                  (RoPE on q and k)
              x^{l+1} = x' + MLP(post_attention_layernorm(x'))
    logits_k = lm_head(norm(x^L_k))                                (block position k predicts t_{a+k})

The target's auxiliary states enter every layer as keys and values only ("KV injection", §3.1), each
layer projecting the same normed context with its own k/v projection; the block's positions attend
to the context and, bidirectionally, to each other (§3.2: one denoising step of a block diffusion
model). q_norm/k_norm are per-head RMSNorms (the Qwen3 layer the paper's drafts and vLLM's
``DFlashQwen3ForCausalLM`` use). The output head is the target's frozen lm_head or a draft vocabulary
(``heads.py``), after the draft's own final ``norm``. With ``block_self_attention`` False (the
``beagle-dflash`` recipe: "Cross-Attention Speculative Decoding" (Beagle) §4.1 carried to the block),
a block position attends to the context states only.

Two uses of the same weights: ``forward`` trains N blocks per sequence at once (``masks.Blocks``:
every block sees the context before its anchor); ``context_kv`` / ``draft_block`` draft one block
over a per-layer cache of the committed context (``decoding/block.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.masks import Blocks
from specdraft.configs.draft import DraftConfig
from specdraft.models.heads import Heads
from specdraft.models.layers import KV, RMSNorm, Rotary, SwiGLU, block_attention, matmul_input


class DFlashAttention(nn.Module):
    """q/k/v/o projections and per-head q/k norms of one layer (vLLM's ``self_attn`` names)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        d, dh = config.hidden_size, config.head_dim
        self.config = config
        self.q_proj = nn.Linear(d, config.num_attention_heads * dh, bias=False)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * dh, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * dh, d, bias=False)
        self.q_norm = RMSNorm(dh, config.rms_norm_eps)
        self.k_norm = RMSNorm(dh, config.rms_norm_eps)

    def keys_values(self, a: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> KV:
        """Keys (k_norm, RoPE at ``positions`` (B, S)) and values of normed inputs ``a`` (B, S, d)."""
        bsz, s, _ = a.shape
        cfg = self.config
        a = matmul_input(a)  # one cast copy for k and v
        k = self.k_norm(self.k_proj(a).view(bsz, s, cfg.num_key_value_heads, cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(a).view(bsz, s, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, S, Dh)
        return KV(rotary(k, positions), v)

    def queries(self, a: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        bsz, s, _ = a.shape
        cfg = self.config
        q = self.q_norm(self.q_proj(a).view(bsz, s, cfg.num_attention_heads, cfg.head_dim)).transpose(1, 2)
        return rotary(q, positions)  # (B, H, S, Dh)


class DFlashLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = SwiGLU(d, config.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: KV, visible: torch.Tensor,
                rotary: Rotary, size: int, self_attention: bool) -> torch.Tensor:
        """Blocks' positions x (B, Q, d) at ``positions`` (B, Q) (Q = N blocks of ``size``) over this
        layer's context keys/values where ``visible`` (B, Q, L) allows, and their own blocks."""
        bsz, nq, _ = x.shape
        a = self.input_layernorm(x)  # (B, Q, d)
        q = self.self_attn.queries(a, positions, rotary)  # (B, H, Q, Dh)
        own = self.self_attn.keys_values(a, positions, rotary) if self_attention else None
        o = block_attention(q, context, visible, own, size)  # (B, H, Q, Dh)
        y = x + self.self_attn.o_proj(o.transpose(1, 2).reshape(bsz, nq, -1))  # (B, Q, d)
        return y + self.mlp(self.post_attention_layernorm(y))


class DFlashDraft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        assert config.arch == "dflash", f"DFlashDraft needs arch='dflash', got {config.arch!r}"
        self.config = config
        d = config.hidden_size
        self.heads = Heads(config)  # the final norm (heads.norm) and the output head
        self.fc = nn.Linear(config.feature_size, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.rotary = Rotary(head_dim=config.head_dim, num_heads=config.num_attention_heads,
                             rope_parameters=config.rope_parameters,
                             max_position_embeddings=config.max_position_embeddings)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.heads.logits(h)  # (..., Vd): lm_head(norm(h))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated auxiliary target states (B, T, L·d_target) -> context states (B, T, d)."""
        return self.fc(features)

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Every layer's keys/values (B, Hkv, S, Dh) of projected context states (B, S, d) at ``positions`` (B, S)."""
        c = self.hidden_norm(states)  # (B, S, d): one normed context for all layers
        return [layer.self_attn.keys_values(c, positions, self.rotary) for layer in self.layers]

    def run_blocks(self, tokens: torch.Tensor, positions: torch.Tensor, context: list[KV],
                   visible: torch.Tensor, size: int) -> torch.Tensor:
        """Final states (B, Q, d) (before the head's norm) of blocks of ``size`` tokens (B, Q) at
        ``positions`` (B, Q), over the per-layer ``context`` where ``visible`` (B, Q, L) allows."""
        x = self.heads.embed(tokens).to(self.fc.weight.dtype)  # (B, Q, d)
        for layer, kv in zip(self.layers, context):
            x = layer(x, positions, kv, visible, self.rotary, size, self.config.block_self_attention)
        return x

    def block_tokens(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """(..., S) block inputs: each anchor token (...) followed by S-1 mask tokens."""
        masks = anchor_tokens.new_full((*anchor_tokens.shape, self.config.block_size - 1), self.config.mask_token_id)
        return torch.cat([anchor_tokens[..., None], masks], dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """Training forward of N blocks per row (DFlash §4.2): input_ids (B, T), positions (B, T), the
        target's (noised) features (B, T, F), ``anchors`` (B, N) (-1: no block). Block n of row b starts
        at anchor a with token input_ids[b, a] and sees the context states u < a. Returns (B, N, S, d)."""
        bsz, t = input_ids.shape
        blocks = Blocks(anchors, self.config.block_size)
        context = self.context_kv(self.project(features), positions)  # layers x (B, Hkv, T, Dh)
        anchor_tokens = input_ids.gather(1, anchors.clamp(min=0))  # (B, N)
        tokens = self.block_tokens(anchor_tokens).flatten(1)  # (B, N*S)
        pos = blocks.positions.flatten(1)  # (B, N*S)
        h = self.run_blocks(tokens, pos, context, blocks.context_visible(t), self.config.block_size)  # (B, N*S, d)
        return h.view(bsz, anchors.shape[1], self.config.block_size, -1)

    def draft_block(self, anchor: int, position: int, context: list[KV], size: int | None = None) -> torch.Tensor:
        """Drafting: final states (1, S', d) of one block of S' = ``size`` (default block_size) positions,
        anchor token ``anchor`` at ``position``, over every entry of the per-layer ``context`` cache."""
        size = self.config.block_size if size is None else size
        device = self.fc.weight.device
        tokens = self.block_tokens(torch.tensor([anchor], device=device))[None, :, :size].flatten(1)  # (1, S')
        pos = torch.arange(position, position + size, device=device)[None]  # (1, S')
        visible = torch.ones(1, size, context[0].length, dtype=torch.bool, device=device)  # (1, S', L)
        return self.run_blocks(tokens, pos, context, visible, size)
