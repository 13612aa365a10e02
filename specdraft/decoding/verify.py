"""Target verification of a draft tree in one forward, acceptance, and KV-cache compaction.

"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §4.2 (tree attention for
verification) and §2 (speculative sampling):
* ``verify_tree`` feeds root + drafted nodes to the target with a 4D additive float mask
  ``[1, 1, q, past + q]`` (each node sees the cached prefix and its ancestors), explicit tree
  ``position_ids`` and the round's ``DynamicCache``; every node's logits then equal a plain
  forward of its root-to-node path.
* ``accept_greedy`` walks from the root, following the child whose token is the target's
  argmax; the first mismatch yields the target's own token (the bonus).
* ``accept_sampling`` is recursive rejection sampling over siblings (SpecInfer; EAGLE's
  ``evaluate_posterior``): child x with proposal q is accepted with prob min(1, p(x)/q(x));
  on rejection p <- norm(max(p - q, 0)) and the next sibling is tried; when all are
  rejected the bonus is sampled from the residual. A child chosen deterministically (top-k
  tree) has q = δ_x, which reduces the rule to "accept with p(x), else zero p(x)". This
  preserves the target distribution exactly because siblings are distinct, deterministic
  choices or a single sample from q.
* ``compact_cache`` keeps the prefix, the root and the accepted path in the target cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specdraft.decoding.sampling import SamplingConfig, sample, target_probs, uniform
from specdraft.decoding.tree import DraftTree, tree_attention_mask, tree_position_ids
from specdraft.placement import input_device, output_device
from specdraft.target import aux_states


@dataclass(frozen=True, slots=True)
class Acceptance:
    path: list[int]  # accepted tree nodes (root excluded), root-to-leaf order
    next_token: int | None  # bonus / correction token; None when the path ends on an EOS
    tried: int  # depths whose candidates were tested (α_i denominators: depths 1..tried)


@torch.no_grad()
def target_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor | None = None,
    aux_layers: list[int] | tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's features (1, Q, F) and the logits (1, Q, V), extending ``cache``.

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
    logits = lm_head(hidden).float()  # (1, Q, V)
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
    model: torch.nn.Module, cache: DynamicCache, tree: DraftTree, past: int, aux_layers: list[int] | tuple = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the whole tree; returns features (1, N+1, F) and logits (1, N+1, V)."""
    assert cache.get_seq_length() == past, f"target cache holds {cache.get_seq_length()} tokens, expected {past}"
    kernel = getattr(model.config, "_attn_implementation", None) or ""
    assert "flash" not in kernel, (
        f"tree verification passes a 4D additive mask, which {kernel!r} cannot take: "
        "load the target with attn_implementation='sdpa' (or 'eager')"
    )
    dtype = next(model.parameters()).dtype
    window = sliding_window_of(model.config)
    end = past + int(tree.depths.max()) + 1
    if window is not None and window < 0:
        assert end <= -window, (
            f"hybrid sliding/full attention beyond the window ({end} > {-window}) needs per-layer tree masks"
        )
        window = None
    if window is not None and end <= window:
        window = None
    mask = tree_attention_mask(tree.ancestors, tree.depths, past, dtype, window)  # (1, 1, N+1, past+N+1)
    positions = tree_position_ids(tree.depths, past)  # (1, N+1)
    return target_forward(model, tree.tokens[None], positions, cache, mask, aux_layers)


def compact_cache(cache: DynamicCache, past: int, path: list[int]) -> None:
    """Keep the ``past`` prefix, the root and the accepted ``path`` (tree indices) in every layer."""
    keep = [*range(past + 1), *(past + i for i in path)]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        assert not getattr(layer, "is_sliding", False), "compaction needs full (non-sliding) cache layers"
        index = torch.tensor(keep, device=layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


def accept_greedy(tree: DraftTree, logits: torch.Tensor, eos_ids: frozenset[int] = frozenset()) -> Acceptance:
    """Longest path whose every token is the target's argmax at its parent; logits (N+1, V)."""
    assert logits.shape[0] == tree.size, f"{logits.shape[0]} logit rows for a tree of {tree.size}"
    best = logits.argmax(-1).tolist()  # (N+1,)
    tokens = tree.tokens.tolist()
    kids = tree.children()
    node, path, tried = 0, [], 0
    while True:
        if kids[node]:
            tried += 1
        match = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if match is None:
            return Acceptance(path, best[node], tried)
        path.append(match)
        node = match
        if tokens[match] in eos_ids:
            return Acceptance(path, None, tried)


def accept_sampling(
    tree: DraftTree,
    logits: torch.Tensor,
    cfg: SamplingConfig,
    generator: torch.Generator | None,
    eos_ids: frozenset[int] = frozenset(),
) -> Acceptance:
    """Recursive rejection sampling over siblings (see module docstring); logits (N+1, V)."""
    assert logits.shape[0] == tree.size, f"{logits.shape[0]} logit rows for a tree of {tree.size}"
    tokens = tree.tokens.tolist()
    kids = tree.children()
    node, path, tried = 0, [], 0
    while True:
        p = target_probs(logits[node], cfg)  # (V,)
        if kids[node]:
            tried += 1
        accepted = None
        for child in kids[node]:
            x = tokens[child]
            if tree.proposals is None:  # deterministic child: q = δ_x
                if uniform(generator, p.device) < float(p[x]):
                    accepted = child
                    break
                p = p.clone()
                p[x] = 0.0
            else:
                q = tree.proposals[child].to(p.dtype)  # (V,)
                assert float(q[x]) > 0, f"token {x} has zero probability under its own proposal"
                if uniform(generator, p.device) < min(1.0, float(p[x] / q[x])):
                    accepted = child
                    break
                p = (p - q).clamp(min=0)
            total = float(p.sum())
            p = p / total if total > 0 else target_probs(logits[node], cfg)
        if accepted is None:
            return Acceptance(path, sample(p, generator), tried)
        path.append(accepted)
        node = accepted
        if tokens[accepted] in eos_ids:
            return Acceptance(path, None, tried)
