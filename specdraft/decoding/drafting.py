"""The draft's side of speculative decoding: a cache of true states plus tree-attention queries.

Beagle drafting (papers/beagle-… §4.1): the cache holds keys/values of the target's true
states; a query token at position p sees states u < p; with "concate" each drafted state is
appended and seen by its descendants only. EAGLE / EAGLE-3 drafting (papers/eagle2-… §4.1,
tree attention): slot c pairs t_c with the state of c-1 (slots start at position 1); the
root slot uses the true state before it, drafted slots use their parent's predicted state,
and a query sees the true slots plus the slots of its ancestors and itself. An EAGLE-3 draft
reads the target's auxiliary-layer features (projected by its fc) and predicts over its draft
vocabulary, mapped back to target ids through ``d2t`` (``target_logprobs``).

Every round starts from true states only (``DraftContext`` is cropped back after drafting)
and ``advance_draft`` appends the states the target just verified.

State-index convention (shared with training): committed tokens t_0..t_n, the root t_n is
the last committed token (not yet seen by the target), true states h_0..h_{n-1} are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdraft.models.layers import KV, KVCache


@dataclass
class DraftContext:
    """The draft's cache over the committed sequence (true states only between rounds)."""

    draft: torch.nn.Module
    cache: KVCache
    root_pos: int  # n: position of the root token t_n
    root_token: int
    root_x: torch.Tensor | None  # EAGLE: fused input (1, 1, d) of the root slot; None for Beagle
    concate: bool = True  # Beagle: append drafted states (EAGLE always feeds them back)

    @property
    def arch(self) -> str:
        return self.draft.config.arch


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
    prompt_ids = prompt_ids.to(device)
    states = draft.project(features.to(device, _dtype(draft)))  # (1, P, d)
    cache = KVCache()
    if draft.config.arch == "beagle":
        cache.append(draft.encode_states(states, torch.arange(n, device=device)[None]))
        return DraftContext(draft, cache, n, int(first_token), None, concate)
    ids = torch.cat([prompt_ids, prompt_ids.new_tensor([[first_token]])], dim=1)  # (1, P+1)
    if draft.config.legacy:  # slots 0..P, slot c <- h_{c-1}, a zero state at slot 0
        prev = torch.cat([states.new_zeros(1, 1, states.shape[-1]), states], dim=1)  # (1, P+1, d)
        x, kv = draft.encode_inputs(ids, prev, torch.arange(n + 1, device=device)[None])
    else:  # slots 1..P, slot c <- h_{c-1}
        x, kv = draft.encode_inputs(ids[:, 1:], states, torch.arange(1, n + 1, device=device)[None])
    cache.append(kv)
    return DraftContext(draft, cache, n, int(first_token), x[:, -1:], True)


def advance_draft(ctx: DraftContext, tokens: list[int], features: torch.Tensor) -> None:
    """Commit ``tokens`` = accepted drafts + the next root, whose target features (1, len, F) the
    target just computed at positions n .. n+len-1 (the old root and the accepted drafts)."""
    m = len(tokens)
    assert m >= 1 and features.shape[:2] == (1, m), f"{m} tokens but features {tuple(features.shape)}"
    device = _device(ctx.draft)
    states = ctx.draft.project(features.to(device, _dtype(ctx.draft)))  # (1, m, d)
    n = ctx.root_pos
    if ctx.arch == "beagle":
        ctx.cache.append(ctx.draft.encode_states(states, torch.arange(n, n + m, device=device)[None]))
    else:
        ids = torch.tensor([tokens], device=device)  # (1, m): t_{n+1} .. t_{n+m}
        x, kv = ctx.draft.encode_inputs(ids, states, torch.arange(n + 1, n + m + 1, device=device)[None])
        ctx.cache.append(kv)
        ctx.root_x = x[:, -1:]
    ctx.root_pos = n + m
    ctx.root_token = int(tokens[-1])


def true_length(ctx: DraftContext) -> int:
    """Cache entries that hold true states (Beagle: n states; EAGLE: slots 1..n, the root's included;
    a 0.1 EAGLE draft also has its zero-state slot 0)."""
    return ctx.root_pos + 1 if ctx.arch != "beagle" and ctx.draft.config.legacy else ctx.root_pos


def new_pool(ctx: DraftContext, capacity: int) -> DraftPool:
    """A pool holding only the root, for a round drafting at most ``capacity - 1`` nodes."""
    assert ctx.cache.length == true_length(ctx), "draft cache holds drafted entries: crop it first"
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
    ctx.cache.crop(true_length(ctx))


@torch.no_grad()
def query_nodes(ctx: DraftContext, pool: DraftPool, nodes: torch.Tensor) -> torch.Tensor:
    """Run the draft on pool ``nodes`` (Q,) with tree attention.

    Returns the draft's log-probabilities (Q, V) of the token after each node. Each query
    sees all true entries and the drafted entries of its ancestors (EAGLE: and itself).
    """
    draft, cache = ctx.draft, ctx.cache
    device = pool.tokens.device
    pos = (ctx.root_pos + pool.depths[nodes])[None]  # (1, Q)
    ids = pool.tokens[nodes][None]  # (1, Q)
    n_true = true_length(ctx)
    root_only = nodes.numel() == 1 and int(nodes[0]) == 0
    if ctx.arch != "beagle":
        if root_only:
            x_in = ctx.root_x  # (1, 1, d)
        else:
            assert bool((pool.depths[nodes] > 0).all()), "the root is queried alone"
            parent_h = pool.states[pool.parents[nodes]][None]  # (1, Q, d)
            x_in, kv = draft.encode_inputs(ids, parent_h, pos)
            cache.append(kv)
            pool.owners += nodes.tolist()
    owners = torch.tensor(pool.owners, dtype=torch.long, device=device)  # (E,)
    drafted = pool.ancestors[nodes][:, owners]  # (Q, E): own entry (EAGLE) is ancestor-or-self
    visible = torch.cat([torch.ones(nodes.numel(), n_true, dtype=torch.bool, device=device), drafted], dim=1)
    if ctx.arch != "beagle":
        h = draft.attend(x_in, pos, cache.view(), visible[None])  # (1, Q, d)
    else:
        kv = cache.view() if cache.length else _empty_kv(draft, device)
        h = draft.attend(ids, pos, kv, visible[None])  # (1, Q, d)
        if ctx.concate:  # the node's own state is appended after its query: descendants see it
            cache.append(draft.encode_states(h, pos))
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


def _empty_kv(draft: torch.nn.Module, device: torch.device) -> KV:
    c = draft.config
    z = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim, device=device, dtype=_dtype(draft))
    return KV(z, z)
