"""Building blocks shared by the drafts: RMSNorm, RoPE, SwiGLU MLP, masked GQA attention, and the
``Chain`` of drafted states a training sub-step reads (the drafting KV cache: ``kvcache``).

Every draft follows the target's attention geometry (GQA head counts, head_dim, RoPE parameters —
"Cross-Attention Speculative Decoding" (Beagle) §4.1; EAGLE's draft is one decoder layer of the
target's shape), so these mirror the Llama family. Attention takes an explicit boolean visibility
mask ``(B, Q, K)``; a query that sees no key returns exactly 0, never NaN (a Beagle query whose
window holds no true state, ``masks.early``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


class RMSNorm(nn.Module):
    """Llama's RMSNorm: weight * (x / rms(x)) computed in fp32, cast back to x's dtype before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # inference (drafting): the same ops, without the autograd.Function call
            x32 = x.float()
            return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """The norm with a backward that keeps only its input and the (..., 1) fp32 reciprocal rms.

    Autograd of the plain formula also keeps the normalised fp32 tensor — one more (tokens x d)
    fp32 buffer per norm and sub-step (a TTT chain of 7 at d=4096, T=2048: 6 norms x 32 MB a step);
    here the backward recomputes it from the input.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = (x.float() * rstd).to(x.dtype)  # (..., d) as in the forward
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)  # (d,)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype).float()  # d(loss)/d(normed), rounded as autograd's cast would
            xhat = x.float() * rstd  # (..., d) fp32
            grad_x = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def matmul_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast once to the autocast dtype when autocast is on (else ``x``): autocast casts an
    activation at every projection that reads it, and each cast copy is kept for the backward, so
    projections sharing an input (k and v, gate and up) share one copy instead."""
    kind = x.device.type
    if x.is_floating_point() and torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return x.to(torch.get_autocast_dtype(kind))
    return x


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = matmul_input(x)  # (..., D), one cast copy for gate and up
        g, u = self.gate_proj(x), self.up_proj(x)  # (..., I)
        if not torch.is_grad_enabled():  # inference (drafting): the forward of _SwiGLUDown, called directly
            return F.linear(F.silu(g) * u, self.down_proj.weight.to(g.dtype))  # (..., D)
        return _SwiGLUDown.apply(g, u, self.down_proj.weight)  # (..., D)


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(g) * u) whose backward keeps g, u and the down weight itself only. Autograd of the
    plain formula also keeps silu(g) and down's input silu(g) * u — two (tokens x intermediate)
    buffers per layer and sub-step (d=4096: 56 MB each per 2,048 tokens in bf16) — and, under
    autocast, a low-precision copy of the down weight for the whole step (112 MB at d=4096). The
    weight is cast to g's dtype at use, in the forward and again in the backward; the ops and their
    dtypes are those of the plain formula, so values and gradients are the same."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u, weight)
        return F.linear(F.silu(g) * u, weight.to(g.dtype))  # (..., D)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u, weight = ctx.saved_tensors
        s = F.silu(g)  # (..., I)
        grad = grad.to(g.dtype)  # (..., D)
        grad_h = grad @ weight.to(g.dtype)  # (..., I)
        grad_w = None
        if ctx.needs_input_grad[2]:
            h = (s * u).reshape(-1, s.shape[-1])  # (N, I)
            grad_w = (grad.reshape(-1, grad.shape[-1]).T @ h).to(weight.dtype)  # (D, I)
        grad_g = torch.ops.aten.silu_backward(grad_h * u, g)  # the kernel autograd of F.silu runs
        return grad_g, grad_h * s, grad_w


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
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin (L, Dh) of positions < L
        self._use_table = False

    @contextmanager
    def table(self, limit: int, dtype: torch.dtype, device: torch.device):
        """Within the block, inference calls at positions < ``limit`` read cos/sin from a table (built once,
        grown by doubling, in ``dtype`` on ``device``) instead of computing them per call. RoPE
        types whose frequencies depend on the sequence length (dynamic, longrope) always compute."""
        if "dynamic" in self.inner.rope_type or self.inner.rope_type == "longrope":
            yield
            return
        cos = None if self._table is None else self._table[0]
        if cos is None or cos.shape[0] < limit or cos.dtype != dtype or cos.device != device:
            n = max(limit, 2 * cos.shape[0] if cos is not None else 256)
            with torch.no_grad():  # the values a call at those positions computes
                c, s = self.inner(torch.empty(0, dtype=dtype, device=device), torch.arange(n, device=device)[None])
            half = c.shape[-1] // 2
            self._table = (c[0, :, None], torch.cat([-s[0, :, :half], s[0, :, half:]], -1)[:, None])  # (n, 1, Dh)
        self._use_table = True
        try:
            yield
        finally:
            self._use_table = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (B, H, T, Dh) at integer ``positions`` (B, T)."""
        half = x.shape[-1] // 2
        if self._use_table and not torch.is_grad_enabled():  # sin's first half negated: roll is rotate_half
            cos, sin = self._table[0][positions].transpose(1, 2), self._table[1][positions].transpose(1, 2)
            return x * cos + x.roll(half, -1) * sin  # (B, H, T, Dh): the values of the formula below
        cos, sin = self.inner(x, positions)  # (B, T, Dh)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, Dh)
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

    def rows(self, index: torch.Tensor) -> "KV":
        """Keys/values at the ascending positions ``index`` (views where they are a run, see ``take``)."""
        return KV(take(self.k, 2, index), take(self.v, 2, index))

    def cat(self, other: "KV") -> "KV":
        return KV(torch.cat([self.k, other.k], dim=2), torch.cat([self.v, other.v], dim=2))


@dataclass
class Chain:
    """What a training sub-step reads besides the true states: the draft's own states written by the
    sub-steps before it, and the encodings sub-steps share. Every draft's forward reads this one
    layout; the per-query tensor layout (B, Q, E, d) is read as a chain too (``Chain.of``).

    ``states[v]`` (B, Q_v, d) holds sub-step v+1's outputs at its query positions ``written[v]``
    (Q_v,). A draft encodes the true states once, into ``true``, at the chain's first sub-step, and
    each drafted state once, into ``encoded[v]`` (its keys/values, and a slot draft's slot inputs,
    row for row with ``written[v]``), the first time a sub-step reads it; later sub-steps reuse both
    and read their queries' rows (views where the rows are a run). A chain of k sub-steps trained by
    one backward (training-time test: "EAGLE-3: Scaling up Inference Acceleration of Large Language
    Models via Training-Time Test" §3) so encodes every state once: memory linear in k, not
    k(k-1)/2 re-encoded copies. With ``recompute`` each sub-step's decoder layer is recomputed in the
    backward (``attend``). A sub-step back-propagated on its own (late, align) reads a fresh chain
    (``read``), its drafted states encoded anew (the graph of an earlier encoding is gone after its
    backward), and the true states' encoding through ``shared`` (``models.shared``: once per batch).
    """

    length: int  # T
    recompute: bool = False  # the sub-steps' decoder layers run under activation checkpointing
    states: list[torch.Tensor] = field(default_factory=list)
    written: list[torch.Tensor] = field(default_factory=list)
    encoded: list = field(default_factory=list)
    true: object = None
    shared: object = None  # a ``shared.SharedEncoding``: the true states' encoding computed once per batch
    _lookup: list[torch.Tensor] = field(default_factory=list)

    def set_true(self, encoding) -> None:
        """Keep the true states' ``encoding`` the draft computed, or what ``shared`` hands this sub-step of it."""
        self.true = encoding if self.shared is None else self.shared.take(encoding)

    def add(self, states: torch.Tensor, written: torch.Tensor) -> None:
        """Record a sub-step's outputs (B, Q, d) at positions ``written`` (Q,)."""
        assert states.shape[1] == written.numel(), f"{states.shape[1]} states for {written.numel()} positions"
        lookup = torch.full((self.length,), -1, dtype=torch.long, device=written.device)
        lookup[written] = torch.arange(written.numel(), device=written.device)
        self.states.append(states)
        self.written.append(written)
        self._lookup.append(lookup)

    def rows(self, v: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows of ``states[v]`` (and ``encoded[v]``) holding the states at ``positions`` (Q,)."""
        rows = self._lookup[v][positions]  # (Q,)
        assert bool((rows >= 0).all()), f"a sub-step reads positions sub-step {v + 1} did not write"
        return rows

    def diagonal(self, query_index: torch.Tensor) -> list[torch.Tensor]:
        """E x (Q,): for each sub-step v, the rows of ``states[v]`` holding query p's state at p-E+v."""
        ne = len(self.states)
        return [self.rows(v, query_index - ne + v) for v in range(ne)]

    @classmethod
    def of(cls, extras: torch.Tensor, query_index: torch.Tensor, length: int) -> "Chain":
        """The per-query layout ``extras`` (B, Q, E, d) — query p's own drafted states at u = p-E .. p-1 —
        as the chain of E sub-steps that wrote them (views of ``extras``; nothing encoded yet)."""
        _, nq, ne, _ = extras.shape
        assert nq == query_index.numel(), f"extras for {nq} queries, {query_index.numel()} queries"
        chain = cls(length)
        for v in range(ne):
            written = query_index - ne + v  # (Q,)
            assert bool((written >= 0).all()), f"a query before position {ne} has {ne} drafted states"
            chain.add(extras[:, :, v], written)  # (B, Q, d)
        return chain

    def read(self, query_index: torch.Tensor) -> "Chain":
        """A fresh chain of the states ``query_index`` (Q,) reads (rows of each sub-step's states, views
        where they are a run), nothing encoded: for a sub-step back-propagated on its own."""
        chain = Chain(self.length)
        for states, written, rows in zip(self.states, self.written, self.diagonal(query_index)):
            chain.add(take(states, 1, rows), take(written, 0, rows))  # (B, Q, d) at (Q,)
        return chain

    def attend(self, fn, *args) -> torch.Tensor:
        """``fn(*args)`` (a draft's decoder layer over its queries), recomputed in the backward when
        ``recompute`` (its inputs are kept, its activations are not)."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def encode(self, fn) -> list:
        """``encoded``, after encoding each state not yet encoded with ``fn(states (B, Q_v, d), written (Q_v,))``."""
        while len(self.encoded) < len(self.states):
            v = len(self.encoded)
            self.encoded.append(fn(self.states[v], self.written[v]))
        return self.encoded


def take(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x`` at the ascending ``index`` along ``dim``: a view when it is a contiguous run, else a copy."""
    n = index.numel()
    if n:
        first = int(index[0])
        if int(index[-1]) - first + 1 == n:
            return x.narrow(dim, first, n)
    return x.index_select(dim, index)


def decoding_attention(device: torch.device):
    """The fused attention kernels decoding may use on ``device``: on CUDA, every SDPA kernel but
    cuDNN's. PyTorch (2.11, Hopper) picks cuDNN's kernel for masked bf16 attention, and it builds an
    execution plan for every new input shape: measured at 9.8 ms of host time per call on an H200
    (``benchmarks/results/decoding_gpu_profile.txt``). Training sees few shapes; decoding sees a new one at
    nearly every call (the context grows each round, each tree level has its own query count), so
    there the flash and memory-efficient kernels, which need no plan, do the work. Elsewhere: no change."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def masked_attention(q: torch.Tensor, kv: KV, visible: torch.Tensor | None) -> torch.Tensor:
    """GQA attention of q (B, H, Q, Dh) over kv (B, Hkv, K, Dh) with visibility (B, Q, K) bool, or
    None (every key visible to every query: a drafted chain), or a float (B, Q, K) additive bias
    (0 visible, -inf hidden) in which every row has a visible key (a drafted tree: the true entries).

    Returns (B, H, Q, Dh); a query row with no visible key yields zeros.
    """
    bsz, heads, nq, dh = q.shape
    if kv.length == 0:
        return torch.zeros_like(q)
    groups = heads // kv.k.shape[1]
    if visible is None or visible.is_floating_point():  # no row without a key: the mask goes in as it is
        bias = None if visible is None else visible[:, None].to(q.dtype)  # (B, 1, Q, K)
        expand = groups > 1 and bias is not None and q.device.type != "cpu"  # as below: CUDA's masked kernel
        k = kv.k.repeat_interleave(groups, dim=1) if expand else kv.k  # (B, H or Hkv, K, Dh)
        v = kv.v.repeat_interleave(groups, dim=1) if expand else kv.v  # (B, H or Hkv, K, Dh)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=groups > 1 and not expand)
    assert visible.shape == (bsz, nq, kv.length), f"mask {tuple(visible.shape)} != {(bsz, nq, kv.length)}"
    # CPU's fused kernel takes the KV heads as they are with a mask; CUDA's masked (memory-efficient)
    # kernel does not (it would fall back to the math path), so there they are repeated per query head
    gqa = groups > 1 and q.device.type == "cpu"
    expand = groups > 1 and not gqa
    k = kv.k.repeat_interleave(groups, dim=1) if expand else kv.k  # (B, H or Hkv, K, Dh)
    v = kv.v.repeat_interleave(groups, dim=1) if expand else kv.v  # (B, H or Hkv, K, Dh)
    any_key = visible.any(dim=-1)  # (B, Q)
    safe = visible | ~any_key[..., None]  # rows with no key attend everywhere, then get zeroed
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe[:, None], enable_gqa=gqa)  # (B, H, Q, Dh)
    return out * any_key[:, None, :, None].to(out.dtype)


def attention(q: torch.Tensor, kv: KV, visible: torch.Tensor | None, extra: list[KV] | None = None) -> torch.Tensor:
    """Attention over shared keys plus one own key per query in each of ``extra``'s diagonals.

    q (B, H, Q, Dh) sees the shared ``kv`` (B, Hkv, K, Dh) where ``visible`` (B, Q, K) says so, and
    ``extra[v]`` (k, v: (B, Hkv, Q, Dh)): the key of query q's own drafted state written at an
    earlier sub-step (the training-time-test / late-stage layout, one "diagonal" per step: "SpecForge:
    A Flexible and Efficient Open-Source Training Framework for Speculative Decoding" Alg. 1), one
    softmax over all of them. The shared part is one masked SDPA call
    (fused kernels); the diagonals join it through the shared part's log-sum-exp, so nothing
    grows with the number of diagonals but (B, H, Q) scores, and no key is copied per query.
    """
    if not extra:
        return masked_attention(q, kv, visible)
    bsz, heads, nq, dh = q.shape
    if visible is None:
        visible = torch.ones(bsz, nq, kv.length, dtype=torch.bool, device=q.device)  # (B, Q, K)
    hkv = kv.k.shape[1]
    for d in extra:
        assert d.k.shape == (bsz, hkv, nq, dh), f"diagonal keys {tuple(d.k.shape)} do not match {nq} queries"
    shared = masked_attention(q, kv, visible)  # (B, H, Q, Dh), zero rows where no key is visible
    lse = shared_logsumexp(q, kv, visible)  # (B, H, Q), -inf where no key is visible
    qg = q.view(bsz, hkv, heads // hkv, nq, dh)  # (B, Hkv, G, Q, Dh)
    own = [(qg * d.k[:, :, None]).sum(-1).float().view(bsz, heads, nq) * dh**-0.5 for d in extra]  # E x (B, H, Q)
    w = torch.softmax(torch.stack([lse, *own], dim=-1), dim=-1).to(q.dtype)  # (B, H, Q, 1+E)
    out = w[..., :1] * shared  # (B, H, Q, Dh)
    for i, d in enumerate(extra):
        wi = w[..., 1 + i].view(bsz, hkv, heads // hkv, nq, 1)  # (B, Hkv, G, Q, 1)
        out = out + (wi * d.v[:, :, None]).view(bsz, heads, nq, dh)
    return out


def block_attention(q: torch.Tensor, context: KV, visible: torch.Tensor, block: KV | None, size: int) -> torch.Tensor:
    """Attention of the positions of N blocks of ``size`` ("DFlash: Block Diffusion for Flash Speculative
    Decoding" §3.2): each query sees the context keys ``visible`` (B, Q, L) allows and, with ``block``,
    every key of its own block, in one softmax.

    q (B, H, Q, Dh) with Q = N * size (block-major); ``context`` (B, Hkv, L, Dh); ``block`` keys/values
    (B, Hkv, Q, Dh) of the same positions, or None (context only: ``masked_attention``). The context part
    is one masked SDPA call, the in-block part N small (size x size) products, joined through the context
    part's log-sum-exp — nothing is (Q x L+Q): blocks never attend to each other. Returns (B, H, Q, Dh).
    """
    shared = masked_attention(q, context, visible)  # (B, H, Q, Dh), zero rows where no context key is visible
    if block is None:
        return shared
    bsz, heads, nq, dh = q.shape
    hkv, n = block.k.shape[1], nq // size
    assert n * size == nq and block.k.shape == (bsz, hkv, nq, dh), f"{nq} queries are not blocks of {size}"
    lse = shared_logsumexp(q, context, visible)  # (B, H, Q), -inf where no context key is visible
    qg = q.view(bsz, hkv, heads // hkv, n, size, dh)  # (B, Hkv, G, N, S, Dh)
    kb = block.k.view(bsz, hkv, 1, n, size, dh)  # (B, Hkv, 1, N, S, Dh)
    vb = block.v.view(bsz, hkv, 1, n, size, dh)
    own = (qg @ kb.transpose(-1, -2)).float() * dh**-0.5  # (B, Hkv, G, N, S, S)
    scores = torch.cat([lse.view(bsz, hkv, heads // hkv, n, size, 1), own], dim=-1)  # (B, Hkv, G, N, S, 1+S)
    w = torch.softmax(scores, dim=-1).to(q.dtype)
    out = w[..., :1] * shared.view(bsz, hkv, heads // hkv, n, size, dh) + w[..., 1:] @ vb  # (B, Hkv, G, N, S, Dh)
    return out.reshape(bsz, heads, nq, dh)


def shared_logsumexp(q: torch.Tensor, kv: KV, visible: torch.Tensor, budget: int = 1 << 24) -> torch.Tensor:
    """log sum_k exp(q.k / sqrt(Dh)) over each query's visible shared keys: (B, H, Q) fp32, -inf where none.

    Computed in query chunks of about ``budget`` scores under activation checkpointing: the
    (Q, K) scores exist one chunk at a time, in the forward and again in the backward, and are
    never kept between them.
    """
    bsz, heads, nq, dh = q.shape
    if kv.length == 0:
        return q.new_full((bsz, heads, nq), float("-inf"), dtype=torch.float32)
    step = max(1, budget // max(1, bsz * heads * kv.length))
    parts = [
        checkpoint(_chunk_logsumexp, q[:, :, lo : lo + step], kv.k, visible[:, lo : lo + step], use_reentrant=False)
        for lo in range(0, nq, step)
    ]
    return torch.cat(parts, dim=2)  # (B, H, Q)


def _chunk_logsumexp(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    bsz, heads, n, dh = q.shape
    hkv = k.shape[1]
    qg = q.reshape(bsz, hkv, heads // hkv, n, dh)  # (B, Hkv, G, n, Dh)
    scores = (qg @ k[:, :, None].transpose(-1, -2)).float() * dh**-0.5  # (B, Hkv, G, n, K)
    any_key = visible.any(dim=-1, keepdim=True)  # (B, n, 1)
    safe = (visible | ~any_key)[:, None, None]  # (B, 1, 1, n, K): rows with no key stay finite (no NaN grads)
    lse = torch.logsumexp(scores.masked_fill(~safe, float("-inf")), dim=-1)  # (B, Hkv, G, n)
    lse = torch.where(any_key[:, None, None, :, 0], lse, torch.full_like(lse, float("-inf")))
    return lse.reshape(bsz, heads, n)  # fp32


def prefix_visible(cutoff: torch.Tensor, length: int, bsz: int) -> torch.Tensor:
    """(B, Q, L) bool: key index u is visible to query q iff u < cutoff[q] (cutoff (Q,))."""
    u = torch.arange(length, device=cutoff.device)
    return (u[None, :] < cutoff[:, None])[None].expand(bsz, -1, -1)  # (B, Q, L)



def substep_chain(
    input_ids: torch.Tensor,
    features: torch.Tensor,
    query_index: torch.Tensor,
    cutoff: torch.Tensor,
    extras: torch.Tensor | Chain,
) -> Chain:
    """The chain a training sub-step reads: ``extras`` itself, or the per-query layout (B, Q, E, d)
    read as one (``Chain.of``), after checking the sub-step's shapes against input_ids (B, T)."""
    bsz, t = input_ids.shape
    assert features.shape[:2] == (bsz, t), f"features {tuple(features.shape)} vs input_ids {(bsz, t)}"
    assert cutoff.shape == query_index.shape, f"cutoff {tuple(cutoff.shape)} vs queries {tuple(query_index.shape)}"
    if isinstance(extras, Chain):
        assert extras.length == t, f"a chain over {extras.length} positions, input_ids over {t}"
        return extras
    assert extras.shape[:2] == (bsz, query_index.numel()), "extras do not match the queries"
    return Chain.of(extras, query_index, t)
