"""Draft vocabulary: counting, selection, the d2t/t2d maps against a slow loop."""

import numpy as np
import torch

from specdraft.vocab import count_predicted_tokens, coverage, select_vocab, vocab_maps


def test_counts_follow_loss_masked_positions_within_sequences():
    ids = np.array([5, 1, 2, 3, 7, 7, 4])
    mask = np.array([0, 1, 1, 1, 1, 1, 0])
    offsets = np.array([0, 4, 7])
    counts = count_predicted_tokens(ids, mask, offsets, vocab_size=9)
    expected = np.zeros(9, dtype=np.int64)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        for p in range(lo, hi - 1):  # the last position of a sequence predicts nothing stored
            if mask[p]:
                expected[ids[p + 1]] += 1
    assert counts.tolist() == expected.tolist()


def test_selection_ties_fill_and_maps():
    counts = np.array([0, 5, 5, 1, 0, 9, 0, 0])
    ids = select_vocab(counts, 4)
    assert ids.tolist() == [1, 2, 3, 5]  # 5 (9), then 1 and 2 (5, smaller id first), then 3
    assert select_vocab(counts, 6).tolist() == [0, 1, 2, 3, 4, 5]  # unused ids fill by smallest id
    assert select_vocab(counts, 100).tolist() == list(range(8))  # capped at the vocabulary
    d2t, t2d = vocab_maps(ids, 8)
    assert [i + int(d2t[i]) for i in range(4)] == ids.tolist()  # offsets, not absolute ids
    assert t2d.tolist() == [i in ids.tolist() for i in range(8)]
    assert abs(coverage(counts, ids) - 20 / 20) < 1e-12
    assert abs(coverage(counts, torch.tensor([5])) - 9 / 20) < 1e-12
