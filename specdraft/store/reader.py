"""The training reader: ``FeatureDataset`` yields ``batch.Batch`` objects from one or more stores.

Length-bucketed, right-padded, deterministic for (seed, epoch), split into equal batch counts per
DDP rank, with a held-out split by sample-id hash. Fast path: a batch's sequences are
read shard by shard with one read per array and run of nearby rows (locally chunk by chunk through Zarr's
synchronous store and codec interfaces, ``ShardArray``; at a URL one Zarr read), sliced in numpy; the
features stay in their stored dtype (float16 / bfloat16 / int8 codes + scales) until
``Batch.to(device)`` decodes them on the device; a ``Prefetcher`` thread (``store/prefetcher.py``) reads
the next batches (pinned when CUDA is available) while the trainer computes (``EpochBatches``,
iteration). The split and the batch plan are ``store/batching.py``'s.

Integrity (docs/guarantees.md): every chunk read is checked — against its crc32c (the writer's
``crc32c`` codec, verified by Zarr's codec on decode) and for presence (a shard written with checksums
stores every chunk but those its record lists as fill-valued; Zarr would return a lost one as fill
values) — and a bad chunk is a one-line
``StoreError`` naming the store, shard, array and chunk; under ``ReaderConfig.on_corrupt="skip"`` the
sequences it holds are skipped instead (their loss masked out) and counted in ``FeatureDataset.skipped``.
Stores written before the checksums are read unverified, with one warning per store.

Each sequence is read once, however the stores arrive: one whose token ids equal a sequence read before it (a store
given twice, a shard copied under another name or into another store) is left out, counted in
``FeatureDataset.duplicates`` and printed as ``duplicate_sequence: N`` (``batching.token_digests``: the stores'
``input_ids`` are read when the reader opens, 4 bytes per token).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Collection, Iterator, Literal, Sequence

import numpy as np
import torch

from specdraft.batch import Batch
from specdraft.configs.reader import ReaderConfig
from specdraft.store import location
from specdraft.store.batching import is_held_out, plan_batches, repeats, token_digests
from specdraft.store.chunks import ShardArray, read_checked_rows, shard_chunks
from specdraft.store.manifest import read_manifest
from specdraft.store.prefetcher import Prefetcher
from specdraft.store.schema import CHUNK_CHECKSUM, StoreError, array_schema, decode_hidden, stored_tensor

_UNVERIFIED_WARNED: set[str] = set()  # stores already warned about (once per store and process)




def open_stores(paths: str | Path | list[str | Path]) -> list[tuple[Path | str, dict[str, Any]]]:
    """(dir or URL, manifest) per store; StoreError unless all share the target, d and K."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    assert paths, "no store given"
    stores = [(location.as_location(p), read_manifest(p)) for p in paths]
    first_dir, first = stores[0]
    for path, manifest in stores[1:]:
        for key in ("target_id", "d", "k"):
            if manifest[key] != first[key]:
                raise StoreError(f"stores disagree on {key}: {first_dir} has {first[key]!r}, {path} has {manifest[key]!r}")
    for path, manifest in stores:
        missing = [r["name"] for r in manifest["shards"] if not location.is_dir(location.join(path, r["name"]))]
        if missing:
            raise StoreError(f"{path}: shards listed in the manifest are missing: {missing[:5]}")
    return stores


def common_aux_layers(stores: list[tuple[Path, dict[str, Any]]]) -> list[int]:
    """The auxiliary layers every store holds; StoreError when one has none or they differ."""
    layers = {str(path): list(m.get("aux_layers") or []) for path, m in stores}
    bare = [path for path, lay in layers.items() if not lay]
    if bare:
        raise StoreError(
            f"the reader was asked for auxiliary hidden states (EAGLE-3 features), but store {bare[0]} has no "
            "aux_hidden (dumped without aux_layers): dump it again with aux_layers=eagle3 (or a list of layers)"
        )
    if len({tuple(lay) for lay in layers.values()}) > 1:
        raise StoreError(f"stores hold different aux layers: {layers}")
    return next(iter(layers.values()))


class FeatureDataset(torch.utils.data.IterableDataset):
    """Batches of stored features for one (rank, world_size) partition and one split.

    Iterate it directly, take an epoch as a sequence (``epoch_batches``, the trainer's way), or go
    through ``DataLoader(ds, batch_size=None, num_workers=n, multiprocessing_context="spawn")``
    (workers take every n-th batch of this rank; use spawn: zarr's IO thread does not survive a
    fork). All three hand out batches in stored form, read ahead; ``load`` decodes unless ``lazy``.
    Call ``set_epoch`` before each epoch; the plan depends only on (seed, epoch, split, world_size),
    so every rank computes the same global plan and takes batches ``rank::world_size`` — equal
    counts on every rank.
    """

    def __init__(
        self,
        paths: str | Path | list[str | Path],
        cfg: ReaderConfig = ReaderConfig(),
        *,
        split: Literal["train", "val", "all"] = "train",
        rank: int = 0,
        world_size: int = 1,
        aux_layers: Sequence[int] = (),
        samples: Collection[str] | None = None,
    ) -> None:
        assert split in ("train", "val", "all"), f"split {split!r} not in train/val/all"
        assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
        self.cfg, self.split, self.rank, self.world_size = cfg, split, rank, world_size
        self.epoch = 0
        self.stores = open_stores(paths)
        self.d, self.k = self.stores[0][1]["d"], self.stores[0][1]["k"]
        # the auxiliary layers whose states the batches carry (the run plan's): every store must hold exactly these
        self.aux_layers: list[int] = [int(i) for i in aux_layers]
        if self.aux_layers and (held := common_aux_layers(self.stores)) != self.aux_layers:
            raise StoreError(f"store {self.stores[0][0]} holds the states of aux layers {held}, but the run reads "
                             f"layers {self.aux_layers}: dump it with aux_layers={self.aux_layers}")
        self._shards: list[tuple[Path | str, str]] = []  # (shard dir or URL, hidden codec)
        self._where: list[tuple[Path | str, str]] = []  # per shard: (store, shard name), for errors
        self._missing_at_open: list[dict[str, set[int]]] = []  # per shard: array -> lost chunks, as listed here
        self._verified: list[bool] = []  # per shard: written with per-chunk checksums (an unlisted absent chunk is lost)
        self._fill: list[dict[str, frozenset[int]]] = []  # per shard: array -> fill-valued chunks left unstored
        self.skipped: dict[str, str] = {}  # on_corrupt="skip": sample id -> the bad chunk it was skipped for
        keys, starts, lengths, ids, digests = [], [], [], [], []
        for path, manifest in self.stores:
            unverified = [r["name"] for r in manifest["shards"] if r.get("chunk_checksum") != CHUNK_CHECKSUM]
            if unverified and str(path) not in _UNVERIFIED_WARNED:
                _UNVERIFIED_WARNED.add(str(path))
                warnings.warn(f"store {path}: {len(unverified)} of {len(manifest['shards'])} shards were written without "
                              "per-chunk checksums (before they were recorded): their chunks are read unverified and a "
                              f"lost chunk reads as zeros; `specdraft validate-store {path}` compares their sha256",
                              StoreWarning, stacklevel=2)
            for record in manifest["shards"]:
                shard = location.join(path, record["name"])
                group = location.open_group(shard, "r")
                verified, missing, fill = shard_chunks(shard, group, record)
                self._missing_at_open.append(missing)
                offsets, _ = read_checked_rows(ShardArray.open(group["offsets"], verified, fill.get("offsets")), 0, None, path,
                                       record["name"], missing.get("offsets"))  # (S+1,)
                names, _ = read_checked_rows(ShardArray.open(group["sample_ids"], verified, fill.get("sample_ids")), 0, None,
                                     path, record["name"], missing.get("sample_ids"))
                names = [str(s) for s in names.tolist()]
                if offsets.shape != (record["num_sequences"] + 1,) or len(names) != record["num_sequences"]:
                    raise StoreError(f"{location.join(path, record['name'])}: offsets/sample_ids disagree with the manifest")
                tokens, unread = read_checked_rows(ShardArray.open(group["input_ids"], verified, fill.get("input_ids")), 0,
                                           None, path, record["name"], missing.get("input_ids"),
                                           cfg.on_corrupt == "skip")  # (N,)
                digests.append(token_digests(tokens, offsets, unread))
                keys += [len(self._shards)] * len(names)
                starts.append(offsets[:-1])
                lengths.append(np.diff(offsets))
                ids += names
                self._shards.append((shard, manifest["hidden_codec"]))
                self._verified.append(verified)
                self._fill.append(fill)
                self._where.append((path, record["name"]))
        keep = np.array([split == "all" or (is_held_out(s, cfg.val_fraction) == (split == "val")) for s in ids], bool)
        if samples is not None:  # only these sample ids of the split (benchmarks/data_scaling.py's nested prefixes)
            wanted = set(samples)
            keep &= np.array([s in wanted for s in ids], bool)
        # a sequence read before (the same token ids: a store given twice, a copied shard) trains once: the first
        # copy read stays (in whichever split its sample id puts it), every later one is left out, counted
        twice = keep & repeats(np.concatenate(digests or [np.zeros(0, "S16")]))  # (S_all,)
        self.duplicates = [s for s, k in zip(ids, twice) if k]  # the sample ids left out for it
        if self.duplicates and rank == 0:
            print(f"[specdraft] reader: duplicate_sequence: {len(self.duplicates)} sequence(s) left out of the {split} "
                  f"split (the same token ids as one read before: a store given twice, or a shard copied), e.g. "
                  f"{self.duplicates[0]!r}", flush=True)
        keep &= ~twice
        length = np.concatenate(lengths or [np.zeros(0, np.int64)])  # (S_all,)
        # a one-token sequence predicts nothing (its only position has no next token) and, alone in a batch, leaves
        # the drafts no slot to attend to: the train and val splits leave it out, counted; "all" reads what is stored
        short = keep & (length < 2) if split != "all" else np.zeros_like(keep)  # (S_all,)
        self.too_short = [s for s, k in zip(ids, short) if k]  # the sample ids left out for it
        if self.too_short and rank == 0:
            print(f"[specdraft] reader: {len(self.too_short)} sequence(s) of one token left out of the {split} split "
                  f"(nothing to predict), e.g. {self.too_short[0]!r}", flush=True)
        keep &= ~short
        self._key = np.asarray(keys, np.int64)[keep]  # (S,)
        self._start = np.concatenate(starts or [np.zeros(0, np.int64)])[keep]  # (S,)
        length = length[keep]  # (S,)
        self._length = length if cfg.max_length is None else np.minimum(length, cfg.max_length)  # (S,)
        self.sample_ids = [s for s, k in zip(ids, keep) if k]
        self._open: dict[int, dict[str, ShardArray]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = {}  # zarr handles are reopened in each worker
        return state

    @property
    def lengths(self) -> np.ndarray:
        """(S,) tokens of each sequence of the split as read (``max_length`` applied), in ``sample_ids``' order."""
        return self._length

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches (sequence indices) of the split for ``epoch``, balanced for world_size."""
        return plan_batches(self._length, self.cfg, self.epoch if epoch is None else epoch, self.world_size)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches for ``epoch``."""
        return self.global_batches(epoch)[self.rank :: self.world_size]

    def __len__(self) -> int:
        return len(self.batches())

    def __iter__(self) -> Iterator[Batch]:
        """This rank's batches for the current epoch in stored form (``Batch.to`` decodes them), read
        ``cfg.prefetch`` batches ahead on a background thread; under a DataLoader, this worker's share."""
        mine = self.batches()
        info = torch.utils.data.get_worker_info()
        if info is not None:
            mine = mine[info.id :: info.num_workers]
        with Prefetcher(lambda seqs: self.load(seqs, lazy=True), mine, self.cfg.prefetch) as batches:
            yield from batches

    def epoch_batches(self, epoch: int) -> "EpochBatches":
        """This rank's batches of ``epoch`` as a lazy sequence read ahead in the background."""
        return EpochBatches(self, epoch)

    def load(self, seqs: list[int], lazy: bool = False) -> Batch:
        """Read sequences (indices into this split) into a right-padded ``Batch``.

        ``lazy``: the features stay in their stored form (float16 / bfloat16 / int8 codes and scales; a
        batch mixing stores of different codecs is decoded) until ``Batch.to(device)`` decodes them on
        the device; otherwise they are decoded here to float32.

        Sequences are read shard by shard, each run of nearby rows with one read per array (rows
        closer than a chunk are read through: the chunk is decompressed anyway), then sliced in numpy.
        """
        assert len(seqs) > 0, "cannot load an empty batch"
        seqs = [int(i) for i in seqs]
        lengths = self._length[seqs]  # (B,)
        n, t, d, k = len(seqs), int(lengths.max()), self.d, self.k
        codecs = {self._shards[int(self._key[i])][1] for i in seqs}
        codec = codecs.pop() if len(codecs) == 1 else None  # None: mixed codecs, decoded to float32
        feature_dtype = np.float32 if codec is None else np.dtype(array_schema(d, k, codec)["hidden"][0])
        aux_width = d * len(self.aux_layers)
        out = {
            "input_ids": np.zeros((n, t), np.int64),
            "loss_mask": np.zeros((n, t), bool),
            "valid": np.arange(t)[None, :] < lengths[:, None],  # (B, T)
            "hidden": np.zeros((n, t, d), feature_dtype),
            "topk_ids": np.zeros((n, t, k), np.int64),
            "topk_logp": np.full((n, t, k), -1e4, np.float32),
        }
        if codec == "int8":
            out["hidden_scale"] = np.zeros((n, t), np.float32)
        if aux_width:
            out["aux_hidden"] = np.zeros((n, t, aux_width), feature_dtype)
            if codec == "int8":
                out["aux_scale"] = np.zeros((n, t, len(self.aux_layers)), np.float32)
        by_shard: dict[int, list[int]] = {}
        for row, i in enumerate(seqs):
            by_shard.setdefault(int(self._key[i]), []).append(row)
        for key, rows in by_shard.items():
            arrays, shard_codec = self._sources(key), self._shards[key][1]
            gap = arrays["hidden"].array.chunks[0]
            spans = sorted((int(self._start[seqs[r]]), int(lengths[r]), r) for r in rows)  # (start, length, row)
            for run in _runs(spans, gap):
                lo, hi = run[0][0], max(a + m for a, m, _ in run)
                bad = self._read_run(key, arrays, shard_codec, codec, lo, hi, [(r, a - lo, m) for a, m, r in run], out)
                for row, chunk in bad:  # on_corrupt="skip": the sequence trains nothing, and is counted
                    out["loss_mask"][row] = False
                    sample = self.sample_ids[seqs[row]]
                    if sample not in self.skipped:
                        self.skipped[sample] = chunk
                        print(f"[specdraft] reader: skipped sequence {sample!r} ({chunk}; reader.on_corrupt=skip); "
                              f"{len(self.skipped)} skipped so far", flush=True)
        batch = Batch(
            input_ids=torch.from_numpy(out["input_ids"]),
            hidden=_features(out["hidden"], codec),
            loss_mask=torch.from_numpy(out["loss_mask"]),
            valid=torch.from_numpy(np.ascontiguousarray(out["valid"])),
            topk_ids=torch.from_numpy(out["topk_ids"]),
            topk_logp=torch.from_numpy(out["topk_logp"]),
            aux_hidden=_features(out["aux_hidden"], codec) if aux_width else None,
            hidden_scale=torch.from_numpy(out["hidden_scale"]) if "hidden_scale" in out else None,
            aux_scale=torch.from_numpy(out["aux_scale"]) if "aux_scale" in out else None,
        )
        return batch if lazy else batch.to("cpu")

    def _read_run(self, key: int, arrays: dict[str, ShardArray], shard_codec: str, codec: str | None, lo: int, hi: int,
                  spans: list[tuple[int, int, int]], out: dict[str, np.ndarray]) -> list[tuple[int, str]]:
        """Read rows [lo, hi) of shard ``key`` once per array and copy ``spans`` (batch row, offset, length) out.

        Returns (batch row, bad chunk) for each span that overlaps a bad chunk (only under
        ``on_corrupt="skip"``; otherwise a bad chunk raises ``StoreError``)."""
        missing = self._missing_at_open[key]
        (store, shard_name), skip = self._where[key], self.cfg.on_corrupt == "skip"
        bad: list[tuple[int, int, str]] = []  # (first row, end row, chunk) of the bad chunks read

        def rows(name: str) -> np.ndarray:
            values, lost = read_checked_rows(arrays[name], lo, hi, store, shard_name, missing.get(name), skip)
            bad.extend(lost)
            return values

        ids = rows("input_ids")  # (R,)
        mask = rows("loss_mask")  # (R,)
        topk_ids = rows("topk_ids")  # (R, K)
        topk_logp = rows("topk_logits").astype(np.float32) - rows("logsumexp")[:, None]  # (R, K)
        features = [("hidden", "hidden_scale", "hidden_scale")]
        if "aux_hidden" in out:
            features.append(("aux_hidden", "aux_hidden_scale", "aux_scale"))
        stored = {}
        for name, scale_name, out_scale in features:
            values = rows(name)  # (R, F)
            scale = rows(scale_name) if shard_codec == "int8" else None  # (R,) | (R, L)
            if codec is None:  # mixed codecs in one batch: decode here
                values, scale = decode_hidden(np.array(values), shard_codec, scale).numpy(), None  # a writable copy
            stored[name] = (values, scale, out_scale)
        for row, a, m in spans:
            out["input_ids"][row, :m] = ids[a : a + m]
            out["loss_mask"][row, :m] = mask[a : a + m]
            out["topk_ids"][row, :m] = topk_ids[a : a + m]
            out["topk_logp"][row, :m] = topk_logp[a : a + m]
            for name, (values, scale, out_scale) in stored.items():
                out[name][row, :m] = values[a : a + m]
                if scale is not None:
                    out[out_scale][row, :m] = scale[a : a + m]
        return [(row, chunk) for row, a, m in spans for first, end, chunk in bad if first < lo + a + m and lo + a < end]

    def _sources(self, key: int) -> dict[str, ShardArray]:
        """The arrays of shard ``key`` as the reader reads them, opened once per process."""
        if key not in self._open:
            group = location.open_group(self._shards[key][0], "r")
            self._open[key] = {name: ShardArray.open(array, self._verified[key], self._fill[key].get(name))
                               for name, array in group.arrays()}
        return self._open[key]

    def _arrays(self, key: int) -> dict[str, Any]:
        """Zarr arrays of shard ``key``."""
        return {name: source.array for name, source in self._sources(key).items()}


class StoreWarning(UserWarning):
    """A store the reader cannot fully verify (written before per-chunk checksums)."""


def _runs(spans: list[tuple[int, int, int]], gap: int) -> list[list[tuple[int, int, int]]]:
    """Group (start, length, row) spans sorted by start into runs whose holes are shorter than ``gap`` rows."""
    runs: list[list[tuple[int, int, int]]] = []
    end = 0
    for a, m, r in spans:
        if runs and a - end < gap:
            runs[-1].append((a, m, r))
            end = max(end, a + m)
        else:
            runs.append([(a, m, r)])
            end = a + m
    return runs


def _features(values: np.ndarray, codec: str | None) -> torch.Tensor:
    """A padded feature buffer as a tensor of its stored dtype (bf16 bits viewed as bfloat16)."""
    return stored_tensor(values, codec) if codec is not None else torch.from_numpy(values)


class EpochBatches:
    """One epoch's batches of one rank as a lazy sequence, in stored form (``Batch.to`` decodes).

    Indexing in order — ``range(start, len)``, as the trainer does, resuming mid-epoch included — is
    served by a ``Prefetcher`` started at the first index asked for; any other index restarts it there.
    """

    def __init__(self, dataset: FeatureDataset, epoch: int) -> None:
        self.dataset, self.plan = dataset, dataset.batches(epoch)
        self._prefetcher: Prefetcher | None = None
        self._next = -1

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> Batch:
        assert 0 <= i < len(self.plan), f"batch {i} outside [0, {len(self.plan)})"
        if self._prefetcher is None or i != self._next:
            self.close()
            self._prefetcher = Prefetcher(lambda seqs: self.dataset.load(seqs, lazy=True), self.plan[i:],
                                          self.dataset.cfg.prefetch)
        self._next = i + 1
        batch = next(self._prefetcher)
        if self._next == len(self.plan):
            self.close()
        return batch

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def __del__(self) -> None:
        self.close()


def predicted_token_counts(paths: str | Path | list[str | Path], vocab_size: int,
                           samples: Collection[str] | None = None) -> np.ndarray:
    """How often each target token follows a loss-masked position in the stores (the draft-vocabulary
    statistics, ``specdraft.vocab``); reads only ``input_ids``, ``loss_mask`` and ``offsets`` (and ``sample_ids``
    with ``samples``: only those sequences counted)."""
    from specdraft.vocab import count_predicted_tokens

    wanted = None if samples is None else set(samples)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path, manifest in open_stores(paths):
        for record in manifest["shards"]:
            group = location.open_group(location.join(path, record["name"]), "r")
            shard = location.join(path, record["name"])
            verified, missing, fill = shard_chunks(shard, group, record)
            ids, mask, offsets, *names = (read_checked_rows(ShardArray.open(group[name], verified, fill.get(name)), 0,
                                                            None, path, record["name"], missing.get(name))[0]
                                          for name in ("input_ids", "loss_mask", "offsets",
                                                       *(("sample_ids",) if wanted is not None else ())))
            if wanted is not None:
                kept = np.array([str(s) in wanted for s in names[0].tolist()], bool)  # (S,)
                mask = np.asarray(mask).astype(bool) & np.repeat(kept, np.diff(offsets))  # (N,)
            counts += count_predicted_tokens(ids, mask, offsets, vocab_size)
    return counts
