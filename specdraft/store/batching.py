"""Which sequences train and in which batches: the held-out split by sample-id hash and the epoch's batch
plan (length buckets, seeded order, equal batch counts per DDP rank), shared by the store reader
(``store/reader.py``) and the online features (``specdraft/online.py``).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import numpy as np


class BatchSettings(Protocol):
    """What the plan reads of the reader's settings (``ReaderConfig`` has them)."""

    max_tokens: int  # padded tokens per batch (B * T)
    max_batch_size: int | None
    seed: int
    shuffle: bool  # False: batches in length order, same every epoch
    bucket_size: int  # sequences sorted by length within windows of this many


def is_held_out(sample_id: str, fraction: float) -> bool:
    """Whether ``sample_id`` belongs to the validation split (stable across stores and runs)."""
    h = int(hashlib.sha256(str(sample_id).encode()).hexdigest()[:15], 16)
    return h / 16**15 < fraction


def token_digests(input_ids: np.ndarray, offsets: np.ndarray, unread: list[tuple[int, int, str]] = ()) -> np.ndarray:
    """(S,) 16-byte digests of each sequence's token ids (``offsets`` (S+1,) into ``input_ids`` (N,)): what makes
    two stored sequences the same one, whatever store, shard or sample id holds them. A sequence overlapping one
    of the ``unread`` rows (first, end, why: a bad chunk skipped) gets an empty digest: never taken for another."""
    ids = np.ascontiguousarray(input_ids, dtype="<i4")  # (N,) as stored
    out = np.zeros(len(offsets) - 1, "S16")  # (S,)
    for i, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        if not any(first < b and a < end for first, end, _ in unread):
            out[i] = hashlib.blake2b(ids[a:b].tobytes(), digest_size=16).digest()
    return out


def repeats(digests: np.ndarray) -> np.ndarray:
    """(S,) bool: each sequence whose digest (``token_digests``) an earlier one has — a sequence read twice (a store
    given twice, a shard copied under another name or into another store). Empty digests are never repeats."""
    _, first = np.unique(digests, return_index=True)
    twice = np.ones(len(digests), bool)  # (S,)
    twice[first] = False
    return twice & (digests != b"")


def balance_batches(batches: list[list[int]], world_size: int) -> list[list[int]]:
    """Make the batch count a multiple of ``world_size`` by halving the largest batches.

    Keeps batches disjoint and covering; only when every batch holds a single sequence are
    the first batches repeated (the one case where ranks would otherwise differ).
    """
    out = [list(b) for b in batches]
    while len(out) % world_size:
        j = max(range(len(out)), key=lambda i: len(out[i]))
        if len(out[j]) < 2:
            out += out[: world_size - len(out) % world_size]
            break
        b = out.pop(j)
        out[j:j] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return out


def plan_batches(lengths: np.ndarray, cfg: BatchSettings, epoch: int, world_size: int) -> list[list[int]]:
    """All batches (indices into ``lengths`` (S,)) of one split for ``epoch``, balanced for ``world_size``.

    Shuffled (seeded by ``cfg.seed`` and ``epoch``) in windows of ``cfg.bucket_size`` sequences, each
    window sorted by length and cut into batches of at most ``cfg.max_tokens`` padded tokens (and
    ``cfg.max_batch_size`` sequences); the batches are shuffled again. The plan depends only on the
    lengths, (seed, epoch) and world_size, so every rank computes the same one; the store reader and
    the online features (``specdraft.online``) both plan with it.
    """
    rng = np.random.default_rng([cfg.seed, epoch])
    n = len(lengths)
    order = rng.permutation(n) if cfg.shuffle else np.arange(n)
    window = cfg.bucket_size if cfg.shuffle else max(n, 1)
    batches: list[list[int]] = []
    for lo in range(0, n, window):
        part = order[lo : lo + window]
        part = part[np.argsort(lengths[part], kind="stable")]
        current, longest = [], 0
        for i in part.tolist():
            wider = max(longest, int(lengths[i]))
            full = cfg.max_batch_size is not None and len(current) >= cfg.max_batch_size
            if current and (wider * (len(current) + 1) > cfg.max_tokens or full):
                batches.append(current)
                current, wider = [], int(lengths[i])
            current.append(i)
            longest = wider
        if current:
            batches.append(current)
    if cfg.shuffle:
        batches = [batches[j] for j in rng.permutation(len(batches))]
    return balance_batches(batches, world_size)
