"""Issue 44, Deliver 6: the reader reads each sequence once, however the stores arrive — a store given twice, a
shard copied under another name or into another store, the same tokens under another sample id — and counts what
it leaves out (``duplicate_sequence: N``); sequences that differ in one token are all kept."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specdraft import store
from specdraft.store import FeatureDataset
from specdraft.configs.reader import ReaderConfig
from specdraft.store.batching import repeats, token_digests
from tests.specdraft.store_helpers import D, K, synthetic_shard

HEADER = {"target_id": "t@1", "d": D, "k": K, "hidden_codec": "fp16"}


def write_store(root, shards: list[dict[str, np.ndarray]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    records = [store.write_shard(root, i, arrays, HEADER, chunk_tokens=16) for i, arrays in enumerate(shards)]
    store.write_manifest(root, store.make_manifest(header=HEADER, shards=records))


def shard(idx: int, seed: int, prefix: str = "s", per_shard: int = 12) -> dict[str, np.ndarray]:
    arrays, _ = synthetic_shard(idx, np.random.default_rng(seed), torch.Generator().manual_seed(seed),
                                per_shard=per_shard, prefix=prefix)
    return arrays


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("dups")
    write_store(root / "a", [shard(0, 0), shard(1, 1)])
    write_store(root / "b", [shard(0, 2, prefix="b")])  # other sequences
    # store a's shard 1 copied into store c under another name, beside a shard of its own
    write_store(root / "c", [shard(0, 3, prefix="c")])
    shutil.copytree(root / "a" / "shard-00001.zarr", root / "c" / "shard-00001.zarr")
    manifest = json.loads((root / "c" / store.MANIFEST_FILE).read_text())
    copied = {**json.loads((root / "a" / store.MANIFEST_FILE).read_text())["shards"][1], "index": 1}
    store.write_manifest(root / "c", store.make_manifest(header=HEADER, shards=[*manifest["shards"], copied]))
    return {"root": root, "a": root / "a", "b": root / "b", "c": root / "c"}


def ids_of(paths, split="all", **cfg) -> FeatureDataset:
    return FeatureDataset(paths, ReaderConfig(max_tokens=64, **cfg), split=split)


def test_a_store_given_twice_is_read_once_and_the_repeats_counted(stores, capsys):
    once = ids_of([stores["a"]])
    assert once.duplicates == [] and "duplicate_sequence" not in capsys.readouterr().out
    twice = ids_of([stores["a"], stores["a"]])  # today: every sequence of a trained twice
    assert sorted(twice.sample_ids) == sorted(once.sample_ids) and len(twice.duplicates) == len(once.sample_ids)
    assert len(twice.global_batches(0)) == len(once.global_batches(0))
    assert f"duplicate_sequence: {len(once.sample_ids)} sequence(s) left out of the all split" in capsys.readouterr().out
    both = ids_of([stores["a"], stores["b"]])  # other stores: nothing left out
    assert both.duplicates == [] and len(both.sample_ids) == len(once.sample_ids) + 12


def test_a_shard_copied_into_another_store_is_read_once(stores):
    c = ids_of([stores["c"]])  # within one store the copy is its only copy: kept
    assert c.duplicates == [] and len(c.sample_ids) == 24
    ac = ids_of([stores["a"], stores["c"]])
    assert len(ac.duplicates) == 12 and all(s.startswith("s1-") for s in ac.duplicates)  # shard 1 of a, again
    assert sorted(ac.sample_ids) == sorted([*ids_of([stores["a"]]).sample_ids, *(f"c0-{j}" for j in range(12))])
    # the first copy read stays: in order c, a, the copy in c is the one read
    ca = ids_of([stores["c"], stores["a"]])
    assert len(ca.duplicates) == 12 and sorted(ca.sample_ids) == sorted(ac.sample_ids)


def test_the_same_tokens_under_other_sample_ids_train_once_across_the_splits(tmp_path):
    """Duplicates are found by content, before the split: the same tokens under two ids never sit in train and in
    val at once (the held-out numbers would measure training data)."""
    first = shard(0, 5, per_shard=40)
    renamed = {**first, "sample_ids": np.asarray([f"other-{j}" for j in range(40)], dtype=str)}
    write_store(tmp_path / "x", [first])
    write_store(tmp_path / "y", [renamed])
    train = ids_of([tmp_path / "x", tmp_path / "y"], "train", val_fraction=0.5)
    val = ids_of([tmp_path / "x", tmp_path / "y"], "val", val_fraction=0.5)
    assert len(train.sample_ids) + len(val.sample_ids) == 40  # one of each
    assert {s.split("-")[-1] for s in train.sample_ids}.isdisjoint({s.split("-")[-1] for s in val.sample_ids})
    assert len(train.duplicates) + len(val.duplicates) == 40  # each renamed copy, in the split its id falls in
    assert all(s.startswith("other-") for s in train.duplicates + val.duplicates)


def test_token_digests_tell_apart_sequences_that_differ_in_one_token():
    ids = np.array([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 0, 1, 2], np.int32)
    offsets = np.array([0, 3, 6, 9, 13, 15])  # [1 2 3] [1 2 3] [1 2 4] [1 2 3 0] [1 2]
    assert repeats(token_digests(ids, offsets)).tolist() == [False, True, False, False, False]
    # a sequence the reader could not read (a bad chunk skipped) is never taken for a copy of another
    assert repeats(token_digests(ids, offsets, [(4, 5, "bad chunk")])).tolist() == [False] * 5
    assert token_digests(ids.astype(np.int64), offsets).tolist() == token_digests(ids, offsets).tolist()
