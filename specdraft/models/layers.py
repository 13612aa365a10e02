"""Building blocks shared by the drafts: RMSNorm, RoPE, SwiGLU MLP, masked GQA attention, KV cache.

Both drafts follow the target's attention geometry (GQA head counts, head_dim, RoPE
parameters — Beagle paper §4.1 "GQA and RoPE follow the target") so these mirror the
Llama family. Attention takes an explicit boolean visibility mask ``(B, Q, K)``; a query
that sees no key returns exactly 0 (DESIGN.md "Index definitions"), never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """RoPE with the target's parameters (any rope_type transformers knows)."""

    def __init__(self, *, head_dim: int, num_heads: int, rope_parameters: dict, max_position_embeddings: int):
        super().__init__()
        cfg = LlamaConfig(
            hidden_size=head_dim * num_heads,
            num_attention_heads=num_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=dict(rope_parameters),
        )
        self.inner = LlamaRotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (B, H, T, Dh) at integer ``positions`` (B, T)."""
        cos, sin = self.inner(x, positions)  # (B, T, Dh)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, Dh)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


@dataclass
class KV:
    """Key/value heads after projection and RoPE: ``k``, ``v`` are (B, Hkv, L, Dh)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def cat(self, other: "KV") -> "KV":
        return KV(torch.cat([self.k, other.k], dim=2), torch.cat([self.v, other.v], dim=2))


class KVCache:
    """Growable key/value cache for incremental drafting.

    ``append`` adds entries, ``crop(n)`` drops everything after the first n (used to reset
    the cache to the true states at the start of each speculative-decoding round).
    """

    def __init__(self) -> None:
        self.kv: KV | None = None

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv.length

    def append(self, kv: KV) -> None:
        self.kv = kv if self.kv is None else self.kv.cat(kv)

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot crop a cache of {self.length} entries to {length}"
        if self.kv is not None:
            self.kv = KV(self.kv.k[:, :, :length], self.kv.v[:, :, :length])

    def view(self) -> KV:
        assert self.kv is not None, "the cache is empty: append states before attending"
        return self.kv


def masked_attention(q: torch.Tensor, kv: KV, visible: torch.Tensor) -> torch.Tensor:
    """GQA attention of q (B, H, Q, Dh) over kv (B, Hkv, K, Dh) with visibility (B, Q, K) bool.

    Returns (B, H, Q, Dh); a query row with no visible key yields zeros.
    """
    bsz, heads, nq, dh = q.shape
    if kv.length == 0:
        return torch.zeros_like(q)
    assert visible.shape == (bsz, nq, kv.length), f"mask {tuple(visible.shape)} != {(bsz, nq, kv.length)}"
    groups = heads // kv.k.shape[1]
    k = kv.k.repeat_interleave(groups, dim=1) if groups > 1 else kv.k  # (B, H, K, Dh)
    v = kv.v.repeat_interleave(groups, dim=1) if groups > 1 else kv.v  # (B, H, K, Dh)
    any_key = visible.any(dim=-1)  # (B, Q)
    safe = visible | ~any_key[..., None]  # rows with no key attend everywhere, then get zeroed
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe[:, None])  # (B, H, Q, Dh)
    return out * any_key[:, None, :, None].to(out.dtype)


def attention(
    q: torch.Tensor,
    kv: KV,
    visible: torch.Tensor,
    extra: KV | None = None,
    extra_visible: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention over shared keys plus per-query keys (the training-time-test / late-stage layout).

    q (B, H, Q, Dh) sees the shared ``kv`` (B, Hkv, K, Dh) where ``visible`` (B, Q, K) says so, and
    its own ``extra`` keys (k, v: (B, Hkv, Q, E, Dh)) where ``extra_visible`` (B, Q, E) says so — the
    draft's own states written at earlier sub-steps, one "diagonal" per step (SpecForge Alg. 1), one
    softmax over both. Queries are processed in chunks whose extra keys are appended to the shared
    keys with a block-diagonal mask, so every chunk is one ordinary masked SDPA call (fused kernels
    on GPU) and memory stays bounded: no (Q, Q*E) score matrix.
    """
    if extra is None or extra.k.shape[3] == 0:
        return masked_attention(q, kv, visible)
    bsz, hkv, nq, ne, dh = extra.k.shape
    assert q.shape[2] == nq and extra_visible.shape == (bsz, nq, ne), (
        f"extra keys {tuple(extra.k.shape)} / mask {tuple(extra_visible.shape)} do not match {nq} queries"
    )
    step = chunk or max(1, min(nq, max(kv.length, 64) // ne))
    outs = []
    for lo in range(0, nq, step):
        hi = min(nq, lo + step)
        n = hi - lo
        ke = extra.k[:, :, lo:hi].reshape(bsz, hkv, n * ne, dh)  # (B, Hkv, n*E, Dh)
        ve = extra.v[:, :, lo:hi].reshape(bsz, hkv, n * ne, dh)  # (B, Hkv, n*E, Dh)
        own = torch.eye(n, dtype=torch.bool, device=q.device)[None, :, :, None]  # (1, n, n, 1)
        vis_e = (own & extra_visible[:, None, lo:hi, :]).reshape(bsz, n, n * ne)  # (B, n, n*E)
        keys = KV(torch.cat([kv.k, ke], dim=2), torch.cat([kv.v, ve], dim=2))
        outs.append(masked_attention(q[:, :, lo:hi], keys, torch.cat([visible[:, lo:hi], vis_e], dim=-1)))
    return torch.cat(outs, dim=2)  # (B, H, Q, Dh)


def prefix_visible(cutoff: torch.Tensor, length: int, bsz: int) -> torch.Tensor:
    """(B, Q, L) bool: key index u is visible to query q iff u < cutoff[q] (cutoff (Q,))."""
    u = torch.arange(length, device=cutoff.device)
    return (u[None, :] < cutoff[:, None])[None].expand(bsz, -1, -1)  # (B, Q, L)


def gather_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) at positions ``index`` (Q, E) -> (B, Q, E, ...)."""
    flat = x[:, index.reshape(-1)]  # (B, Q*E, ...)
    return flat.reshape(x.shape[0], *index.shape, *x.shape[2:])
