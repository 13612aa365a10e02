"""The acceptance rules, computed for the whole tree at once on the device, against slow explicit walks
("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §2 and §4.2; SpecInfer's
recursive rejection over siblings): greedy path for path on random trees, and the exact distribution
of (path, bonus) the sequential sampling rule induces against the vectorised rule's samples."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from specdraft.decoding.sampling import target_probs
from specdraft.configs.decode import SamplingConfig
from specdraft.decoding.tree import DraftTree, ancestors_from_parents, chain_structure
from specdraft.decoding.verify import accept_greedy, accept_sampling
from tests.specdraft.decoding.decoding_helpers import chi2_gof


def distinct_tree(n: int, vocab: int, seed: int) -> DraftTree:
    """A random parents-first tree whose siblings carry distinct tokens (as drafted trees do)."""
    rng = random.Random(seed)
    parents, tokens, used = [-1], [rng.randrange(vocab)], {0: set()}
    for i in range(1, n):
        p = rng.randrange(i)
        free = [t for t in range(vocab) if t not in used.setdefault(p, set())]
        if not free:
            p, free = 0, [t for t in range(vocab) if t not in used[0]]
        token = rng.choice(free)
        used[p].add(token)
        parents.append(p)
        tokens.append(token)
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    t = torch.tensor(parents)
    return DraftTree(tokens=torch.tensor(tokens), parents=t, depths=torch.tensor(depths),
                     ancestors=ancestors_from_parents(t), scores=torch.zeros(n, dtype=torch.float64))


def slow_greedy(tree: DraftTree, logits: torch.Tensor, eos: frozenset[int]):
    best, tokens, parents = logits.argmax(-1).tolist(), tree.tokens.tolist(), tree.parents.tolist()
    node, path, tried = 0, [], 0
    while True:
        kids = [c for c in range(tree.size) if parents[c] == node]
        tried += bool(kids)
        match = next((c for c in kids if tokens[c] == best[node]), None)
        if match is None:
            return path, best[node], tried
        path.append(match)
        node = match
        if tokens[match] in eos:
            return path, None, tried


@pytest.mark.parametrize("seed", range(12))
def test_greedy_acceptance_equals_the_slow_walk(seed):
    g = torch.Generator().manual_seed(seed)
    vocab = 6
    tree = distinct_tree(3 + seed % 9, vocab, seed)
    logits = torch.randn(tree.size, vocab, generator=g)
    for i in range(1, tree.size):  # make the walk go deep: parents mostly argmax to a child's token
        if seed % 3 and torch.rand((), generator=g) < 0.7:
            logits[int(tree.parents[i]), int(tree.tokens[i])] += 10
    eos = frozenset({int(tree.tokens[-1])}) if seed % 4 == 0 else frozenset()
    acc = accept_greedy(tree, logits, eos)
    assert (acc.path, acc.next_token, acc.tried) == slow_greedy(tree, logits, eos)
    assert acc.path_tokens == tree.tokens[acc.path].tolist()


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_chain_acceptance_equals_the_tree_rule(k):
    g = torch.Generator().manual_seed(k)
    for trial in range(20):
        parents, depths, ancestors, zeros = chain_structure(k, torch.device("cpu"))
        tokens = torch.randint(5, (k + 1,), generator=g)
        logits = torch.randn(k + 1, 5, generator=g)
        logits[torch.arange(k), tokens[1:]] += 3 * torch.rand(k, generator=g)  # often, not always, accepted
        chain = DraftTree(tokens=tokens, parents=parents, depths=depths, ancestors=ancestors, scores=zeros, chain=True)
        as_tree = DraftTree(tokens=tokens, parents=parents, depths=depths, ancestors=ancestors, scores=zeros)
        eos = frozenset({int(tokens[-1])}) if trial % 3 == 0 and k else frozenset()
        assert accept_greedy(chain, logits, eos) == accept_greedy(as_tree, logits, eos)


def exact_outcomes(tree: DraftTree, probs: torch.Tensor) -> dict[tuple, float]:
    """P(path, bonus) under the sequential rule: siblings tried in order, child x accepted with the
    probability the residual gives it, the residual renormalised after each rejection."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out: dict[tuple, float] = {}

    def visit(node: int, path: tuple, weight: float) -> None:
        p = probs[node].double().clone()
        for child in [c for c in range(tree.size) if parents[c] == node]:
            mass = float(p.sum())
            a = float(p[tokens[child]]) / mass if mass > 0 else 0.0
            if a > 0:
                visit(child, path + (child,), weight * a)
            weight *= 1 - a
            p[tokens[child]] = 0.0
        if weight > 0:
            residual = p / p.sum()
            for t, q in enumerate(residual.tolist()):
                if q > 0:
                    out[(path, t)] = out.get((path, t), 0.0) + weight * q

    visit(0, (), 1.0)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_acceptance_follows_the_sequential_rule(seed):
    tree = distinct_tree(7, 5, seed + 100)
    logits = 2 * torch.randn(tree.size, 5, generator=torch.Generator().manual_seed(seed))
    cfg = SamplingConfig(temperature=1.0)
    exact = exact_outcomes(tree, target_probs(logits, cfg))
    gen = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(3000):
        acc = accept_sampling(tree, logits, cfg, gen)
        counts[(tuple(acc.path), acc.next_token)] += 1
    stat, df, p = chi2_gof(counts, exact)
    assert df >= 5, "too few outcomes for a meaningful test"
    assert p > 1e-3, f"chi2={stat:.1f} df={df} p={p:.2e}: the vectorised rule is not the sequential one"
