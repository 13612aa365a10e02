"""Issue 22, class 3 "Corrupt data trained on": store integrity is checked on read.

Faults injected into real stores (written by the store's own writer, on disk and on the local S3
server): bytes flipped in a hidden-state chunk, a chunk deleted, a chunk truncated. Each is a
one-line ``StoreError`` naming the store, shard, array and chunk — from the reader and from a real
training run — or, under ``reader.on_corrupt=skip``, the sequences it holds are skipped and counted.
A store written before the checksums still reads, with one warning.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specdraft import store
from specdraft.store import FeatureDataset, StoreError, StoreWarning, location
from specdraft.configs.reader import ReaderConfig
from tests.specdraft.store_helpers import D, K, V, synthetic_shard

HEADER = {"target_id": "t@1", "d": D, "k": K, "hidden_codec": "fp16"}
CHUNK = 16  # rows per chunk: each shard holds several chunks


def write_store(root, shards: int = 2, *, chunk_checksums: bool = True) -> list[dict]:
    location.make_dirs(root)
    records = []
    for i in range(shards):
        arrays, _ = synthetic_shard(i, np.random.default_rng(i), torch.Generator().manual_seed(i), per_shard=8)
        records.append(store.write_shard(root, i, arrays, {"d": D, "k": K, "hidden_codec": "fp16", "target_id": "t@1"},
                                          chunk_tokens=CHUNK, chunk_checksums=chunk_checksums))
    store.write_manifest(root, store.make_manifest(header=HEADER, shards=records))
    return records


def read_all(root, **kw) -> tuple[FeatureDataset, list]:
    ds = FeatureDataset(root, ReaderConfig(max_tokens=64, seed=1, **kw), split="all")
    return ds, list(ds)


def flip_bytes(path: Path, count: int = 10) -> None:
    """``count`` bytes of the chunk's compressed payload inverted (its length and framing kept)."""
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[len(data) // 3 + i] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_one_line_naming(err: StoreError, root, shard: str, array: str, chunk: str) -> None:
    text = str(err)
    assert "\n" not in text, text
    for part in (str(root), shard, f"array {array}", f"chunk {chunk}"):
        assert part in text, (part, text)


def test_ten_flipped_bytes_in_a_hidden_chunk_are_an_error_naming_store_shard_array_and_chunk(tmp_path):
    write_store(tmp_path)
    read_all(tmp_path)  # clean: reads
    flip_bytes(tmp_path / "shard-00001.zarr/hidden/c/1/0")
    with pytest.raises(StoreError) as caught:
        read_all(tmp_path)
    assert_one_line_naming(caught.value, tmp_path, "shard-00001.zarr", "hidden", "c/1/0")
    assert "checksum" in str(caught.value)


def test_a_deleted_chunk_is_an_error_not_zeros(tmp_path):
    write_store(tmp_path)
    (tmp_path / "shard-00000.zarr/topk_logits/c/2/0").unlink()
    with pytest.raises(StoreError, match="missing") as caught:
        read_all(tmp_path)
    assert_one_line_naming(caught.value, tmp_path, "shard-00000.zarr", "topk_logits", "c/2/0")


def test_a_deleted_sequence_chunk_is_an_error_when_the_store_is_opened(tmp_path):
    write_store(tmp_path)
    (tmp_path / "shard-00001.zarr/offsets/c/0").unlink()
    with pytest.raises(StoreError, match="missing") as caught:
        FeatureDataset(tmp_path)
    assert_one_line_naming(caught.value, tmp_path, "shard-00001.zarr", "offsets", "c/0")


def test_a_truncated_chunk_is_a_one_line_error_not_a_traceback(tmp_path):
    write_store(tmp_path)
    chunk = tmp_path / "shard-00000.zarr/hidden/c/0/0"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    with pytest.raises(StoreError) as caught:
        read_all(tmp_path)
    assert_one_line_naming(caught.value, tmp_path, "shard-00000.zarr", "hidden", "c/0/0")
    # the draft-vocabulary statistics read the store too
    (tmp_path / "shard-00001.zarr/input_ids/c/0").write_bytes(b"\x00" * 5)
    with pytest.raises(StoreError) as caught:
        store.predicted_token_counts(tmp_path, V)
    assert_one_line_naming(caught.value, tmp_path, "shard-00001.zarr", "input_ids", "c/0")


def test_on_s3_a_truncated_and_a_deleted_chunk_are_errors_naming_the_url(s3_bucket):
    import fsspec

    root = f"{s3_bucket}/corrupt"
    write_store(root)
    read_all(root)
    fs = fsspec.filesystem("s3")
    chunk = f"{root[len('s3://'):]}/shard-00001.zarr/hidden/c/1/0"
    fs.pipe_file(chunk, fs.cat_file(chunk)[:-3])
    with pytest.raises(StoreError) as caught:
        read_all(root)
    assert_one_line_naming(caught.value, root, "shard-00001.zarr", "hidden", "c/1/0")
    fs.rm_file(f"{root[len('s3://'):]}/shard-00000.zarr/loss_mask/c/0")  # and a chunk of the other shard lost
    ds = FeatureDataset(root, ReaderConfig(max_tokens=64), split="all")
    assert ds.sample_ids[0] == "s0-0"  # rows 0.. of shard 0: in the lost chunk
    with pytest.raises(StoreError, match="missing") as caught:
        ds.load([0])
    assert_one_line_naming(caught.value, root, "shard-00000.zarr", "loss_mask", "c/0")
    skipping = FeatureDataset(root, ReaderConfig(max_tokens=64, on_corrupt="skip"), split="all")
    assert not skipping.load([0]).loss_mask.any() and "s0-0" in skipping.skipped
    report = store.validate(root)  # validate-store still finds both
    assert not report.ok and len(report.problems) >= 2, report.problems


def test_skip_option_skips_and_counts_the_sequences_of_a_bad_chunk(tmp_path):
    write_store(tmp_path)
    _, clean = read_all(tmp_path)
    flip_bytes(tmp_path / "shard-00001.zarr/hidden/c/1/0")
    ds, batches = read_all(tmp_path, on_corrupt="skip")
    # the bad chunk holds rows 16-31 of shard 1: the sequences overlapping them are skipped
    group = location.open_group(tmp_path / "shard-00001.zarr", "r")
    starts = group["offsets"][...]
    expected = {f"s1-{j}" for j in range(8) if starts[j] < 2 * CHUNK and starts[j + 1] > CHUNK}
    assert expected and set(ds.skipped) == expected, (ds.skipped, expected)
    assert all("shard-00001.zarr/hidden chunk c/1/0" in why for why in ds.skipped.values())
    # same batches as the clean store, the skipped sequences' loss masked out, everything else identical
    assert len(batches) == len(clean)
    plan = ds.batches()
    for seqs, batch, good in zip(plan, batches, clean):
        for row, i in enumerate(seqs):
            if ds.sample_ids[i] in expected:
                assert not batch.loss_mask[row].any()
            else:
                assert torch.equal(batch.loss_mask[row], good.loss_mask[row])
                assert torch.equal(batch.hidden[row], good.hidden[row])


def test_fill_valued_chunks_are_listed_unstored_and_read_as_zeros_while_a_lost_one_is_an_error(tmp_path):
    """Zarr stores no chunk that holds only fill values; the shard record lists them (``fill_chunks``), so
    the reader gives their zeros without reading anything while any other absent chunk is lost."""
    location.make_dirs(tmp_path)
    arrays, _ = synthetic_shard(0, np.random.default_rng(0), torch.Generator().manual_seed(0), per_shard=8)
    arrays["loss_mask"][CHUNK : 2 * CHUNK] = 0  # chunk 1: only fill values
    arrays["logsumexp"][:] = 0  # every chunk
    record = store.write_shard(tmp_path, 0, arrays, {"d": D, "k": K, "hidden_codec": "fp16", "target_id": "t@1"},
                               chunk_tokens=CHUNK)
    store.write_manifest(tmp_path, store.make_manifest(header=HEADER, shards=[record]))
    chunks = -(-len(arrays["logsumexp"]) // CHUNK)
    assert record["fill_chunks"] == {"logsumexp": list(range(chunks)), "loss_mask": [1]}, record["fill_chunks"]
    assert not (tmp_path / "shard-00000.zarr/loss_mask/c/1").exists()
    ds, batches = read_all(tmp_path)
    order = [i for seqs in ds.batches() for i in seqs]
    lengths = np.diff(arrays["offsets"])
    for i, batch_row in zip(order, [(b, r) for b in batches for r in range(b.input_ids.shape[0])]):
        batch, row = batch_row
        a, m = int(arrays["offsets"][i]), int(lengths[i])
        assert torch.equal(batch.loss_mask[row, :m], torch.from_numpy(arrays["loss_mask"][a : a + m].astype(bool)))
    (tmp_path / "shard-00000.zarr/loss_mask/c/0").unlink()  # a chunk that was stored: lost
    with pytest.raises(StoreError, match="missing") as caught:
        read_all(tmp_path)
    assert_one_line_naming(caught.value, tmp_path, "shard-00000.zarr", "loss_mask", "c/0")


def test_a_store_written_with_checksums_before_fill_chunks_were_listed_checks_every_chunk(tmp_path):
    """A shard written with checksums but no ``fill_chunks`` in its record stored every chunk: any absent
    chunk is lost."""
    write_store(tmp_path, shards=1)
    for path in (tmp_path / "shard-00000.zarr/zarr.json", tmp_path / "manifest.json"):  # as such a store's record
        text = path.read_text()
        assert text.count('"fill_chunks": {}') == 1, text
        path.write_text(text.replace('"fill_chunks": {}', '"legacy": {}'))
    ds, _ = read_all(tmp_path)
    assert not ds._fill[0]
    (tmp_path / "shard-00000.zarr/logsumexp/c/1").unlink()
    with pytest.raises(StoreError, match="missing") as caught:
        read_all(tmp_path)
    assert_one_line_naming(caught.value, tmp_path, "shard-00000.zarr", "logsumexp", "c/1")


def test_a_store_written_before_the_checksums_reads_with_one_warning(tmp_path):
    write_store(tmp_path / "new")
    write_store(tmp_path / "old", chunk_checksums=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a store with checksums: no warning
        _, new = read_all(tmp_path / "new")
    with pytest.warns(StoreWarning, match="without per-chunk checksums") as caught:
        _, old = read_all(tmp_path / "old")
        read_all(tmp_path / "old")  # once per store
    assert len([w for w in caught if issubclass(w.category, StoreWarning)]) == 1
    for a, b in zip(new, old):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.input_ids, b.input_ids)
    assert store.validate(tmp_path / "old").ok and store.validate(tmp_path / "new").ok


def test_validate_store_reports_every_bad_chunk_of_a_checksummed_store(tmp_path):
    write_store(tmp_path)
    assert store.validate(tmp_path).ok
    flip_bytes(tmp_path / "shard-00001.zarr/hidden/c/1/0")
    (tmp_path / "shard-00000.zarr/topk_ids/c/0/0").unlink()
    problems = store.validate(tmp_path).problems
    assert any("shard-00001.zarr/hidden" in p for p in problems), problems
    assert any("shard-00000.zarr/topk_ids" in p for p in problems), problems


# --- a real training run (Ray Train's local mode: the training loop in this process) --------------


def toy_store(root: Path, target: Path) -> Path:
    """A store of random features at the toy target's width, written with the writer (one chunk of
    hidden states per 16 tokens)."""
    from specdraft.targets.identity import target_id
    from specdraft.targets.loading import load_target_config

    d = load_target_config(target).hidden_size
    header = {"target_id": target_id(target), "d": d, "k": K, "hidden_codec": "fp16"}
    records = []
    for i in range(2):
        arrays, _ = synthetic_shard(i, np.random.default_rng(i), torch.Generator().manual_seed(i), per_shard=24, d=d)
        records.append(store.write_shard(root, i, arrays, {**header, "hidden_codec": "fp16"}, chunk_tokens=CHUNK))
    store.write_manifest(root, store.make_manifest(header=header, shards=records))
    return root


@pytest.mark.slow
def test_training_on_a_store_with_flipped_bytes_fails_or_under_skip_counts_the_skipped(local_ray, tiny_toy_target, tmp_path):
    from pipelines.train import run_training
    from pipelines.configs import ClusterTrainConfig, ScalingSection

    root = toy_store(tmp_path / "store", tiny_toy_target)
    flip_bytes(root / "shard-00001.zarr/hidden/c/1/0")
    cfg = ClusterTrainConfig(recipe="eagle", epochs=[1], seed=0, checkpoint_every=0, min_steps=1, max_failures=0,
                      reader=ReaderConfig(max_tokens=256, val_fraction=0.0), scaling=ScalingSection(num_workers=0))
    with pytest.raises(Exception) as caught:
        run_training(cfg, [root], tiny_toy_target, tmp_path / "run")
    assert isinstance(caught.value, StoreError), repr(caught.value)
    assert_one_line_naming(caught.value, root, "shard-00001.zarr", "hidden", "c/1/0")
    assert not (tmp_path / "run" / "draft").exists()
    # reader.on_corrupt=skip on two Ray Train workers: the run trains without the bad chunks' sequences and
    # counts them — every rank's, not rank 0's alone
    for chunk in sorted((root / "shard-00001.zarr/hidden/c").iterdir(), key=lambda c: int(c.name))[2:]:
        flip_bytes(chunk / "0")  # chunks 2.. too (1 is flipped): bad sequences on both ranks
    skip = replace(cfg, reader=replace(cfg.reader, on_corrupt="skip"), scaling=ScalingSection(num_workers=2))
    summary = run_training(skip, [root], tiny_toy_target, tmp_path / "skip")
    assert Path(summary["draft"]).is_dir()
    ends = location.open_group(root / "shard-00001.zarr", "r")["offsets"][1:]
    bad = {f"s1-{j}" for j, end in enumerate(ends) if end > CHUNK}  # a row in chunk 1 or after
    ranks = [FeatureDataset([root], skip.reader, split="train", rank=r, world_size=2) for r in (0, 1)]
    read = [bad & {ds.sample_ids[i] for batch in ds.batches(0) for i in batch} for ds in ranks]
    assert read[0] and read[1], read  # each rank skips some: rank 0's count alone is not the run's
    assert summary["metrics"]["skipped_corrupt_sequences"] == len(read[0] | read[1]), (summary["metrics"], read)
