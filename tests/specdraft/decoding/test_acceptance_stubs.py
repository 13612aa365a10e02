"""Stub target / stub draft with fixed logits: exact τ and α for always / never / partial acceptance.

The stub target's argmax at position p is seq[p+1]; the stub draft's top-1 at query position p
is seq[p+1] unless p+1 is "wrong" (then seq[p+1] is its second choice). The prompt is seq[:P],
so vanilla greedy decoding yields seq[P:P+M] and every expectation below follows by hand.
"""

from __future__ import annotations

import random

import pytest

from tests.specdraft.decoding.decoding_helpers import StubDraft, StubTarget
from specdraft.decoding import speculative_generate, vanilla_generate
from specdraft.configs.decode import DecodeConfig
from specdraft.decoding.metrics import alpha, tau

V = 32
SEQ = [random.Random(0).randrange(1, V) for _ in range(400)]


def run(cfg: DecodeConfig, wrong, prompt_len: int):
    target = StubTarget(SEQ, V)
    draft = StubDraft(SEQ, V, wrong)
    gen = speculative_generate(target, draft, SEQ[:prompt_len], cfg)
    assert gen.tokens == SEQ[prompt_len : prompt_len + cfg.max_new_tokens]
    assert gen.tokens == vanilla_generate(target, SEQ[:prompt_len], cfg).tokens
    assert len(gen.tokens) == 1 + sum(gen.round_tokens)
    return gen, tau(sum(gen.round_tokens), gen.rounds), alpha(gen.depth_tried, gen.depth_accepted)


def chain_reference(prompt_len: int, gamma: int, max_new: int, wrong) -> list[int]:
    """Tokens each round adds under chain drafting: consecutive correct top-1s + the bonus."""
    out, n, rounds = 1, prompt_len, []
    while out < max_new:
        a = 0
        while a < gamma and not wrong(n + a + 1):
            a += 1
        emitted = min(a + 1, max_new - out)
        rounds.append(emitted)
        out += emitted
        n += a + 1
    return rounds


def test_always_accepted_chain():
    gen, t, a = run(DecodeConfig(mode="chain", gamma=4, max_new_tokens=31), lambda p: False, 9)
    assert gen.rounds == 6 and gen.round_tokens == [5] * 6 and gen.accepted == [4] * 6
    assert t == 5.0 and a == [1.0, 1.0, 1.0, 1.0]


def test_never_accepted_chain():
    gen, t, a = run(DecodeConfig(mode="chain", gamma=4, max_new_tokens=21), lambda p: True, 9)
    assert gen.rounds == 20 and gen.accepted == [0] * 20
    assert t == 1.0 and a == [0.0, None, None, None]


def test_partial_chain_every_third_position_wrong():
    wrong = lambda p: p % 3 == 0  # noqa: E731
    # root at 9: positions 10, 11 right, 12 wrong -> 2 accepted + bonus, next root 12 (same phase)
    gen, t, a = run(DecodeConfig(mode="chain", gamma=4, max_new_tokens=31), wrong, 9)
    assert gen.round_tokens == [3] * 10 and gen.accepted == [2] * 10
    assert t == 3.0 and a == [1.0, 1.0, 0.0, None]


@pytest.mark.parametrize("prompt_len,gamma,max_new", [(10, 4, 30), (11, 2, 17), (7, 6, 40), (8, 1, 12)])
def test_partial_chain_matches_reference(prompt_len, gamma, max_new):
    wrong = lambda p: p % 3 == 0 or p % 7 == 0  # noqa: E731
    gen, t, _ = run(DecodeConfig(mode="chain", gamma=gamma, max_new_tokens=max_new), wrong, prompt_len)
    expected = chain_reference(prompt_len, gamma, max_new, wrong)
    assert gen.round_tokens == expected
    assert t == pytest.approx(sum(expected) / len(expected))


def test_tree_always_and_never():
    cfg = DecodeConfig(mode="tree", depth=3, topk=3, total_tokens=12, max_new_tokens=17)
    gen, t, a = run(cfg, lambda p: False, 9)
    assert gen.round_tokens == [4] * 4 and t == 4.0 and a == [1.0, 1.0, 1.0]
    never = lambda p: True  # noqa: E731
    gen, t, a = run(DecodeConfig(mode="tree", depth=3, topk=1, total_tokens=3, max_new_tokens=9), never, 9)
    assert gen.rounds == 8 and t == 1.0 and a == [0.0, None, None]


def test_tree_reaches_second_choices():
    # every top-1 is wrong, the right token is always second (value log 0.27 per level). Depth-2
    # frontier = the 3 best of 9 candidates: (1st,1st), (1st,2nd), (2nd,1st); (2nd,2nd) is drafted
    # but not expanded, so each round accepts exactly 2 tokens and never tries depth 3.
    cfg = DecodeConfig(mode="tree", depth=3, topk=3, total_tokens=12, max_new_tokens=16)
    gen, t, a = run(cfg, lambda p: True, 9)
    assert gen.round_tokens == [3] * 5 and t == 3.0 and a == [1.0, 1.0, None]


def test_tree_finds_second_choices_that_a_chain_misses():
    wrong = lambda p: p % 3 == 0  # noqa: E731
    # depth 2, top-2: the full binary tree is drafted, so 2 tokens are accepted every round
    gen, t, a = run(DecodeConfig(mode="tree", depth=2, topk=2, total_tokens=6, max_new_tokens=31), wrong, 10)
    assert gen.round_tokens == [3] * 10 and t == 3.0 and a == [1.0, 1.0]
    # the chain of top-1s from position 10: 11 right, 12 wrong -> 1 accepted, then 2 per round
    gen, t, a = run(DecodeConfig(mode="chain", gamma=2, max_new_tokens=30), wrong, 10)
    assert gen.round_tokens == [2] + [3] * 9


def test_rerank_keeps_the_highest_value_nodes():
    wrong = lambda p: p % 3 == 0  # noqa: E731
    # total_tokens=2 keeps the depth-1 top-1 (value log 0.73) and its top-1 child (log 0.53), not
    # the depth-1 second choice (log 0.27): the same drafts as a greedy chain of 2
    tree, _, _ = run(DecodeConfig(mode="tree", depth=2, topk=2, total_tokens=2, max_new_tokens=30), wrong, 10)
    chain, _, _ = run(DecodeConfig(mode="chain", gamma=2, max_new_tokens=30), wrong, 10)
    assert tree.round_tokens == chain.round_tokens == [2] + [3] * 9
    assert tree.depth_accepted == chain.depth_accepted and tree.depth_tried == chain.depth_tried


def test_tree_with_topk_1_is_the_chain():
    wrong = lambda p: p % 4 == 1 or p % 5 == 0  # noqa: E731
    tree, _, _ = run(DecodeConfig(mode="tree", depth=4, topk=1, total_tokens=4, max_new_tokens=40), wrong, 8)
    chain, _, _ = run(DecodeConfig(mode="chain", gamma=4, max_new_tokens=40), wrong, 8)
    assert tree.round_tokens == chain.round_tokens
    assert tree.depth_accepted == chain.depth_accepted and tree.depth_tried == chain.depth_tried


def test_eos_stops_inside_an_accepted_path():
    seq = list(SEQ)
    eos = seq[9 + 7]  # the 8th generated token
    first = seq.index(eos, 9)
    target, draft = StubTarget(seq, V), StubDraft(seq, V)
    cfg = DecodeConfig(mode="chain", gamma=5, max_new_tokens=50)
    gen = speculative_generate(target, draft, seq[:9], cfg, eos_ids=frozenset({eos}))
    assert gen.stop == "eos" and gen.tokens == seq[9 : first + 1]
    assert gen.tokens == vanilla_generate(target, seq[:9], cfg, eos_ids=frozenset({eos})).tokens


def test_target_cache_is_compacted_to_the_accepted_path():
    wrong = lambda p: p % 3 == 0  # noqa: E731
    target, draft = StubTarget(SEQ, V), StubDraft(SEQ, V, wrong)
    seen = []
    forward = target.decoder.forward

    def spy(*args, **kwargs):
        cache, start = kwargs["past_key_values"], int(kwargs["position_ids"][0, 0])
        keys = cache.layers[0].keys.flatten().tolist() if cache.layers else []
        seen.append((start, [int(k) for k in keys]))
        return forward(*args, **kwargs)

    target.decoder.forward = spy
    gen = speculative_generate(target, draft, SEQ[:10], DecodeConfig(mode="tree", depth=3, topk=3, max_new_tokens=20))
    assert len(seen) == 1 + gen.rounds
    # every forward finds exactly the committed positions 0..root-1 in the cache, in order
    for start, keys in seen:
        assert keys == list(range(start))
