"""The preallocated caches of the decoding loop against the plain ones: the target's ``TargetCache``
(commit by index) against ``DynamicCache`` compaction, the ``VerifyMask`` buffer against a freshly
built tree mask, the draft's ``KVCache`` against concatenation, RoPE from a table against RoPE
computed per call ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §4.2)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdraft.decoding.cache import TargetCache, VerifyMask, target_cache
from specdraft.decoding.tree import ancestors_from_parents, tree_attention_mask
from specdraft.decoding.verify import compact_cache, target_forward, verify_tree
from specdraft.models import KV, KVCache
from specdraft.models.layers import Rotary
from tests.specdraft.decoding.decoding_helpers import random_tree, tiny_target

PAST = 9


def prefill(model, ids: torch.Tensor, cache) -> None:
    target_forward(model, ids, torch.arange(ids.shape[1])[None], cache)


def committed_path(tree, leaf: int) -> list[int]:
    path, parents = [], tree.parents.tolist()
    while leaf > 0:
        path.append(leaf)
        leaf = parents[leaf]
    return path[::-1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("chain", [False, True], ids=["tree-path", "chain-prefix"])
def test_commit_by_index_equals_compaction(family, chain):
    model = tiny_target(family, seed=12)
    ids = torch.randint(128, (1, PAST), generator=torch.Generator().manual_seed(2))
    tree = random_tree(20, vocab=128, seed=3)
    leaf = int(tree.depths.argmax())
    path = list(range(1, 4)) if chain else committed_path(tree, leaf)
    if chain:  # a chain's accepted prefix sits in place already: nothing moves
        parents = torch.arange(-1, 19)
        tree.parents, tree.depths, tree.ancestors = parents, torch.arange(20), ancestors_from_parents(parents)
    plain, static = DynamicCache(), target_cache(model, capacity=PAST + 8)  # too small: it must grow
    for cache in (plain, static):
        prefill(model, ids, cache)
        verify_tree(model, cache, tree, PAST)
        compact_cache(cache, PAST, path)
    assert isinstance(static, TargetCache) and static.get_seq_length() == plain.get_seq_length() == PAST + 1 + len(path)
    for a, b in zip(plain.layers, static.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-6) and torch.allclose(a.values, b.values, atol=1e-6)
    nxt = torch.tensor([[17]])
    pos = torch.tensor([[PAST + 1 + len(path)]])
    _, ref = target_forward(model, nxt, pos, plain)
    _, got = target_forward(model, nxt, pos, static)
    assert torch.allclose(ref, got, atol=1e-5)


def test_verify_mask_buffer_equals_a_fresh_mask_round_after_round():
    mask = VerifyMask(rows=4, capacity=12, dtype=torch.float32, device="cpu")  # grows on the way
    past = 3
    for seed in range(6):
        tree = random_tree(3 + seed % 4, vocab=50, seed=seed)
        got = mask.for_tree(tree.ancestors, past)
        want = tree_attention_mask(tree.ancestors, tree.depths, past, torch.float32)
        assert torch.equal(got, want), seed
        past += 1 + seed % 3  # the next round starts after the committed tokens


def test_draft_cache_preallocated_equals_concatenation():
    g = torch.Generator().manual_seed(0)
    cache, ref = KVCache(capacity=3), None
    for n in (2, 3, 1, 5):  # past the first capacity: the buffers grow, their contents stay
        kv = KV(torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g))
        cache.append(kv)
        ref = kv if ref is None else ref.cat(kv)
        assert cache.length == ref.length
        assert torch.equal(cache.view().k, ref.k) and torch.equal(cache.view().v, ref.v)
    cache.crop(4)
    cache.append(KV(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4)))
    assert torch.equal(cache.view().k[:, :, :4], ref.k[:, :, :4]) and cache.view().k[:, :, 4].eq(1).all()


def test_rope_table_equals_rope_per_call():
    rotary = Rotary(head_dim=16, num_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    max_position_embeddings=512)
    x = torch.randn(2, 4, 3, 16)
    positions = torch.tensor([[5, 9, 300], [0, 1, 2]])
    with torch.no_grad():
        per_call = rotary(x, positions)
        with rotary.table(301, torch.float32, torch.device("cpu")):
            assert torch.equal(rotary(x, positions), per_call)
        assert rotary._use_table is False  # only inside the block


def test_decoding_on_cuda_leaves_cudnn_attention_out():
    """cuDNN's SDPA kernel builds a plan per input shape (~10 ms of host time on an H200), and decoding
    changes shapes at nearly every call: on CUDA the loop decodes with the other fused kernels, and
    leaves the global choice as it found it. On CPU nothing changes. (The flags are process-wide
    settings, readable without a GPU.)"""
    from specdraft.models.layers import decoding_attention

    flags = (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
             torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)
    before = [f() for f in flags]
    assert before[0], "cuDNN attention is on by default"
    with decoding_attention(torch.device("cpu")):
        assert [f() for f in flags] == before
    with decoding_attention(torch.device("cuda")):
        assert [f() for f in flags] == [False, True, True, True]
    assert [f() for f in flags] == before
