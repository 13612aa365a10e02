"""Tests for specdraft.features' prefill: the lm_head on the valid rows only, in chunks, gives the top-K and
logsumexp of the batch's full logits; ``sequence_features`` reports where its time went."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.configs.features import FeaturesConfig
from specdraft.features import prefill_batches, prefill_features, sequence_features
from specdraft.targets import states
from tests.specdraft.test_target import padded_batch
from tests.tiny_models import TINY

VOCAB = 97
TOPK = 5
AUX = [0, 1]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY, vocab_size=VOCAB, tie_word_embeddings=False)).eval()


def padded(lengths: list[int], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(lengths, side, seed=1, vocab=VOCAB)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_prefill_features_equal_the_top_k_of_the_full_logits(model, side, chunk):
    ids, mask = padded([9, 3, 6], side)
    hidden, logits, aux = states.target_features(model, ids, mask, AUX)  # (B, T, d), (B, T, V), (B, T, L*d)
    valid = mask.bool()
    full = logits[valid].float()  # (M, V): the valid rows, in order
    timings: dict[str, float] = {}
    f = prefill_features(model, ids, mask, TOPK, chunk, AUX, timings)
    assert len(f) == 18 and f.topk_ids.shape == (18, TOPK)
    torch.testing.assert_close(f.hidden, hidden[valid], rtol=0, atol=0)
    torch.testing.assert_close(f.aux_hidden, aux[valid], rtol=0, atol=0)
    torch.testing.assert_close(f.logsumexp, torch.logsumexp(full, -1), rtol=0, atol=1e-5)
    top = full.topk(TOPK, -1)
    torch.testing.assert_close(f.topk_logits, top.values, rtol=0, atol=1e-5)
    assert torch.equal(f.topk_ids, top.indices)
    assert timings["forward_s"] > 0 and timings["topk_s"] > 0 and set(timings) == {"forward_s", "topk_s"}


def test_prefill_features_of_a_batch_with_no_valid_position(model):
    ids, mask = padded([4], "right")
    f = prefill_features(model, ids, torch.zeros_like(mask), TOPK, 3, AUX)
    assert len(f) == 0 and f.topk_ids.shape == (0, TOPK) and f.logsumexp.shape == (0,)
    assert f.aux_hidden.shape == (0, len(AUX) * TINY["hidden_size"])


def test_sequence_features_report_their_phases_and_padding(model):
    g = np.random.default_rng(2)
    lengths = [12, 3, 7, 7, 1, 10]
    seqs = [g.integers(1, VOCAB, n).astype(np.int32) for n in lengths]
    cfg = FeaturesConfig(topk=TOPK, batch_tokens=24, max_batch_size=3, logits_chunk=5)
    features, timings = sequence_features(model, seqs, cfg, AUX, pad_id=0)
    batches = prefill_batches(lengths, cfg.batch_tokens, cfg.max_batch_size)
    assert len(batches) > 1  # padding and several batches: the accounting is tested, not a single batch
    assert timings["padded_tokens"] == sum(len(b) * max(lengths[i] for i in b) for b in batches) > sum(lengths)
    assert timings["features_s"] == pytest.approx(timings["forward_s"] + timings["topk_s"])
    assert all(timings[k] >= 0 for k in ("pad_s", "copy_s")) and timings["forward_s"] > 0
    # each sequence's features, in the input order, as a prefill of that sequence alone gives them
    for seq, piece in zip(seqs, features.split(lengths)):
        ids = torch.from_numpy(seq.astype(np.int64))[None]  # (1, L)
        alone = prefill_features(model, ids, torch.ones_like(ids), TOPK, aux_layers=AUX)
        torch.testing.assert_close(piece.hidden, alone.hidden, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(piece.logsumexp, alone.logsumexp, rtol=1e-4, atol=1e-4)
        assert (piece.topk_ids == alone.topk_ids).float().mean() > 0.95  # ties and rounding aside


def test_sequence_features_of_no_sequence(model):
    features, timings = sequence_features(model, [], FeaturesConfig(topk=TOPK), AUX, pad_id=0)
    assert len(features) == 0 and features.aux_hidden.shape == (0, len(AUX) * TINY["hidden_size"])
    assert timings["padded_tokens"] == 0 and timings["features_s"] == 0
