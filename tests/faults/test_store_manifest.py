"""Issue 31 item 3: a manifest that lists a shard twice. ``validate-store`` caught it, but ``train`` read the
shard once per listing — its samples trained on twice, silently. The manifest is now refused where it is read
(``specdraft.store.manifest.read_manifest``: train's reader, a resumed dump, ``validate-store``), with one line
naming the store and the shard. A real store (``tests/specdraft/test_store.py``'s synthetic shards, real Zarr)
whose ``manifest.json`` is edited as a hand or a tool would."""

from __future__ import annotations

import json

import pytest

from specdraft import store
from specdraft.store import FeatureDataset, StoreError
from specdraft.configs.reader import ReaderConfig
from tests.specdraft.test_store import make_store


@pytest.fixture()
def listed_twice(tmp_path):
    root = tmp_path / "store"
    make_store(root, shards=2)
    manifest = json.loads((root / store.MANIFEST_FILE).read_text())
    manifest["shards"].append(dict(manifest["shards"][0]))  # shard-00000.zarr once more
    (root / store.MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return root


def test_the_reader_refuses_a_manifest_listing_a_shard_twice_naming_store_and_shard(listed_twice):
    """Today: the reader holds shard 0's 7 samples twice (21 sequences from 14 stored)."""
    with pytest.raises(StoreError) as err:
        FeatureDataset(listed_twice, ReaderConfig(max_tokens=256, val_fraction=0.0))
    line = str(err.value)
    assert "\n" not in line and str(listed_twice) in line and store.shard_name(0) in line and "twice" not in line
    assert "listed 2 times" in line


def test_validate_store_reports_it_too(listed_twice):
    report = store.validate(listed_twice)
    assert not report.ok and any(store.shard_name(0) in p and "listed 2 times" in p for p in report.problems)


def test_a_manifest_listing_each_shard_once_reads_every_sample_once(tmp_path):
    truth = make_store(tmp_path / "store", shards=2)
    ds = FeatureDataset(tmp_path / "store", ReaderConfig(max_tokens=256, val_fraction=0.0))
    assert sorted(ds.sample_ids) == sorted(truth)  # each stored sample once
