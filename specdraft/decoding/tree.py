"""Draft trees: EAGLE-2 dynamic trees, chains, and their verification mask and positions.

``build_draft_tree`` is the context-aware dynamic draft tree of "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees" §4:
* expansion (§4.1): the root's top-k children form depth 1; at every further depth the k
  nodes of the latest layer with the highest *value* (cumulative draft log-probability of
  the root-to-node path, log V_i = Σ log c_j) are queried together with tree attention and
  each contributes its top-k children (k² candidates, all kept);
* reranking (§4.2): of all drafted nodes, the ``total_tokens`` with the highest value are
  kept (ties: shallower first, then older). A child's value never exceeds its parent's, so
  the kept set is a connected tree; it is flattened parents-first.

``build_draft_chain`` drafts γ tokens one after another (greedy, or sampled from the warped
draft distribution, recorded as each node's proposal for speculative sampling);
``chain_of_tokens`` wraps tokens chosen elsewhere (prompt lookup) as a deterministic chain.

Nothing here reads the device: the expansion, the reranking (stable sorts on the device) and the
flattening stay queued, so a round's only host synchronisation is its acceptance's
(``verify``). A chain's structure (parents, depths, its triangular ancestor matrix) is built once
per length and device (``chain_structure``) and shared by every round.

Conventions: node 0 of a ``DraftTree`` is the root (the last committed token t_n, at
position n, not yet seen by the target); a node at depth d sits at position n + d.
``depth`` counts drafted levels (EAGLE-2's code calls depth 6 "depth=5" plus the root's
expansion); ``total_tokens`` counts drafted nodes, so verification feeds 1 + total_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from specdraft.decoding.drafting import (
    DraftContext,
    DraftPool,
    draft_chain,
    end_round,
    new_pool,
    query_level,
    rope_for_round,
)
from specdraft.configs.decode import SamplingConfig
from specdraft.placement import host_ids


@dataclass
class DraftTree:
    """A flattened draft tree, parents before children; node 0 is the root."""

    tokens: torch.Tensor  # (N+1,) long
    parents: torch.Tensor  # (N+1,) long, -1 for the root
    depths: torch.Tensor  # (N+1,) long, 0 for the root
    ancestors: torch.Tensor  # (N+1, N+1) bool: [i, j] = j is i or an ancestor of i
    scores: torch.Tensor  # (N+1,) float: cumulative draft log-prob of the path
    proposals: torch.Tensor | None = None  # (N+1, V): distribution each node was sampled from; None = chosen
    height: int | None = None  # a bound on max(depths) known without reading the device (exact for a chain)
    chain: bool = False  # root -> 1 -> 2 -> ... (node i's parent is i - 1): acceptance takes the short way

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def children(self) -> list[list[int]]:
        """Children of every node, in flattened order (the order verification tries them)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids


def ancestors_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self matrix (N, N) bool of a parents-first tree given ``parents`` (N,)."""
    n = parents.numel()
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    for i, p in enumerate(parents.tolist()):
        assert p < i, f"node {i} has parent {p}: parents must come first"
        if p >= 0:
            anc[i] |= anc[p]
    return anc


def tree_position_ids(depths: torch.Tensor, past: int) -> torch.Tensor:
    """Target position ids (1, N): the root sits right after the ``past`` cached tokens."""
    return (past + depths)[None]  # (1, N)


def tree_attention_mask(
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    past: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Additive float mask (1, 1, N, past + N): every node sees the cached prefix and its ancestors.

    With ``sliding_window`` w a key is also hidden when the query is w or more positions past it
    (the transformers convention ``q - k < w``).
    """
    n = ancestors.shape[0]
    device = ancestors.device
    visible = torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), ancestors], dim=1)  # (N, past+N)
    if sliding_window is not None:
        q_pos = past + depths  # (N,)
        k_pos = torch.cat([torch.arange(past, device=device), past + depths])  # (past+N,)
        visible &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    mask = torch.zeros(n, past + n, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]  # (1, 1, N, past+N)


@lru_cache(maxsize=64)
def chain_structure(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parents (k+1,), depths (k+1,), ancestors (k+1, k+1) and zero values (k+1,) of a chain
    root -> 1 -> ... -> k, built once per (k, device); shared, never written."""
    steps = torch.arange(k + 1, device=device)  # (k+1,)
    zeros = torch.zeros(k + 1, dtype=torch.float64, device=device)
    return steps - 1, steps, steps[None, :] <= steps[:, None], zeros  # lower triangle


def _flatten(pool: DraftPool, keep: torch.Tensor, height: int) -> DraftTree:
    """The pool's nodes ``keep`` (N+1,) (root first, parents before children) as a DraftTree."""
    device = pool.tokens.device
    where = torch.full((pool.size,), -1, dtype=torch.long, device=device)
    where[keep] = torch.arange(keep.numel(), device=device)
    old_parents = pool.parents[keep]  # (N+1,)
    parents = torch.where(old_parents >= 0, where[old_parents.clamp(min=0)], -1)  # (N+1,): kept, as the rerank keeps
    return DraftTree(
        tokens=pool.tokens[keep],
        parents=parents,
        depths=pool.depths[keep],
        ancestors=pool.ancestors[keep][:, keep],
        scores=pool.scores[keep],
        height=height,
    )


@torch.no_grad()
def build_draft_tree(ctx: DraftContext, *, depth: int = 6, topk: int = 10, total_tokens: int = 60) -> DraftTree:
    """EAGLE-2 dynamic draft tree from the draft context's root (see the module docstring)."""
    assert depth >= 1 and topk >= 1 and total_tokens >= 1, (
        f"depth, topk and total_tokens must be >= 1 (got {depth}, {topk}, {total_tokens})"
    )
    k = min(topk, ctx.draft.config.output_vocab_size)
    pool = new_pool(ctx, 1 + k + (depth - 1) * k * k)
    device = pool.tokens.device
    levels = (ctx.root_pos + torch.arange(depth, device=device)).view(depth, 1, 1).expand(depth, 1, k)  # (D, 1, k)
    try:
        frontier = torch.zeros(1, dtype=torch.long, device=device)  # (F,): the root
        values = pool.scores[:1]  # (F,): the frontier's values (the root's: 0)
        with rope_for_round(ctx, pool):
            for level in range(depth):
                logp = query_level(ctx, pool, frontier, levels[level, :, : frontier.numel()], level == 0)  # (F, V)
                top = logp.topk(k, dim=-1)  # (F, k)
                cand = (values[:, None] + top.values.clamp(max=0).double()).flatten()  # (F*k,): never grows
                start = pool.size  # the new nodes: start .. start + F*k - 1
                pool.add(top.indices.flatten(), frontier.repeat_interleave(k), cand, level + 1)
                if level + 1 < depth:
                    best = cand.topk(min(k, cand.numel())).indices.sort().values  # (k,): in pool order
                    frontier, values = best + start, cand[best]  # the latest layer's best values
    finally:
        end_round(ctx)
    # rerank: the total_tokens best values; ties: shallower first, then older. The pool holds the levels in
    # order (its index order is (depth, index) order), so one stable sort by value is the lexicographic one
    n = pool.size
    order = torch.argsort(-pool.scores[1:n], stable=True) + 1  # (n-1,): (-value, depth, index)
    kept = order[:total_tokens]  # (N,)
    kept = kept[torch.argsort(pool.depths[kept], stable=True)]  # parents first; siblings by value
    root = torch.zeros(1, dtype=torch.long, device=kept.device)
    return _flatten(pool, torch.cat([root, kept]), depth)


@torch.no_grad()
def build_draft_chain(
    ctx: DraftContext,
    *,
    gamma: int = 5,
    sampling: SamplingConfig = SamplingConfig(),
    generator: torch.Generator | None = None,
) -> DraftTree:
    """A chain of ``gamma`` draft tokens: argmax when greedy, else sampled from the warped draft
    distribution (kept as each node's proposal so verification can run speculative sampling)."""
    assert gamma >= 1, f"gamma must be >= 1, got {gamma}"
    tokens, scores, proposals = draft_chain(ctx, gamma, sampling, generator)  # (γ+1,), (γ+1,), (γ+1, V) | None
    parents, depths, ancestors, _ = chain_structure(gamma, tokens.device)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, ancestors=ancestors, scores=scores,
                     proposals=proposals, height=gamma, chain=True)


def chain_of_tokens(root: int, tokens, device: torch.device | str = "cpu") -> DraftTree:
    """A chain root -> tokens[0] -> ... of deterministic choices (``proposals=None``: q = δ_x);
    ``tokens`` (k,) (a tensor, numpy array or list) may be empty (a root-only tree: the round is a
    plain decode step)."""
    rest = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    assert all(isinstance(t, int) for t in rest), "chain tokens must be (k,) token ids"
    ids = [int(root), *rest]
    k = len(rest)
    device = torch.device(device)
    parents, depths, ancestors, zeros = chain_structure(k, device)
    return DraftTree(tokens=host_ids(ids, device), parents=parents, depths=depths, ancestors=ancestors,
                     scores=zeros, height=k, chain=True)
