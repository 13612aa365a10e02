"""The draft vocabulary of an EAGLE-3 draft ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test" §3; the d2t/t2d maps the engines read, docs/serving.md).

The draft predicts over the ``size`` target tokens it is most often trained to predict: the
token after every loss-masked position (what the target generated in the assistant spans),
counted over the training data. Ties are broken by the smaller id; if fewer distinct tokens
occur, the most frequent-then-smallest unused ids fill the vocabulary (so its size is exactly
``size``, or the whole target vocabulary when that is smaller). The ids are stored sorted, as
the engines expect:

* ``d2t`` int64 (size,), offsets: target id = draft id + d2t[draft id];
* ``t2d`` bool (vocab,), which target ids the draft can emit.
"""

from __future__ import annotations

import numpy as np
import torch




def count_predicted_tokens(
    input_ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, vocab_size: int
) -> np.ndarray:
    """Counts (vocab_size,) of the tokens t_{p+1} following loss-masked positions p, per sequence.

    ``input_ids``/``loss_mask`` (N,) concatenate the sequences delimited by ``offsets`` (S+1,).
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    mask = np.asarray(loss_mask).astype(bool)
    offsets = np.asarray(offsets, dtype=np.int64)
    assert ids.shape == mask.shape and offsets[0] == 0 and offsets[-1] == ids.shape[0], "arrays do not match offsets"
    last = np.zeros(ids.shape[0], dtype=bool)
    last[offsets[1:] - 1] = True  # a sequence's last position predicts nothing stored
    take = np.flatnonzero(mask & ~last)
    assert take.size == 0 or int(ids.max()) < vocab_size, f"token ids reach {int(ids.max())} >= vocab_size {vocab_size}"
    return np.bincount(ids[take + 1], minlength=vocab_size).astype(np.int64)


def select_vocab(counts: np.ndarray, size: int) -> torch.Tensor:
    """The ``min(size, vocab)`` most frequent target ids (ties: smaller id first), sorted ascending."""
    counts = np.asarray(counts, dtype=np.int64)
    vocab = counts.shape[0]
    size = min(int(size), vocab)
    assert size >= 1, "the draft vocabulary needs at least one token"
    order = np.lexsort((np.arange(vocab), -counts))  # count descending, then id ascending
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))


def vocab_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t (Vd,) offsets, t2d (V,) bool) for the sorted draft vocabulary ``target_ids``."""
    ids = torch.as_tensor(target_ids, dtype=torch.int64)
    d2t = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def coverage(counts: np.ndarray, target_ids: torch.Tensor) -> float:
    """Fraction of the counted predicted tokens the draft vocabulary contains."""
    total = int(np.asarray(counts).sum())
    return float(np.asarray(counts)[target_ids.numpy()].sum() / total) if total else 1.0
