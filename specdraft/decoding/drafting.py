"""The draft's side of speculative decoding: a cache of true states plus tree-attention queries.

Drafting asks the draft through its protocol (``models.Draft``), whatever its architecture:
* ``encode_committed`` — cache entries of committed true states, and the root query's input;
* ``encode_nodes`` — drafted nodes' query inputs, and the entries they add before their query
  (seen by the node itself and its descendants);
* ``attend`` — the draft's predicted states for queries over the cache, with a visibility mask;
* ``encode_drafted`` — entries a node's predicted state adds after its query (its descendants'),
  when the context concatenates them (``concate``).

Beagle ("Cross-Attention Speculative Decoding" §4.1) caches keys/values of the target's true states;
a query token at position p sees states u < p; with "concate" each drafted state is appended after
its query and seen by its descendants only. EAGLE / EAGLE-3 ("EAGLE-2: Faster Inference of Language
Models with Dynamic Draft Trees" §4.1, tree attention) cache slots: slot c pairs t_c with the state
of c-1 (slots start at position 1); the root slot uses the true state before it, a drafted node's
slot its parent's predicted state, and a query sees the true slots plus the slots of its ancestors
and itself. An EAGLE-3 draft reads the target's auxiliary-layer features (projected by its fc) and
predicts over its draft vocabulary, mapped back to target ids through ``d2t`` (``target_logprobs``).

Every round starts from true states only (``DraftContext`` is cropped back after drafting)
and ``advance_draft`` appends the states the target just verified. The cache is a preallocated
``KVCache`` (capacity: prompt + new tokens + one round's drafted entries): appending m entries copies
m entries, cropping copies nothing. ``draft_chain`` drafts a chain with no pool and no mask (every
key is visible to a chain's queries); ``query_nodes`` serves trees, its visibility mask written into
one per-round buffer. Nothing here reads the device (no host synchronisation while drafting).

State-index convention (shared with training): committed tokens t_0..t_n, the root t_n is
the last committed token (not yet seen by the target), true states h_0..h_{n-1} are known.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from specdraft.decoding.sampling import draw, target_probs
from specdraft.configs.decode import SamplingConfig
from specdraft.models.kvcache import KVCache
from specdraft.placement import host_ids


@dataclass
class DraftContext:
    """The draft's cache over the committed sequence (true entries only between rounds)."""

    draft: torch.nn.Module
    cache: KVCache
    root_pos: int  # n: position of the root token t_n
    root_token: int
    root_input: torch.Tensor  # the root query's input (1, 1, ...), encoded with the committed states
    true_length: int  # cache entries holding true states (the rest, during a round, are drafted)
    concate: bool = True  # append drafted states after their query (``Draft.encode_drafted``)
    dtype: torch.dtype = torch.float32  # the draft's (read once: ``module.parameters()`` walks the module tree)
    device: torch.device = torch.device("cpu")
    pool: DraftPool | None = None  # a tree round's node pool, reused (``new_pool``)


@dataclass
class DraftPool:
    """All nodes drafted in one round, in preallocated tensors: node 0 is the root and a parent
    always precedes its children."""

    tokens: torch.Tensor  # (C,) long
    parents: torch.Tensor  # (C,) long, -1 for the root
    depths: torch.Tensor  # (C,) long
    scores: torch.Tensor  # (C,) float64: cumulative draft log-prob of the root-to-node path
    ancestors: torch.Tensor  # (C, C) bool: ancestor-or-self
    states: torch.Tensor  # (C, d): predicted state of every queried node
    owners: torch.Tensor  # (C,) long: the node owning each drafted cache entry, in order
    size: int = 0
    owned: int = 0  # drafted cache entries (the first ``owned`` of ``owners``)
    visible: torch.Tensor | None = None  # (Q, true + C) additive mask of the queries: true entries always visible
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # () 0 and -inf in the mask's dtype

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depth: int) -> None:
        """Append nodes (m,) at ``depth`` under existing ``parents`` (m,) (nodes before them): they take
        indices ``size .. size + m - 1``. Every row they take is written whole."""
        m, start = tokens.numel(), self.size
        assert start + m <= self.tokens.numel(), f"draft pool full ({self.tokens.numel()} nodes)"
        end = start + m
        self.tokens[start:end] = tokens
        self.parents[start:end] = parents
        self.scores[start:end] = scores
        self.depths[start:end] = depth
        self.ancestors[start:end] = self.ancestors[parents]  # (m, C): the parents' ancestors-or-self ...
        self.ancestors[start:end, start:end].diagonal().fill_(True)  # ... and themselves
        self.size = end

    def own(self, nodes: torch.Tensor) -> None:
        """Record that the cache's next entries (one per node of ``nodes`` (Q,)) belong to ``nodes``."""
        self.owners[self.owned : self.owned + nodes.numel()] = nodes
        self.owned += nodes.numel()


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _rope_below(draft: torch.nn.Module, limit: int, dtype: torch.dtype, device: torch.device):
    """The draft's RoPE from a table for positions < ``limit`` (``layers.Rotary.table``) in the block."""
    rotary = getattr(draft, "rotary", None)
    return rotary.table(limit, dtype, device) if rotary is not None else nullcontext()


def start_draft(
    draft: torch.nn.Module,
    prompt_ids: torch.Tensor,
    features: torch.Tensor,
    first_token: int,
    concate: bool = True,
    capacity: int = 0,
) -> DraftContext:
    """Draft context after the target's prefill of ``prompt_ids`` (1, P) with its features (1, P, F)
    (the last hidden states, or the auxiliary layers an EAGLE-3 draft reads); ``capacity``: cache
    entries to preallocate (the cache grows, by doubling, past it)."""
    assert prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1, f"batch 1 only, got {tuple(prompt_ids.shape)}"
    n = prompt_ids.shape[1]
    assert n >= 1 and features.shape[:2] == (1, n), f"features {tuple(features.shape)} do not match {n} prompt tokens"
    device, dtype = _device(draft), _dtype(draft)  # the target's ids and features may live on other GPUs
    tokens = torch.cat([prompt_ids.to(device), prompt_ids.new_tensor([[first_token]]).to(device)], dim=1)  # (1, P+1)
    states = draft.project(features.to(device, dtype))  # (1, P, d)
    with _rope_below(draft, max(capacity, n + 1), dtype, device):
        root_input, kv = draft.encode_committed(tokens, states, 0)
    cache = KVCache(capacity)
    cache.append(kv)
    return DraftContext(draft, cache, root_pos=n, root_token=int(first_token), root_input=root_input,
                        true_length=cache.length, concate=concate, dtype=dtype, device=device)


def advance_draft(ctx: DraftContext, tokens: list[int], features: torch.Tensor) -> None:
    """Commit ``tokens`` = accepted drafts + the next root, whose target features (1, len, F) the
    target just computed at positions n .. n+len-1 (the old root and the accepted drafts)."""
    m = len(tokens)
    assert m >= 1 and features.shape[:2] == (1, m), f"{m} tokens but features {tuple(features.shape)}"
    assert ctx.cache.length == ctx.true_length, "draft cache holds drafted entries: end the round first"
    device = ctx.device
    states = ctx.draft.project(features.to(device, ctx.dtype))  # (1, m, d)
    committed = host_ids([ctx.root_token, *tokens], device)[None]  # (1, m+1): t_n .. t_{n+m}
    with _rope_below(ctx.draft, ctx.root_pos + m + 1, ctx.dtype, device):
        ctx.root_input, kv = ctx.draft.encode_committed(committed, states, ctx.root_pos)
    ctx.cache.append(kv)
    ctx.true_length = ctx.cache.length
    ctx.root_pos += m
    ctx.root_token = int(tokens[-1])


def true_length(ctx: DraftContext) -> int:
    """Cache entries that hold true states (Beagle: n states; EAGLE: slots 1..n, the root's included;
    a 0.1 EAGLE draft also has its zero-state slot 0)."""
    return ctx.true_length


def new_pool(ctx: DraftContext, capacity: int) -> DraftPool:
    """A pool holding only the root, for a round drafting at most ``capacity - 1`` nodes. Its tensors are
    allocated once per context and capacity and reused every round: ``add`` writes every row it takes,
    so only the root's token changes."""
    assert ctx.cache.length == ctx.true_length, "draft cache holds drafted entries: crop it first"
    ctx.cache.reserve(ctx.true_length + capacity)  # the round's drafted entries fit without growing
    pool = ctx.pool
    if pool is None or pool.tokens.numel() != capacity:
        device, d = ctx.device, ctx.draft.config.hidden_size
        pool = DraftPool(
            tokens=torch.zeros(capacity, dtype=torch.long, device=device),
            parents=torch.full((capacity,), -1, dtype=torch.long, device=device),
            depths=torch.zeros(capacity, dtype=torch.long, device=device),
            scores=torch.zeros(capacity, dtype=torch.float64, device=device),
            ancestors=torch.zeros(capacity, capacity, dtype=torch.bool, device=device),
            states=torch.zeros(capacity, d, dtype=ctx.dtype, device=device),
            owners=torch.zeros(capacity, dtype=torch.long, device=device),
        )
        pool.ancestors[0, 0] = True  # the root: depth 0, value 0, no parent
        ctx.pool = pool
    pool.size, pool.owned, pool.visible = 1, 0, None
    pool.tokens[0].fill_(ctx.root_token)  # a fill, not a copy from the host
    return pool


def end_round(ctx: DraftContext) -> None:
    """Drop the drafted entries: the next round starts from true states only."""
    ctx.cache.crop(ctx.true_length)


@torch.no_grad()
def query_nodes(ctx: DraftContext, pool: DraftPool, nodes: torch.Tensor, root: bool | None = None) -> torch.Tensor:
    """Run the draft on pool ``nodes`` (Q,) with tree attention (``root``: ``nodes`` is the root alone,
    whose input came with the committed states; it is always queried first, alone. None: look — one
    read of the device).

    Returns the draft's log-probabilities (Q, V) of the token after each node. Each query
    sees all true entries and the drafted entries of its ancestors (and its own, if it has one
    before its query).
    """
    if root is None:
        root = nodes.numel() == 1 and int(nodes[0]) == 0
    with rope_for_round(ctx, pool):
        return query_level(ctx, pool, nodes, (ctx.root_pos + pool.depths[nodes])[None], root)


def rope_for_round(ctx: DraftContext, pool: DraftPool):
    """The draft's RoPE table for every position a round's nodes can take (depth < the pool's capacity)."""
    return _rope_below(ctx.draft, ctx.root_pos + pool.tokens.numel(), ctx.dtype, ctx.device)


def query_level(ctx: DraftContext, pool: DraftPool, nodes: torch.Tensor, pos: torch.Tensor, root: bool) -> torch.Tensor:
    """``query_nodes`` for a caller that knows the nodes' positions ``pos`` (1, Q) (a tree level: the root's
    position + its depth), inside ``rope_for_round`` and ``torch.no_grad``."""
    draft, cache, q = ctx.draft, ctx.cache, nodes.numel()
    keep_states = draft.config.reads_parent_states  # Beagle's queries read tokens only
    if root:
        x, visible = ctx.root_input, None  # only true entries exist yet: all visible
    else:
        parent_h = pool.states[pool.parents[nodes]][None] if keep_states else None  # (1, Q, d)
        x, kv = draft.encode_nodes(pool.tokens[nodes][None], parent_h, pos)
        if kv is not None:  # seen by the node itself and its descendants (a slot)
            cache.append(kv)
            pool.own(nodes)
        t, e = ctx.true_length, pool.owned
        if pool.visible is None or pool.visible.shape[0] < q:  # true entries visible (0), once per round
            pool.visible = torch.zeros(q, t + pool.tokens.numel(), dtype=ctx.dtype, device=nodes.device)
            pool.bias = (pool.visible.new_zeros(()), pool.visible.new_full((), float("-inf")))
        drafted = pool.ancestors[nodes[:, None], pool.owners[None, :e]]  # (Q, E): ancestor-or-self
        shown, hidden = pool.bias  # () 0 and -inf: where() writes the buffer in place with tensors only
        torch.where(drafted, shown, hidden, out=pool.visible[:q, t : t + e])  # additive: every row sees t >= 1
        visible = pool.visible[None, :q, : t + e]  # (1, Q, T+E)
    h = draft.attend(x, pos, cache.view(), visible)  # (1, Q, d)
    if ctx.concate:
        kv = draft.encode_drafted(h, pos)
        if kv is not None:  # the node's own state, appended after its query: its descendants see it
            cache.append(kv)
            pool.own(nodes)
    if keep_states:
        pool.states.index_copy_(0, nodes, h[0])
    return target_logprobs(draft, draft.logits(h)[0])  # (Q, V)


@torch.no_grad()
def draft_chain(
    ctx: DraftContext, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draft ``gamma`` tokens one after another from the root: each query sees every true entry and
    every entry drafted before it (its ancestors'), so no mask. Greedy: the argmax; else a sample of
    the warped draft distribution, which is kept as the node's proposal.

    Returns tokens (γ+1,) (root first), cumulative values (γ+1,) float64 and the proposals (γ+1, V)
    (row 0 unused) or None when greedy."""
    draft, cache = ctx.draft, ctx.cache
    assert cache.length == ctx.true_length, "draft cache holds drafted entries: crop it first"
    device = cache.k.device
    cache.reserve(ctx.true_length + 2 * gamma)  # at most two entries per drafted node
    tokens = torch.empty(gamma + 1, dtype=torch.long, device=device)
    tokens[0].fill_(ctx.root_token)  # a fill, not a copy from the host
    positions = (torch.arange(gamma, device=device) + ctx.root_pos).view(gamma, 1, 1)  # (γ, 1, 1)
    proposals = [] if not sampling.greedy else None
    logps = []
    x, h = ctx.root_input, None
    try:
        with _rope_below(draft, ctx.root_pos + gamma + 1, ctx.dtype, ctx.device):
            for d in range(gamma):
                pos = positions[d]  # (1, 1)
                if d > 0:  # the node's input from its token and its parent's predicted state
                    x, kv = draft.encode_nodes(tokens[d].view(1, 1), h, pos)
                    if kv is not None:
                        cache.append(kv)
                h = draft.attend(x, pos, cache.view(), None)  # (1, 1, d)
                if ctx.concate:
                    kv = draft.encode_drafted(h, pos)
                    if kv is not None:
                        cache.append(kv)
                logp = target_logprobs(draft, draft.logits(h)[0])[0]  # (V,)
                logps.append(logp)
                if proposals is None:
                    tokens[d + 1] = logp.argmax()
                else:
                    q = target_probs(logp, sampling)  # (V,)
                    tokens[d + 1] = draw(q, generator)
                    proposals.append(q)
    finally:
        end_round(ctx)
    step = torch.stack(logps).gather(1, tokens[1:, None])[:, 0].clamp(max=0).double()  # (γ,)
    scores = torch.cat([step.new_zeros(1), step.cumsum(0)])  # (γ+1,): value of each root-to-node path
    stacked = None if proposals is None else torch.stack([torch.zeros_like(proposals[0]), *proposals])  # (γ+1, V)
    return tokens, scores, stacked


def target_logprobs(draft: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Draft log-probabilities over the TARGET vocabulary (Q, V) from the draft's logits (Q, Vd):
    draft id i is target id i + d2t[i]; ids outside the draft vocabulary get -inf."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (Q, Vd)
    if not draft.config.own_vocab:
        return logp
    full = logp.new_full((logp.shape[0], draft.config.vocab_size), float("-inf"))  # (Q, V)
    full[:, draft.heads.target_ids()] = logp
    return full

