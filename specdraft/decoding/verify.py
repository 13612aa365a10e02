"""Target verification of a draft tree in one forward, acceptance, and KV-cache compaction.

"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §4.2 (tree attention for
verification) and §2 (speculative sampling):
* ``verify_tree`` feeds root + drafted nodes to the target with a 4D additive float mask
  ``[1, 1, q, past + q]`` (each node sees the cached prefix and its ancestors), explicit tree
  ``position_ids`` and the round's cache; every node's logits then equal a plain forward of its
  root-to-node path. The decoding loop passes a ``cache.VerifyMask`` (the mask as a view of one
  preallocated buffer); without one the mask is built here (``tree.tree_attention_mask``).
* ``accept_greedy`` walks from the root, following the child whose token is the target's
  argmax; the first mismatch yields the target's own token (the bonus).
* ``accept_sampling`` is recursive rejection sampling over siblings (SpecInfer; EAGLE's
  ``evaluate_posterior``): child x with proposal q is accepted with prob min(1, p(x)/q(x));
  on rejection p <- norm(max(p - q, 0)) and the next sibling is tried; when all are
  rejected the bonus is sampled from the residual. A child chosen deterministically (top-k
  tree) has q = δ_x, which reduces the rule to "accept with p(x), else zero p(x)" — so the j-th
  sibling is accepted with p(x_j) / (1 - Σ_{i<j} p(x_i)). This preserves the target distribution
  exactly because siblings are distinct, deterministic choices or a single sample from q.
* Both run on the device over the whole tree at once (each node's test does not depend on the walk:
  the walk only decides which tests count) and read ONE packed result to the host: the round's
  single host synchronisation. The path is the chain of nodes whose every ancestor passed.
* ``compact_cache`` keeps the prefix, the root and the accepted path in the target cache
  (``cache.commit`` for the decoding loop's ``TargetCache``: only the path's entries move).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specdraft.decoding.cache import VerifyMask, commit
from specdraft.decoding.sampling import draw, target_probs
from specdraft.configs.decode import SamplingConfig
from specdraft.decoding.tree import DraftTree, tree_attention_mask, tree_position_ids
from specdraft.placement import input_device, output_device
from specdraft.targets.states import aux_states


@dataclass(frozen=True, slots=True)
class Acceptance:
    path: list[int]  # accepted tree nodes (root excluded), root-to-leaf order
    next_token: int | None  # bonus / correction token; None when the path ends on an EOS
    tried: int  # depths whose candidates were tested (α_i denominators: depths 1..tried)
    path_tokens: list[int] | None = None  # the path's tokens when the acceptance read them already


@torch.no_grad()
def target_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor | None = None,
    aux_layers: list[int] | tuple[int, ...] = (),
    last_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's features (1, Q, F) and the logits (1, Q, V) — (1, 1, V) of the last position only
    with ``last_logits`` (a prefill: the lm_head over every prompt position would cost P x V) —,
    extending ``cache``.

    Features: the last hidden state — what lm_head consumes — or, with ``aux_layers`` (EAGLE-3),
    the concatenated states entering those decoder layers (HF ``output_hidden_states`` indices).
    Inputs may live anywhere; both outputs come out on the lm_head's device (a target spread
    over GPUs: accelerate's hooks carry activations and the mask from GPU to GPU, and each
    layer's cache stays on its own GPU).
    """
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    assert decoder is not model and lm_head is not None, f"{type(model).__name__} has no decoder / lm_head"
    device = input_device(model)
    out = decoder(
        input_ids=input_ids.to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        position_ids=position_ids.to(device),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=bool(aux_layers),
    )
    home = output_device(model)
    hidden = out.last_hidden_state.to(home)  # (1, Q, d)
    logits = lm_head(hidden[:, -1:] if last_logits else hidden).float()  # (1, Q or 1, V)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap  # (1, Q, V)
    if aux_layers:
        hidden = aux_states(out.hidden_states, aux_layers, home)  # (1, Q, L*d)
    return hidden, logits


def sliding_window_of(config) -> int | None:
    """The window every layer uses, or None (full attention). A hybrid of full and sliding
    layers cannot share one 4D mask: ``verify_tree`` refuses it beyond the window."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    if types is not None and any(t != "sliding_attention" for t in types):
        return -int(window)  # hybrid: negative marks "mixed"
    return int(window)


@torch.no_grad()
def verify_tree(
    model: torch.nn.Module,
    cache: DynamicCache,
    tree: DraftTree,
    past: int,
    aux_layers: list[int] | tuple = (),
    mask: VerifyMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the whole tree; returns features (1, N+1, F) and logits (1, N+1, V)."""
    assert cache.get_seq_length() == past, f"target cache holds {cache.get_seq_length()} tokens, expected {past}"
    if mask is None or mask.window == "unchecked":  # once per generation with a mask buffer
        kernel = getattr(model.config, "_attn_implementation", None) or ""
        assert "flash" not in kernel, (
            f"tree verification passes a 4D additive mask, which {kernel!r} cannot take: "
            "load the target with attn_implementation='sdpa' (or 'eager')"
        )
        window = sliding_window_of(model.config)
        if mask is not None:
            mask.window = window
    else:
        window = mask.window
    if window is not None:
        end = past + tree_height(tree) + 1
        if window < 0:
            assert end <= -window, (
                f"hybrid sliding/full attention beyond the window ({end} > {-window}) needs per-layer tree masks"
            )
            window = None
        elif end <= window:
            window = None
    if mask is not None and window is None:
        attention = mask.for_tree(tree.ancestors, past)  # (1, 1, N+1, past+N+1): a view of its buffer
    else:
        dtype = next(model.parameters()).dtype
        attention = tree_attention_mask(tree.ancestors, tree.depths, past, dtype, window)  # (1, 1, N+1, past+N+1)
    positions = tree_position_ids(tree.depths, past)  # (1, N+1)
    return target_forward(model, tree.tokens[None], positions, cache, attention, aux_layers)


def tree_height(tree: DraftTree) -> int:
    """The deepest node's depth: ``tree.height`` when the drafter knew it, else read from the device."""
    return tree.height if tree.height is not None else int(tree.depths.max())


def compact_cache(cache: DynamicCache, past: int, path: list[int]) -> None:
    """Keep the ``past`` prefix, the root and the accepted ``path`` (tree indices) in every layer:
    ``cache.commit`` for a ``TargetCache``, else (a plain ``DynamicCache``) a copy of the kept entries."""
    if all(hasattr(layer, "commit") for layer in cache.layers):
        commit(cache, past, path)
        return
    keep = [*range(past + 1), *(past + i for i in path)]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        assert not getattr(layer, "is_sliding", False), "compaction needs full (non-sliding) cache layers"
        index = torch.tensor(keep, device=layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


def _has_children(tree: DraftTree) -> torch.Tensor:
    """(N+1,) bool: whether each node has a child."""
    kids = torch.zeros(tree.size, dtype=torch.bool, device=tree.parents.device)
    return kids.index_fill_(0, tree.parents[1:], True) if tree.size > 1 else kids


def _read_walk(tree: DraftTree, on_path: torch.Tensor, end: torch.Tensor, next_token: torch.Tensor,
               eos_ids: frozenset[int]) -> Acceptance:
    """The round's one host read: the path (nodes whose ancestors-or-self all passed, ``on_path``
    (N+1,) bool, a root-to-node chain ending at ``end`` ()), its tokens and the bonus ``next_token`` ()."""
    n = tree.size
    end_has_kids = (end < n - 1) if tree.chain else _has_children(tree)[end]  # ()
    packed = torch.cat([on_path.long(), tree.tokens, next_token.view(1).long(), end_has_kids.view(1).long()])
    values = packed.tolist()  # (2(N+1)+2,): the synchronisation
    flags, tokens, bonus, kids = values[:n], values[n : 2 * n], values[2 * n], values[2 * n + 1]
    path = [i for i in range(1, n) if flags[i]]  # parents precede children: index order is depth order
    return _walk(path, [tokens[i] for i in path], bonus, kids, eos_ids)


def _walk(path: list[int], path_tokens: list[int], bonus: int, end_has_kids: int,
          eos_ids: frozenset[int]) -> Acceptance:
    for j, t in enumerate(path_tokens):
        if t in eos_ids:  # the path ends on an EOS: nothing after it is emitted, not even a bonus
            return Acceptance(path[: j + 1], None, j + 1, path_tokens[: j + 1])
    return Acceptance(path, bonus, len(path) + end_has_kids, path_tokens)


def accept_greedy(tree: DraftTree, logits: torch.Tensor, eos_ids: frozenset[int] = frozenset()) -> Acceptance:
    """Longest path whose every token is the target's argmax at its parent; logits (N+1, V)."""
    assert logits.shape[0] == tree.size, f"{logits.shape[0]} logit rows for a tree of {tree.size}"
    best = logits.argmax(-1)  # (N+1,)
    if tree.chain:  # the accepted prefix: the run of drafts equal to the target's argmax before them
        n = tree.size
        values = torch.cat([tree.tokens, best]).tolist()  # (2(k+1),): the synchronisation
        drafted, choice = values[1:n], values[n:]
        a = 0
        while a < n - 1 and drafted[a] == choice[a]:
            a += 1
        return _walk(list(range(1, a + 1)), drafted[:a], choice[a], int(a < n - 1), eos_ids)
    # a tree: each node's test on the device, the walk on the host over one packed read (N+1 is small)
    n = tree.size
    passed = tree.tokens == best[tree.parents.clamp(min=0)]  # (N+1,): the node's token is its parent's argmax
    values = torch.cat([passed.long(), tree.tokens, best, tree.parents]).tolist()  # (4(N+1),): the synchronisation
    ok, tokens, choice, parents = values[:n], values[n : 2 * n], values[2 * n : 3 * n], values[3 * n :]
    on = [True] + [False] * (n - 1)  # on the accepted path: passed, and so did every ancestor
    path = []
    for i in range(1, n):  # parents first: a node's parent is decided before it
        if ok[i] and on[parents[i]]:
            on[i] = True
            path.append(i)  # siblings are distinct: at most one child passes, so the path is a chain
    end = path[-1] if path else 0
    return _walk(path, [tokens[i] for i in path], choice[end], int(end in parents), eos_ids)


def accept_sampling(
    tree: DraftTree,
    logits: torch.Tensor,
    cfg: SamplingConfig,
    generator: torch.Generator | None,
    eos_ids: frozenset[int] = frozenset(),
) -> Acceptance:
    """Recursive rejection sampling over siblings (see module docstring); logits (N+1, V).

    Every child's test uses one uniform draw; the first child of a node that passes is the one the
    walk takes (the sequential rule: later siblings are tested only after earlier ones failed). Sampled
    proposals (``tree.proposals``) are a chain's: one child per node."""
    assert logits.shape[0] == tree.size, f"{logits.shape[0]} logit rows for a tree of {tree.size}"
    n, device = tree.size, logits.device
    p = target_probs(logits, cfg)  # (N+1, V)
    parents = tree.parents.clamp(min=0)  # (N+1,)
    px = p[parents, tree.tokens]  # (N+1,): each node's token under its parent's distribution
    if tree.proposals is None:  # deterministic children: q = δ_x
        earlier = (tree.parents[:, None] == tree.parents[None, :]) & torch.ones(n, n, dtype=torch.bool,
                                                                                 device=device).tril(-1)  # (N+1, N+1)
        rejected = (earlier.to(p.dtype) * px[None, :]).sum(1)  # (N+1,): mass of the earlier siblings
        ratio = px / (1 - rejected).clamp(min=torch.finfo(p.dtype).tiny)  # (N+1,)
    else:
        assert tree.chain, "sampled proposals: one child per node (a chain)"
        earlier = None
        q = tree.proposals.to(p.dtype)  # (N+1, V)
        ratio = px / q[torch.arange(n, device=device), tree.tokens]  # (N+1,)
    u = torch.rand(n, generator=generator, device=device)  # (N+1,)
    passed = u < ratio  # (N+1,)
    if earlier is not None:  # the first passing sibling is the one taken
        passed &= ~(earlier & passed[None, :]).any(1)
    passed |= tree.parents < 0
    on_path = ~(tree.ancestors & ~passed[None, :]).any(1)  # (N+1,)
    end = (on_path.long() * (tree.depths + 1)).argmax()  # () the deepest node on the path
    residual = p[end]  # (V,): every child of the end node was rejected, or it has none
    children = (tree.parents == end).to(p.dtype)  # (N+1,)
    if tree.proposals is None:
        drop = torch.zeros_like(residual).index_add_(0, tree.tokens, children)  # (V,): the children's tokens
        residual = residual * (drop == 0)
    else:
        child_q = (children[:, None] * tree.proposals.to(p.dtype)).sum(0)  # (V,): zero when no child
        residual = (residual - child_q).clamp(min=0)
    total = residual.sum()
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p[end])  # (V,)
    bonus = draw(residual, generator)  # ()
    return _read_walk(tree, on_path, end, bonus, eos_ids)
