"""Target verification in one forward (tree mask + positions + DynamicCache), acceptance and
KV-cache compaction, against plain forwards of each root-to-node path ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §4.2)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.specdraft.decoding.decoding_helpers import random_tree, tiny_target
from specdraft.configs.decode import SamplingConfig
from specdraft.decoding.tree import DraftTree, ancestors_from_parents
from specdraft.decoding.verify import (
    accept_greedy,
    accept_sampling,
    compact_cache,
    sliding_window_of,
    target_forward,
    verify_tree,
)

PAST = 9


def prefill(model, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    target_forward(model, ids, torch.arange(ids.shape[1])[None], cache)
    return cache


def path_of(tree: DraftTree, node: int) -> list[int]:
    out, parents = [], tree.parents.tolist()
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def plain_forward(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """No cache, no custom mask: the model's own causal forward."""
    x = torch.tensor([ids])
    return target_forward(model, x, torch.arange(len(ids))[None], DynamicCache())


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("qwen2", {}), ("mistral", {}), ("mistral", {"sliding_window": 6})],
)
def test_tree_logits_equal_plain_forward_of_each_path(family, overrides):
    model = tiny_target(family, seed=11, **overrides)
    ids = torch.randint(128, (1, PAST), generator=torch.Generator().manual_seed(0))
    tree = random_tree(15, vocab=128, seed=1)
    cache = prefill(model, ids)
    hidden, logits = verify_tree(model, cache, tree, PAST)  # (1, N+1, d), (1, N+1, V)
    assert cache.get_seq_length() == PAST + tree.size
    for node in range(tree.size):
        seq = ids[0].tolist() + tree.tokens[path_of(tree, node)].tolist()
        ref_h, ref_logits = plain_forward(model, seq)
        assert (logits[0, node] - ref_logits[0, -1]).abs().max() < 1e-5, node
        assert (hidden[0, node] - ref_h[0, -1]).abs().max() < 1e-5, node


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_compacted_cache_equals_recomputation_without_cache(family):
    model = tiny_target(family, seed=12)
    ids = torch.randint(128, (1, PAST), generator=torch.Generator().manual_seed(2))
    tree = random_tree(20, vocab=128, seed=3)
    cache = prefill(model, ids)
    verify_tree(model, cache, tree, PAST)
    leaf = int(tree.depths.argmax())
    path = path_of(tree, leaf)[1:]  # accepted nodes (root excluded)
    compact_cache(cache, PAST, path)
    committed = ids[0].tolist() + tree.tokens[[0, *path]].tolist()
    assert cache.get_seq_length() == len(committed)
    fresh = prefill(model, torch.tensor([committed]))
    for kept, ref in zip(cache.layers, fresh.layers):
        assert (kept.keys - ref.keys).abs().max() < 1e-5 and (kept.values - ref.values).abs().max() < 1e-5
    # and the next step through the compacted cache equals a no-cache forward of everything
    nxt = 17
    _, logits = target_forward(model, torch.tensor([[nxt]]), torch.tensor([[len(committed)]]), cache)
    _, ref = plain_forward(model, committed + [nxt])
    assert (logits[0, -1] - ref[0, -1]).abs().max() < 1e-5


def test_sliding_window_detection():
    assert sliding_window_of(tiny_target("llama").config) is None
    assert sliding_window_of(tiny_target("qwen2").config) is None
    assert sliding_window_of(tiny_target("mistral", sliding_window=6).config) == 6


def hand_tree() -> DraftTree:
    #        0 (root, token 9)
    #      /   \
    #   1 (3)   2 (4)
    #   |        |   \
    #   3 (5)   4 (6) 5 (7)
    parents = torch.tensor([-1, 0, 0, 1, 2, 2])
    return DraftTree(
        tokens=torch.tensor([9, 3, 4, 5, 6, 7]),
        parents=parents,
        depths=torch.tensor([0, 1, 1, 2, 2, 2]),
        ancestors=ancestors_from_parents(parents),
        scores=torch.zeros(6, dtype=torch.float64),
    )


def onehot_logits(best: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_accept_greedy_follows_the_target_argmax():
    tree = hand_tree()
    acc = accept_greedy(tree, onehot_logits([4, 0, 7, 0, 0, 8]))
    assert acc.path == [2, 5] and acc.next_token == 8 and acc.tried == 2
    acc = accept_greedy(tree, onehot_logits([1, 0, 0, 0, 0, 0]))
    assert acc.path == [] and acc.next_token == 1 and acc.tried == 1
    acc = accept_greedy(tree, onehot_logits([3, 5, 0, 2, 0, 0]))
    assert acc.path == [1, 3] and acc.next_token == 2 and acc.tried == 2  # leaf: depth 3 not drafted
    acc = accept_greedy(tree, onehot_logits([4, 0, 7, 0, 0, 8]), eos_ids=frozenset({4}))
    assert acc.path == [2] and acc.next_token is None


def test_accept_sampling_with_certain_target_is_greedy():
    tree = hand_tree()
    logits = 100 * onehot_logits([4, 0, 7, 0, 0, 8])
    gen = torch.Generator().manual_seed(0)
    acc = accept_sampling(tree, logits, SamplingConfig(temperature=1.0), gen)
    assert acc.path == [2, 5] and acc.next_token == 8
