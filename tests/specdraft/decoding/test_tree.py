"""Draft trees: tree mask / positions against brute force, draft tree attention against explicit paths,
and the EAGLE-2 expansion + rerank invariants ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §4)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.specdraft.decoding.decoding_helpers import tiny_draft, tiny_target
from specdraft.decoding.drafting import start_draft, target_logprobs, true_length
from specdraft.decoding.tree import (
    ancestors_from_parents,
    build_draft_chain,
    build_draft_tree,
    tree_attention_mask,
    tree_position_ids,
)
from specdraft.models import KVCache
from specdraft.targets.states import target_states


def random_parents(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def brute_force_ancestors(parents: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parents)):
        chain, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            chain.add(j)
        out.append(chain)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [None, 3, 100])
def test_tree_mask_and_positions_match_brute_force(seed, window):
    parents = random_parents(17, seed)
    past = 5
    anc = ancestors_from_parents(torch.tensor(parents))
    sets = brute_force_ancestors(parents)
    depths = torch.tensor([len(s) - 1 for s in sets])
    pos = tree_position_ids(depths, past)
    mask = tree_attention_mask(anc, depths, past, torch.float32, window)
    assert mask.shape == (1, 1, 17, past + 17) and pos.shape == (1, 17)
    for i in range(17):
        assert pos[0, i] == past + len(sets[i]) - 1
        for k in range(past + 17):
            k_pos = k if k < past else past + len(sets[k - past]) - 1
            visible = k < past or (k - past) in sets[i]
            if window is not None:
                visible = visible and int(pos[0, i]) - k_pos < window
            assert (mask[0, 0, i, k] == 0) == visible, (i, k)
            assert visible or mask[0, 0, i, k] == torch.finfo(torch.float32).min


@torch.no_grad()
def explicit_path_logp(draft, ids: torch.Tensor, features: torch.Tensor, path: list[int], concate: bool) -> float:
    """Cumulative draft log-prob of ``path`` after root ids[-1], one query at a time (no tree)."""
    n = ids.shape[0] - 1  # root position
    pos = lambda c: torch.tensor([[c]])  # noqa: E731
    logp = lambda h, t: float(target_logprobs(draft, draft.logits(h)[0])[0, t])  # noqa: E731
    true = draft.project(features)  # (P, d)
    cache, total = KVCache(), 0.0
    if draft.config.arch == "beagle":
        cache.append(draft.encode_states(true[None, :n], torch.arange(n)[None]))
        token = int(ids[n])
        for d, nxt in enumerate(path):
            kv = cache.view()
            h = draft.attend(torch.tensor([[token]]), pos(n + d), kv, torch.ones(1, 1, kv.length, dtype=torch.bool))
            total += logp(h, nxt)
            if concate:
                cache.append(draft.encode_states(h, pos(n + d)))
            token = nxt
        return total
    x, kv = draft.encode_inputs(ids[None, 1:], true[None, :n], torch.arange(1, n + 1)[None])  # slots 1..n
    cache.append(kv)
    x_q = x[:, -1:]
    for d, nxt in enumerate(path):
        if d > 0:
            x_q, kv = draft.encode_inputs(torch.tensor([[path[d - 1]]]), h, pos(n + d))
            cache.append(kv)
        h = draft.attend(x_q, pos(n + d), cache.view(), torch.ones(1, 1, cache.length, dtype=torch.bool))
        total += logp(h, nxt)
    return total


def drafting_setup(arch: str, concate: bool = True):
    target = tiny_target("llama", seed=3)
    draft = tiny_draft(target, arch, seed=4)
    ids = torch.randint(128, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        aux = draft.config.aux_layers
        features = torch.cat([out.hidden_states[i] for i in aux], -1) if aux else target_states(target, ids)[0]
    first = int(out.logits[0, -1].argmax())
    ctx = start_draft(draft, ids, features, first, concate)
    committed = torch.cat([ids[0], torch.tensor([first])])
    return draft, ctx, committed, features[0]


@pytest.mark.parametrize("arch,concate", [("beagle", True), ("beagle", False), ("eagle", True), ("eagle3", True),
                                          ("beagle3", True)])
@pytest.mark.parametrize("depth,topk,total", [(3, 3, 10), (4, 2, 30), (2, 4, 5)])
def test_tree_node_values_equal_explicit_path_drafting(arch, concate, depth, topk, total):
    draft, ctx, committed, true = drafting_setup(arch, concate)
    with torch.no_grad():
        tree = build_draft_tree(ctx, depth=depth, topk=topk, total_tokens=total)
        assert ctx.cache.length == true_length(ctx), "drafted entries must be cropped after the round"
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for i in range(1, tree.size):
            path, j = [], i
            while j > 0:
                path.append(tokens[j])
                j = parents[j]
            ref = explicit_path_logp(draft, committed, true, path[::-1], concate)
            assert abs(float(tree.scores[i]) - ref) < 1e-4, (i, float(tree.scores[i]), ref)


@pytest.mark.parametrize("depth,topk,total", [(6, 10, 60), (3, 4, 100), (5, 3, 7), (1, 5, 3)])
def test_eagle2_tree_invariants(depth, topk, total):
    draft, ctx, _, _ = drafting_setup("eagle")
    with torch.no_grad():
        tree = build_draft_tree(ctx, depth=depth, topk=topk, total_tokens=total)
    pool_size = topk + (depth - 1) * topk * topk
    assert tree.size == 1 + min(total, pool_size)
    parents, depths, scores = tree.parents.tolist(), tree.depths.tolist(), tree.scores.tolist()
    assert parents[0] == -1 and depths[0] == 0
    assert max(depths) <= depth
    for i in range(1, tree.size):
        p = parents[i]
        assert 0 <= p < i, "parents come first"
        assert depths[i] == depths[p] + 1
        assert scores[i] <= scores[p], "a node's value never exceeds its parent's"
    kids = tree.children()
    for i, children in enumerate(kids):
        assert len(children) <= topk
        assert len({int(tree.tokens[c]) for c in children}) == len(children), "siblings are distinct tokens"
    assert torch.equal(tree.ancestors, ancestors_from_parents(tree.parents))


def test_tree_keeps_the_globally_best_values():
    draft, ctx, _, _ = drafting_setup("beagle")
    with torch.no_grad():
        full = build_draft_tree(ctx, depth=3, topk=3, total_tokens=1000)  # the whole pool
        cut = build_draft_tree(ctx, depth=3, topk=3, total_tokens=8)
    best = sorted(full.scores[1:].tolist(), reverse=True)[:8]
    assert sorted(cut.scores[1:].tolist(), reverse=True) == pytest.approx(best)


@pytest.mark.parametrize("arch", ["beagle", "eagle"])
def test_chain_is_the_greedy_path(arch):
    draft, ctx, committed, true = drafting_setup(arch)
    with torch.no_grad():
        chain = build_draft_chain(ctx, gamma=5)
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3, 4] and chain.proposals is None
    path = chain.tokens[1:].tolist()
    for d in range(1, 6):  # each token is the argmax after its prefix: its value beats any sibling
        prefix = path[: d - 1]
        ref = explicit_path_logp(draft, committed, true, path[:d], True)
        assert abs(float(chain.scores[d]) - ref) < 1e-4
        for other in range(0, 128, 17):
            assert explicit_path_logp(draft, committed, true, prefix + [other], True) <= ref + 1e-5


def test_draft_vocabulary_ids_map_to_target_ids_through_d2t():
    target = tiny_target("llama", seed=3)
    draft = tiny_draft(target, "eagle3", seed=4, draft_vocab=20)
    ids = draft.heads.target_ids()  # (20,) sorted target ids
    assert torch.equal(ids, torch.arange(20) + draft.heads.d2t)  # offsets, as the engines read them
    logits = torch.randn(3, 20)
    full = target_logprobs(draft, logits)  # (3, 128)
    assert torch.allclose(full[:, ids], torch.log_softmax(logits, -1))
    outside = torch.ones(128, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(full[:, outside]).all() and (full[:, outside] < 0).all()
    assert torch.equal(draft.heads.t2d.nonzero().flatten(), ids)
