"""Tests for specdraft.store at an object-store URL (specdraft/store/location.py), against a real
S3 server (moto's server mode on 127.0.0.1): same store as a local one, commit without rename,
a killed shard writer, rewriting its leftovers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specdraft import store
from specdraft.store import FeatureDataset, StoreError, location
from specdraft.configs.reader import ReaderConfig
from tests.specdraft.store_helpers import D, K, V, synthetic_shard

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

HEADER = {"target_id": "t@1", "d": D, "k": K, "hidden_codec": "int8"}


def shard_arrays(idx: int, per_shard: int = 4) -> tuple[dict[str, np.ndarray], dict]:
    """Deterministic arrays of shard ``idx`` (int8 codec: hidden + hidden_scale)."""
    rng, gen = np.random.default_rng(idx), torch.Generator().manual_seed(idx)
    arrays, _ = synthetic_shard(idx, rng, gen, per_shard=per_shard, codec="int8", max_len=20)
    return arrays, {"d": D, "k": K, "hidden_codec": "int8", "target_id": "t@1"}


def write_store(root, shards: int = 2) -> list[dict]:
    location.make_dirs(root)
    records = [store.write_shard(root, i, *shard_arrays(i), chunk_tokens=32) for i in range(shards)]
    store.write_manifest(root, store.make_manifest(header=HEADER, shards=records))
    return records


def all_batches(root) -> tuple[list[list[str]], list]:
    """(sample ids per batch, batches) of the whole store, one fixed plan."""
    ds = FeatureDataset(root, ReaderConfig(max_tokens=64, seed=1, bucket_size=4), split="all")
    ds.set_epoch(0)
    return [[ds.sample_ids[i] for i in seqs] for seqs in ds.batches()], list(ds)


def assert_same_batches(a, b) -> None:
    (ids_a, batches_a), (ids_b, batches_b) = a, b
    assert ids_a == ids_b and len(batches_a) == len(batches_b) > 1
    for x, y in zip(batches_a, batches_b):
        for field in ("input_ids", "hidden", "loss_mask", "topk_ids", "topk_logp"):
            assert torch.equal(getattr(x, field), getattr(y, field)), field


def test_a_store_on_s3_equals_the_same_store_written_locally(s3_bucket, tmp_path):
    local, remote = tmp_path / "local", f"{s3_bucket}/stores/a/"  # a trailing slash is the same URL
    assert write_store(local) == write_store(remote)  # records: counts, sha256, bytes
    assert location.read_text(f"{remote.rstrip('/')}/manifest.json") == (local / "manifest.json").read_text()
    report = store.validate(remote)
    assert report.ok and not report.warnings and report.num_shards == 2, report
    assert_same_batches(all_batches(remote), all_batches(local))
    counts = store.predicted_token_counts(remote, V)
    np.testing.assert_array_equal(counts, store.predicted_token_counts(local, V))
    # no temporaries, no renames: exactly the shards and the manifest under the prefix
    assert location.list_dir(remote) == ["manifest.json", *(store.shard_name(i) for i in range(2))]


def test_validate_on_s3_catches_a_truncated_chunk(s3_bucket):
    import fsspec

    root = f"{s3_bucket}/corrupt"
    write_store(root, shards=2)
    fs = fsspec.filesystem("s3")
    chunk = f"{root[len('s3://'):]}/shard-00001.zarr/hidden/c/0/0"
    fs.pipe_file(chunk, fs.cat_file(chunk)[:-3])
    report = store.validate(root)
    assert not report.ok and any("shard-00001.zarr/hidden" in p for p in report.problems), report.problems


def test_a_killed_writer_on_s3_leaves_an_incomplete_store_and_a_rewrite_completes_it(s3_bucket, tmp_path):
    root = f"{s3_bucket}/killed"
    records = [store.write_shard(root, 0, *shard_arrays(0), chunk_tokens=32)]
    # shard 1's writer dies after some arrays (no rename at a URL: they sit under the final name),
    # leaving also a chunk that a clean rewrite would never produce
    arrays, _ = shard_arrays(1)
    partial = location.open_group(f"{root}/shard-00001.zarr", "w")
    partial.create_array("input_ids", data=arrays["input_ids"])
    partial.create_array("hidden", data=np.ones((512, D), np.int8), chunks=(16, D))
    stale = f"{root}/shard-00001.zarr/hidden/c/31/0"
    assert location.exists(stale)

    with pytest.raises(StoreError, match="incomplete"):  # no manifest: readers refuse the store
        FeatureDataset(root)
    assert not store.validate(root, checksums=False).ok
    finals, temps = store.list_shard_dirs(root)
    assert sorted(finals) == [0, 1] and temps == []
    with pytest.raises(StoreError, match="not a complete shard"):
        store.read_shard_record(finals[1])
    # a manifest that lists the partial shard anyway (a buggy writer) does not make it readable
    bogus = dict(records[0], index=1, name=store.shard_name(1))
    store.write_manifest(root, store.make_manifest(header=HEADER, shards=[*records, bogus]))
    report = store.validate(root, checksums=False)
    assert any("shard-00001.zarr" in p and "not a complete shard" in p for p in report.problems), report.problems

    # resume: the shard is rewritten from scratch (leftover keys deleted first), then the manifest
    records.append(store.write_shard(root, 1, *shard_arrays(1), chunk_tokens=32))
    assert not location.exists(stale)
    store.write_manifest(root, store.make_manifest(header=HEADER, shards=records))
    assert store.validate(root).ok
    local = tmp_path / "local"
    write_store(local)
    assert json.loads(location.read_text(f"{root}/manifest.json")) == store.read_manifest(local)
    assert_same_batches(all_batches(root), all_batches(local))  # nothing lost, nothing twice


def test_urls_and_paths(tmp_path):
    assert location.is_url("s3://b/p") and location.is_url("gs://b") and not location.is_url("file:///x")
    assert location.as_location(f"file://{tmp_path}") == tmp_path and location.as_location("s3://b/p/") == "s3://b/p"
    assert location.join("s3://b/p/", "m.json") == "s3://b/p/m.json" and location.join(tmp_path, "m") == tmp_path / "m"
    assert location.name_of("s3://b/p/shard-00001.zarr") == "shard-00001.zarr"
