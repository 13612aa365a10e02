"""Tests for specdraft.store: shard round trip, codecs, reader batches/partitioning, validation."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from specdraft import store
from specdraft.store import FeatureDataset, StoreError
from specdraft.configs.reader import ReaderConfig
from tests.specdraft.store_helpers import D, K, V, synthetic_shard


def make_store(root, *, shards=3, per_shard=7, codec="fp16", seed=0, prefix="s", target="t@1", d=D, aux=()):
    """A synthetic store; returns {sample_id: truth dict} with the exact stored values."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    truth, records = {}, []
    root.mkdir(parents=True, exist_ok=True)
    for idx in range(shards):
        arrays, values = synthetic_shard(idx, rng, gen, per_shard=per_shard, codec=codec, d=d, aux=aux, prefix=prefix)
        hidden, aux_hidden, logits, top = values["hidden"], values["aux_hidden"], values["logits"], values["top"]
        ids = arrays["sample_ids"].tolist()
        attrs = {"d": d, "k": K, "hidden_codec": codec, "target_id": target, "aux_layers": list(aux)}
        records.append(store.write_shard(root, idx, arrays, attrs, chunk_tokens=16))
        off = arrays["offsets"]
        for j, sid in enumerate(ids):
            a, b = off[j], off[j + 1]
            truth[sid] = {
                "input_ids": arrays["input_ids"][a:b],
                "loss_mask": arrays["loss_mask"][a:b],
                "hidden": hidden[a:b],
                "aux_hidden": aux_hidden[a:b],
                "topk_ids": arrays["topk_ids"][a:b],
                "topk_logp": torch.log_softmax(logits[a:b], -1).gather(-1, top.indices[a:b]),
            }
    header = {"target_id": target, "d": d, "k": K, "hidden_codec": codec, "aux_layers": list(aux)}
    store.write_manifest(root, store.make_manifest(header=header, shards=records))
    return truth


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    return root, make_store(root)


def rows_of(ds: FeatureDataset, epoch: int = 0):
    """(sample_id, batch, row) for every sequence the dataset yields, in order (batches decoded by ``to``)."""
    ds.set_epoch(epoch)
    out = []
    for seqs, stored in zip(ds.batches(), ds):
        batch = stored.to("cpu")
        for row, i in enumerate(seqs):
            out.append((ds.sample_ids[i], batch, row))
    return out


# --- codecs and shards ---------------------------------------------------------------------


@pytest.mark.parametrize("codec, tol", [("fp16", 2e-3), ("bf16", 1e-2), ("int8", 1.5e-2)])
def test_hidden_codecs_round_trip(codec, tol):
    h = torch.randn(64, 32) * 5  # (N, d)
    arrays = store.encode_hidden(h, codec)
    dtype, _ = store.array_schema(32, K, codec)["hidden"]
    assert arrays["hidden"].dtype == np.dtype(dtype)
    back = store.decode_hidden(arrays["hidden"], codec, arrays.get("hidden_scale"))
    assert back.dtype == torch.float32 and back.shape == h.shape
    rel = (back - h).abs().amax(-1) / h.abs().amax(-1)  # (N,) error relative to the row's absmax
    assert float(rel.max()) < tol
    if codec == "bf16":
        assert torch.equal(back, h.to(torch.bfloat16).float())


def test_shard_is_written_by_rename_and_records_checksums(tmp_path):
    make_store(tmp_path, shards=1)
    finals, temps = store.list_shard_dirs(tmp_path)
    assert list(finals) == [0] and temps == []
    record = store.read_shard_record(finals[0])
    assert set(record["checksums"]) == set(store.array_schema(D, K, "fp16"))
    assert record["num_sequences"] == 7 and record["bytes"] > 0


# --- reader ----------------------------------------------------------------------------------


def test_reader_yields_exact_padded_batches(synthetic):
    root, truth = synthetic
    ds = FeatureDataset(root, ReaderConfig(max_tokens=64), split="all")
    assert (ds.d, ds.k) == (D, K)
    stored = next(iter(ds))  # iteration hands out the stored form; .to(device) decodes
    assert stored.hidden.dtype == torch.float16 and not stored.decoded and stored.to("cpu").decoded
    seen = set()
    for sid, batch, row in rows_of(ds):
        t = truth[sid]
        n = len(t["input_ids"])
        assert batch.input_ids.dtype == torch.int64 and batch.topk_ids.dtype == torch.int64
        assert batch.hidden.dtype == torch.float32 and batch.loss_mask.dtype == torch.bool
        assert batch.valid[row].tolist() == [True] * n + [False] * (batch.valid.shape[1] - n)
        assert batch.input_ids[row, :n].tolist() == t["input_ids"].tolist()
        assert batch.loss_mask[row, :n].tolist() == t["loss_mask"].astype(bool).tolist()
        torch.testing.assert_close(batch.hidden[row, :n], t["hidden"], atol=1e-2, rtol=1e-3)
        assert batch.topk_ids[row, :n].tolist() == t["topk_ids"].tolist()
        torch.testing.assert_close(batch.topk_logp[row, :n], t["topk_logp"], atol=1e-2, rtol=1e-3)
        assert not batch.loss_mask[row, n:].any() and (batch.hidden[row, n:] == 0).all()
        assert (batch.topk_logp[row, n:] == -1e4).all()
        assert batch.input_ids.shape[0] * batch.input_ids.shape[1] <= 64 or batch.input_ids.shape[0] == 1
        seen.add(sid)
    assert seen == set(truth)


def test_wide_arrays_get_chunks_within_chunk_bytes_and_read_the_same(synthetic, tmp_path, monkeypatch):
    """A chunk of a token array holds at most ``writer.CHUNK_BYTES``: hidden states (2D bytes a row) get
    fewer rows than ``chunk_tokens`` while the narrow arrays keep them, and the batches are the same."""
    from specdraft.store import writer

    monkeypatch.setattr(writer, "CHUNK_BYTES", 4 * 2 * D)  # 4 rows of hidden states
    truth = make_store(tmp_path)
    group = store.location.open_group(tmp_path / "shard-00000.zarr", "r")
    assert group["hidden"].chunks[0] == 4 and group["input_ids"].chunks[0] == 16
    assert group["topk_ids"].chunks[0] == 4 * 2 * D // (4 * K)
    root, _ = synthetic  # the same features in 16-row chunks
    wide, narrow = (FeatureDataset(r, ReaderConfig(max_tokens=64), split="all") for r in (tmp_path, root))
    assert truth.keys() == set(narrow.sample_ids) and wide.sample_ids == narrow.sample_ids
    for a, b in zip(wide, narrow):
        for name in ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logp", "valid"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_reader_is_deterministic_per_seed_and_epoch(synthetic):
    root, _ = synthetic
    cfg = ReaderConfig(max_tokens=48, seed=3)
    a, b = FeatureDataset(root, cfg), FeatureDataset(root, cfg)
    assert a.batches(0) == b.batches(0)
    assert a.batches(0) != a.batches(1)
    assert a.batches(1) != FeatureDataset(root, ReaderConfig(max_tokens=48, seed=4)).batches(1)
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.hidden, y.hidden)
    assert torch.equal(a.load(a.batches(0)[0]).hidden, next(iter(a)).to("cpu").hidden)
    fixed = FeatureDataset(root, ReaderConfig(max_tokens=48, shuffle=False))
    assert fixed.batches(0) == fixed.batches(5)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_rank_partition_is_disjoint_covering_and_equal(synthetic, world_size):
    root, truth = synthetic
    cfg = ReaderConfig(max_tokens=40, seed=1)
    parts = [FeatureDataset(root, cfg, rank=r, world_size=world_size) for r in range(world_size)]
    counts = {len(p.batches(2)) for p in parts}
    assert len(counts) == 1 and counts.pop() > 0
    ids = [p.sample_ids[i] for p in parts for batch in p.batches(2) for i in batch]
    assert sorted(ids) == sorted(truth)  # disjoint and covering
    assert len(parts[-1]) == len(parts[0])


def test_balance_batches_edge_cases():
    assert store.balance_batches([[0, 1, 2], [3]], 4) == [[0], [1], [2], [3]]
    assert store.balance_batches([], 3) == []
    assert store.balance_batches([[0], [1]], 3) == [[0], [1], [0]]  # only singletons: repeat


def test_dataloader_workers_split_this_ranks_batches(synthetic):
    root, truth = synthetic
    ds = FeatureDataset(root, ReaderConfig(max_tokens=40))
    # spawn, not fork: zarr's async IO thread (and Ray, in a full test run) do not survive a fork
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    total = sum(int(b.valid.any(-1).sum()) for b in loader)
    assert total == len(truth)


def test_validation_split_by_sample_id(synthetic):
    root, truth = synthetic
    cfg = ReaderConfig(val_fraction=0.3)
    train, val = FeatureDataset(root, cfg, split="train"), FeatureDataset(root, cfg, split="val")
    assert set(train.sample_ids).isdisjoint(val.sample_ids)
    assert set(train.sample_ids) | set(val.sample_ids) == set(truth)
    assert 0 < len(val.sample_ids) < len(truth)
    assert all(store.is_held_out(s, 0.3) for s in val.sample_ids)


def test_max_length_truncates(synthetic):
    root, truth = synthetic
    ds = FeatureDataset(root, ReaderConfig(max_length=5, max_tokens=20), split="all")
    for sid, batch, row in rows_of(ds):
        n = min(5, len(truth[sid]["input_ids"]))
        assert batch.input_ids.shape[1] <= 5 and int(batch.valid[row].sum()) == n
        assert batch.input_ids[row, :n].tolist() == truth[sid]["input_ids"][:n].tolist()


def test_one_token_sequences_are_left_out_of_training_and_counted(tmp_path, capsys):
    """A one-token sequence (a store written before the dump rejected them) predicts nothing and, batched alone,
    left the drafts no slot to attend to (an IndexError in training): train and val leave it out and say so."""
    header = {"target_id": "t@1", "d": D, "k": K, "hidden_codec": "fp16"}
    arrays, _ = synthetic_shard(0, np.random.default_rng(0), torch.Generator().manual_seed(0), per_shard=40, min_len=1)
    lengths = np.diff(arrays["offsets"])
    short = {str(s) for s, n in zip(arrays["sample_ids"], lengths) if n == 1}
    assert short and len(short) < len(lengths)  # the draw has some of each
    store.write_manifest(tmp_path, store.make_manifest(header=header, shards=[
        store.write_shard(tmp_path, 0, arrays, header, chunk_tokens=16)]))
    cfg = ReaderConfig(max_tokens=4, val_fraction=0.3)  # small batches: a one-token sequence would be alone in one
    train, val = FeatureDataset(tmp_path, cfg, split="train"), FeatureDataset(tmp_path, cfg, split="val", rank=0)
    assert set(train.too_short) | set(val.too_short) == short
    assert set(train.sample_ids) | set(val.sample_ids) == {str(s) for s in arrays["sample_ids"]} - short
    assert all(train.load(seqs).input_ids.shape[1] >= 2 for seqs in train.batches(0))
    assert f"{len(train.too_short)} sequence(s) of one token left out of the train split" in capsys.readouterr().out
    assert len(FeatureDataset(tmp_path, cfg, split="all").sample_ids) == len(lengths)  # "all" reads what is stored


def test_multiple_stores_and_int8(tmp_path):
    t1 = make_store(tmp_path / "a", shards=2, prefix="a")
    t2 = make_store(tmp_path / "b", shards=1, prefix="b", codec="int8", seed=1)
    ds = FeatureDataset([tmp_path / "a", tmp_path / "b"], ReaderConfig(max_tokens=64), split="all")
    rows = rows_of(ds)
    assert {sid for sid, _, _ in rows} == set(t1) | set(t2)
    for sid, batch, row in rows:
        t = {**t1, **t2}[sid]
        n = len(t["input_ids"])
        scale = t["hidden"].abs().amax()
        assert float((batch.hidden[row, :n] - t["hidden"]).abs().max()) <= float(scale) / 127
    assert json.loads((tmp_path / "b" / store.MANIFEST_FILE).read_text())["lossy"] is True
    make_store(tmp_path / "c", shards=1, target="other@2")
    with pytest.raises(StoreError, match="disagree on target_id"):
        FeatureDataset([tmp_path / "a", tmp_path / "c"])
    make_store(tmp_path / "e", shards=1, d=16)
    with pytest.raises(StoreError, match="disagree on d"):
        FeatureDataset([tmp_path / "a", tmp_path / "e"])


# --- validation and partial shards -------------------------------------------------------------


def test_validate_accepts_a_good_store(synthetic):
    report = store.validate(synthetic[0])
    assert report.ok, report.problems
    assert report.num_shards == 3 and report.num_sequences == 21
    report.raise_for_problems()


def corrupt_copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def chunk_files(shard, array):
    return sorted(p for p in (shard / array / "c").rglob("*") if p.is_file())


def test_validate_catches_truncated_and_missing_chunks(synthetic, tmp_path):
    root = corrupt_copy(synthetic[0], tmp_path / "bad")
    chunk = chunk_files(root / store.shard_name(1), "hidden")[0]
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])  # truncated
    chunk_files(root / store.shard_name(2), "topk_ids")[-1].unlink()  # lost chunk: zarr reads fill values
    report = store.validate(root)
    assert not report.ok
    assert any(p.startswith("shard-00001.zarr/hidden") for p in report.problems), report.problems
    assert any(p.startswith("shard-00002.zarr/topk_ids") and "sha256" in p for p in report.problems)
    assert not any(p.startswith("shard-00000.zarr") for p in report.problems)
    with pytest.raises(StoreError, match="shard-00001.zarr/hidden"):
        report.raise_for_problems()


def test_validate_catches_manifest_disagreements(synthetic, tmp_path):
    root = corrupt_copy(synthetic[0], tmp_path / "bad")
    manifest = json.loads((root / store.MANIFEST_FILE).read_text())
    manifest["shards"][0]["num_tokens"] += 1
    (root / store.MANIFEST_FILE).write_text(json.dumps(manifest))
    shutil.rmtree(root / store.shard_name(2))
    problems = store.validate(root).problems
    assert any(p.startswith("shard-00000.zarr: num_tokens") for p in problems), problems
    assert any("shard-00000.zarr/input_ids: shape" in p for p in problems)
    assert "shard-00002.zarr: missing" in problems
    assert any("totals.tokens" in p for p in problems)
    with pytest.raises(StoreError, match="missing"):
        FeatureDataset(root)


def test_offsets_and_dtypes_are_checked(synthetic, tmp_path):
    import zarr

    root = corrupt_copy(synthetic[0], tmp_path / "bad")
    group = zarr.open_group(str(root / store.shard_name(0)), mode="r+", zarr_format=3)
    off = group["offsets"][...]
    off[2], off[3] = off[3], off[2]
    group["offsets"][...] = off
    del group["logsumexp"]
    group.create_array("logsumexp", data=np.zeros(off[-1], np.float16))
    problems = store.validate(root, checksums=False).problems
    assert "shard-00000.zarr/offsets: not strictly increasing from 0 to %d" % off[-1] in problems
    assert any("shard-00000.zarr/logsumexp: dtype float16" in p for p in problems), problems


def test_temporary_and_unlisted_shards_are_never_read(synthetic, tmp_path):
    root = corrupt_copy(synthetic[0], tmp_path / "store")
    make_store(tmp_path / "other", shards=5, prefix="x")
    shutil.copytree(tmp_path / "other" / store.shard_name(4), root / store.shard_name(4))
    shutil.copytree(tmp_path / "other" / store.shard_name(3), root / f".{store.shard_name(3)}.tmp-1-abc")
    report = store.validate(root)
    assert report.ok and len(report.warnings) == 2
    ids = FeatureDataset(root, split="all").sample_ids
    assert sorted(ids) == sorted(synthetic[1]) and not any(s.startswith("x") for s in ids)


def test_store_without_manifest_is_incomplete(tmp_path):
    make_store(tmp_path, shards=1)
    (tmp_path / store.MANIFEST_FILE).unlink()
    with pytest.raises(StoreError, match="incomplete"):
        FeatureDataset(tmp_path)
    assert not store.validate(tmp_path).ok


def test_validate_catches_a_sample_stored_twice(tmp_path):
    root = tmp_path / "a"
    make_store(root, shards=2)  # then shard 1 becomes a copy of shard 0
    records = store.read_manifest(root)["shards"]
    shutil.rmtree(root / store.shard_name(1))
    shutil.copytree(root / store.shard_name(0), root / store.shard_name(1))
    manifest = store.make_manifest(header={"target_id": "t@1", "d": D, "k": K, "hidden_codec": "fp16"},
                                   shards=[records[0], {**records[0], "index": 1, "name": store.shard_name(1)}])
    store.write_manifest(root, manifest)
    problems = store.validate(root).problems
    assert any("also stored in shard-00000.zarr" in p for p in problems), problems


# --- auxiliary hidden states (EAGLE-3 features) ----------------------------------------------------


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_aux_hidden_round_trip(tmp_path, codec):
    """aux_hidden [N, L*d] goes through the writer, the manifest, validate and the reader (asked for those layers) in the
    hidden codec; int8 keeps one scale per token and layer."""
    truth = make_store(tmp_path, shards=2, codec=codec, aux=(1, 3, 5))
    manifest = store.read_manifest(tmp_path)
    assert manifest["aux_layers"] == [1, 3, 5] and manifest["dtypes"]["aux_hidden"] == manifest["dtypes"]["hidden"]
    assert manifest["totals"]["bytes_per_token_reference"] == 2 * D * 4 + 6 * K + 5
    assert store.validate(tmp_path).ok
    assert FeatureDataset(tmp_path, split="all").load([0]).aux_hidden is None  # not asked for
    ds = FeatureDataset(tmp_path, ReaderConfig(max_tokens=64), split="all", aux_layers=[1, 3, 5])
    assert ds.aux_layers == [1, 3, 5]
    for sid, batch, row in rows_of(ds):
        want = truth[sid]["aux_hidden"]  # (n, 3d)
        n = want.shape[0]
        got = batch.to("cpu").aux_hidden
        assert got.shape[-1] == 3 * D and (got[row, n:] == 0).all()
        per_layer = want.reshape(n, 3, D).abs().amax(-1, keepdim=True).expand(n, 3, D).reshape(n, 3 * D)  # (n, 3d)
        bound = {"fp16": 1e-3, "bf16": 8e-3, "int8": 1 / 254 + 1e-6}[codec] * per_layer
        assert ((got[row, :n] - want).abs() <= bound).all(), codec
    if codec == "int8":
        group = __import__("zarr").open_group(str(tmp_path / store.shard_name(0)), mode="r", zarr_format=3)
        assert group["aux_hidden_scale"].shape == (group["hidden"].shape[0], 3)
    chunk = chunk_files(tmp_path / store.shard_name(1), "aux_hidden")[0]
    chunk.write_bytes(chunk.read_bytes()[:5])
    assert any(p.startswith("shard-00001.zarr/aux_hidden") for p in store.validate(tmp_path).problems)


def test_reader_asking_for_aux_from_a_store_without_is_a_clear_error(synthetic, tmp_path):
    with pytest.raises(StoreError, match="has no aux_hidden .dumped without aux_layers.: dump it again with aux_layers="):
        FeatureDataset(synthetic[0], aux_layers=[0, 1])
    make_store(tmp_path / "a", shards=1, aux=(0, 1))
    make_store(tmp_path / "b", shards=1, aux=(0, 2), prefix="b")
    with pytest.raises(StoreError, match="different aux layers"):
        FeatureDataset([tmp_path / "a", tmp_path / "b"], aux_layers=[0, 1])
    # a store holding other layers than the run reads (the run plan's) is refused, naming both and the fix
    with pytest.raises(StoreError, match=r"holds the states of aux layers \[0, 1\], but the run reads layers \[0, 2\]"):
        FeatureDataset(tmp_path / "a", aux_layers=[0, 2])


# --- fast reader: grouped reads, lazy decode, prefetch ----------------------------------------------


def reference_load(ds: FeatureDataset, seqs: list[int]):
    """The reader as it was before grouped reads: one read per sequence and array, decoded to float32,
    padded by ``pad_batch`` — the oracle the fast reader must reproduce bit for bit."""
    from specdraft.batch import pad_batch

    samples = []
    for i in seqs:
        key = int(ds._key[i])
        arrays, codec = ds._arrays(key), ds._shards[key][1]
        a, b = int(ds._start[i]), int(ds._start[i] + ds._length[i])
        scale = arrays["hidden_scale"][a:b] if codec == "int8" else None
        lse = torch.from_numpy(arrays["logsumexp"][a:b])
        topk_logits = torch.from_numpy(arrays["topk_logits"][a:b]).float()
        sample = {
            "input_ids": torch.from_numpy(arrays["input_ids"][a:b].astype(np.int64)),
            "hidden": store.decode_hidden(arrays["hidden"][a:b], codec, scale),
            "loss_mask": torch.from_numpy(arrays["loss_mask"][a:b].astype(bool)),
            "topk_ids": torch.from_numpy(arrays["topk_ids"][a:b].astype(np.int64)),
            "topk_logp": topk_logits - lse[:, None],
        }
        if ds.aux_layers:
            aux_scale = arrays["aux_hidden_scale"][a:b] if codec == "int8" else None
            sample["aux_hidden"] = store.decode_hidden(arrays["aux_hidden"][a:b], codec, aux_scale)
        samples.append(sample)
    return pad_batch(samples)


def assert_same_batch(x, y):
    for name in ("input_ids", "hidden", "loss_mask", "valid", "topk_ids", "topk_logp", "aux_hidden"):
        a, b = getattr(x, name), getattr(y, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_fast_reader_gives_the_old_readers_batches(tmp_path, codec):
    """Grouped reads + lazy decode == one read per sequence decoded on the host, for every batch of two
    epochs (same plan, same order), truncation, a second store, and a resumed epoch."""
    make_store(tmp_path / "a", shards=3, per_shard=9, codec=codec, aux=(0, 2))
    make_store(tmp_path / "b", shards=1, per_shard=5, codec=codec, aux=(0, 2), prefix="b", seed=3)
    for cfg, aux in ((ReaderConfig(max_tokens=96, seed=2), (0, 2)), (ReaderConfig(max_tokens=40, max_length=9, seed=5), ())):
        ds = FeatureDataset([tmp_path / "a", tmp_path / "b"], cfg, split="all", aux_layers=aux)
        for epoch in (0, 1):
            plan = ds.batches(epoch)
            ds.set_epoch(epoch)
            stored = list(ds)
            assert len(stored) == len(plan) > 3
            for seqs, lazy in zip(plan, stored):
                want = reference_load(ds, seqs)
                assert_same_batch(lazy.to("cpu"), want)
                assert_same_batch(ds.load(seqs), want)
                if codec == "int8":
                    assert lazy.hidden.dtype == torch.int8 and lazy.hidden_scale is not None
            sequence = ds.epoch_batches(epoch)
            for index in range(2, len(sequence)):  # a trainer resuming at batch 2
                assert_same_batch(sequence[index].to("cpu"), reference_load(ds, plan[index]))


def test_mixed_codecs_in_one_batch_are_decoded_by_the_reader(tmp_path):
    make_store(tmp_path / "a", shards=1, per_shard=6)
    make_store(tmp_path / "b", shards=1, per_shard=6, codec="int8", prefix="b", seed=2)
    ds = FeatureDataset([tmp_path / "a", tmp_path / "b"], ReaderConfig(max_tokens=10**6), split="all")
    [seqs] = ds.batches(0)
    lazy = ds.load(seqs, lazy=True)
    assert lazy.hidden.dtype == torch.float32 and lazy.hidden_scale is None
    assert_same_batch(lazy.to("cpu"), reference_load(ds, seqs))


def test_grouped_reads_read_each_run_once(synthetic, monkeypatch):
    """A batch holding every sequence of a shard costs one read per array of that shard, and each of its
    chunks is read (and checked) once."""
    from specdraft.store import reader

    root, _ = synthetic
    ds = FeatureDataset(root, ReaderConfig(max_tokens=10**6, shuffle=False), split="all")
    [seqs] = ds.batches(0)
    reads, chunks = [], []
    read_checked_rows, read_chunk = reader.read_checked_rows, reader.ShardArray.read_chunk

    shard = {id(source) for source in ds._sources(0).values()}  # shard 0's arrays

    def counting_rows(source, *args, **kwargs):
        if id(source) in shard:
            reads.append(source.array.basename)
        return read_checked_rows(source, *args, **kwargs)

    def counting_chunk(self, c):
        if id(self) in shard:
            chunks.append((self.array.basename, c))
        return read_chunk(self, c)

    monkeypatch.setattr(reader, "read_checked_rows", counting_rows)
    monkeypatch.setattr(reader.ShardArray, "read_chunk", counting_chunk)
    ds.load(seqs)
    assert sorted(reads) == sorted(["input_ids", "loss_mask", "hidden", "topk_ids", "topk_logits", "logsumexp"])
    assert chunks and len(chunks) == len(set(chunks)), chunks


def test_prefetcher_propagates_errors_and_stops():
    import threading

    from specdraft.store.prefetcher import Prefetcher

    def load(i):
        if i == 3:
            raise KeyError("boom at 3")
        return i

    class Item(int):
        def pin_memory(self):
            return self

    got = []
    with pytest.raises(KeyError, match="boom at 3"):
        with Prefetcher(lambda i: Item(load(i)), list(range(6)), depth=2) as batches:
            for b in batches:
                got.append(int(b))
    assert got == [0, 1, 2]
    before = threading.active_count()
    p = Prefetcher(lambda i: Item(i), list(range(100)), depth=2)
    assert [int(next(p)) for _ in range(3)] == [0, 1, 2]
    p.close()  # consumer stops early: the producer, blocked on a full queue, is joined
    assert not p._thread.is_alive() and threading.active_count() <= before
    assert [int(x) for x in Prefetcher(lambda i: Item(i), [5, 6], depth=0)] == [5, 6]
    assert list(Prefetcher(lambda i: Item(i), [], depth=2)) == []
