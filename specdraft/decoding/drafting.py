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
and ``advance_draft`` appends the states the target just verified.

State-index convention (shared with training): committed tokens t_0..t_n, the root t_n is
the last committed token (not yet seen by the target), true states h_0..h_{n-1} are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdraft.models.layers import KVCache


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
    size: int = 0
    owners: list[int] = field(default_factory=list)  # node owning each drafted cache entry, in order

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Append nodes (m,) under existing ``parents`` (m,); returns their indices (m,)."""
        m = tokens.numel()
        assert self.size + m <= self.tokens.numel(), f"draft pool full ({self.tokens.numel()} nodes)"
        index = torch.arange(self.size, self.size + m, device=self.tokens.device)  # (m,)
        assert bool((parents < index).all()), "parents must precede their children"
        self.tokens[index] = tokens
        self.parents[index] = parents
        self.scores[index] = scores.to(self.scores.dtype)
        has_parent = parents >= 0
        safe = parents.clamp(min=0)
        self.depths[index] = torch.where(has_parent, self.depths[safe] + 1, 0)
        self.ancestors[index] = self.ancestors[safe] & has_parent[:, None]  # (m, C)
        self.ancestors[index, index] = True
        self.size += m
        return index


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def start_draft(
    draft: torch.nn.Module, prompt_ids: torch.Tensor, features: torch.Tensor, first_token: int, concate: bool = True
) -> DraftContext:
    """Draft context after the target's prefill of ``prompt_ids`` (1, P) with its features (1, P, F)
    (the last hidden states, or the auxiliary layers an EAGLE-3 draft reads)."""
    assert prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1, f"batch 1 only, got {tuple(prompt_ids.shape)}"
    n = prompt_ids.shape[1]
    assert n >= 1 and features.shape[:2] == (1, n), f"features {tuple(features.shape)} do not match {n} prompt tokens"
    device = _device(draft)  # the target's ids and features may live on other GPUs (a spread target)
    tokens = torch.cat([prompt_ids.to(device), prompt_ids.new_tensor([[first_token]]).to(device)], dim=1)  # (1, P+1)
    states = draft.project(features.to(device, _dtype(draft)))  # (1, P, d)
    root_input, kv = draft.encode_committed(tokens, states, 0)
    cache = KVCache()
    cache.append(kv)
    return DraftContext(draft, cache, root_pos=n, root_token=int(first_token), root_input=root_input,
                        true_length=cache.length, concate=concate)


def advance_draft(ctx: DraftContext, tokens: list[int], features: torch.Tensor) -> None:
    """Commit ``tokens`` = accepted drafts + the next root, whose target features (1, len, F) the
    target just computed at positions n .. n+len-1 (the old root and the accepted drafts)."""
    m = len(tokens)
    assert m >= 1 and features.shape[:2] == (1, m), f"{m} tokens but features {tuple(features.shape)}"
    assert ctx.cache.length == ctx.true_length, "draft cache holds drafted entries: end the round first"
    device = _device(ctx.draft)
    states = ctx.draft.project(features.to(device, _dtype(ctx.draft)))  # (1, m, d)
    committed = torch.tensor([[ctx.root_token, *tokens]], device=device)  # (1, m+1): t_n .. t_{n+m}
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
    """A pool holding only the root, for a round drafting at most ``capacity - 1`` nodes."""
    assert ctx.cache.length == ctx.true_length, "draft cache holds drafted entries: crop it first"
    kv = ctx.cache.view()
    device, d = kv.k.device, ctx.draft.config.hidden_size
    pool = DraftPool(
        tokens=torch.zeros(capacity, dtype=torch.long, device=device),
        parents=torch.full((capacity,), -1, dtype=torch.long, device=device),
        depths=torch.zeros(capacity, dtype=torch.long, device=device),
        scores=torch.zeros(capacity, dtype=torch.float64, device=device),
        ancestors=torch.zeros(capacity, capacity, dtype=torch.bool, device=device),
        states=torch.zeros(capacity, d, dtype=_dtype(ctx.draft), device=device),
    )
    one = torch.ones(1, dtype=torch.long, device=device)
    pool.add(one * ctx.root_token, -one, torch.zeros(1, dtype=torch.float64, device=device))
    return pool


def end_round(ctx: DraftContext) -> None:
    """Drop the drafted entries: the next round starts from true states only."""
    ctx.cache.crop(ctx.true_length)


@torch.no_grad()
def query_nodes(ctx: DraftContext, pool: DraftPool, nodes: torch.Tensor) -> torch.Tensor:
    """Run the draft on pool ``nodes`` (Q,) with tree attention.

    Returns the draft's log-probabilities (Q, V) of the token after each node. Each query
    sees all true entries and the drafted entries of its ancestors (and its own, if it has one
    before its query).
    """
    draft, cache = ctx.draft, ctx.cache
    device = pool.tokens.device
    pos = (ctx.root_pos + pool.depths[nodes])[None]  # (1, Q)
    if nodes.numel() == 1 and int(nodes[0]) == 0:  # the root: its input came with the committed states
        x = ctx.root_input
    else:
        assert bool((pool.depths[nodes] > 0).all()), "the root is queried alone"
        parent_h = pool.states[pool.parents[nodes]][None]  # (1, Q, d)
        x, kv = draft.encode_nodes(pool.tokens[nodes][None], parent_h, pos)
        if kv is not None:  # seen by the node itself and its descendants (a slot)
            cache.append(kv)
            pool.owners += nodes.tolist()
    owners = torch.tensor(pool.owners, dtype=torch.long, device=device)  # (E,)
    drafted = pool.ancestors[nodes][:, owners]  # (Q, E): ancestor-or-self
    visible = torch.cat([torch.ones(nodes.numel(), ctx.true_length, dtype=torch.bool, device=device), drafted], dim=1)
    h = draft.attend(x, pos, cache.view(), visible[None])  # (1, Q, d)
    if ctx.concate:
        kv = draft.encode_drafted(h, pos)
        if kv is not None:  # the node's own state, appended after its query: its descendants see it
            cache.append(kv)
            pool.owners += nodes.tolist()
    pool.states[nodes] = h[0]
    return target_logprobs(draft, draft.logits(h)[0])  # (Q, V)


def target_logprobs(draft: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Draft log-probabilities over the TARGET vocabulary (Q, V) from the draft's logits (Q, Vd):
    draft id i is target id i + d2t[i]; ids outside the draft vocabulary get -inf."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (Q, Vd)
    if not draft.config.own_vocab:
        return logp
    full = logp.new_full((logp.shape[0], draft.config.vocab_size), float("-inf"))  # (Q, V)
    full[:, draft.heads.target_ids()] = logp
    return full

