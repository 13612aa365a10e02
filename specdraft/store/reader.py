"""The training reader: ``FeatureDataset`` yields ``batch.Batch`` objects from one or more stores.

Length-bucketed, right-padded, deterministic for (seed, epoch), split into equal batch counts per
DDP rank, with a held-out split by sample-id hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import torch

from specdraft.batch import Batch, pad_batch
from specdraft.store import location
from specdraft.store.manifest import read_manifest
from specdraft.store.schema import StoreError, decode_hidden


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReaderConfig:
    max_tokens: int = 16384  # padded tokens per batch (B * T); a longer sequence gets a batch of its own
    max_length: int | None = None  # sequences are truncated to this many tokens
    max_batch_size: int | None = None
    val_fraction: float = 0.0  # fraction of sample ids held out (by hash) for validation
    seed: int = 0
    shuffle: bool = True  # False: batches in length order, same every epoch
    bucket_size: int = 1024  # sequences sorted by length within windows of this many
    aux: bool = False  # fill Batch.aux_hidden (B, T, L*d) from the stores' auxiliary layers (EAGLE-3 features)

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1 and self.bucket_size >= 1, "max_tokens and bucket_size must be >= 1"
        assert self.max_length is None or self.max_length >= 1, "max_length must be >= 1"
        assert 0.0 <= self.val_fraction < 1.0, f"val_fraction {self.val_fraction} not in [0, 1)"


def is_held_out(sample_id: str, fraction: float) -> bool:
    """Whether ``sample_id`` belongs to the validation split (stable across stores and runs)."""
    h = int(hashlib.sha256(str(sample_id).encode()).hexdigest()[:15], 16)
    return h / 16**15 < fraction


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


def check_aux_layers(stores: list[tuple[Path, dict[str, Any]]]) -> list[int]:
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


class FeatureDataset(torch.utils.data.IterableDataset):
    """Batches of stored features for one (rank, world_size) partition and one split.

    Iterate it directly or through ``DataLoader(ds, batch_size=None, num_workers=n,
    multiprocessing_context="spawn")`` (workers take every n-th batch of this rank; use spawn:
    zarr's IO thread does not survive a fork). Call ``set_epoch`` before each epoch; the plan depends
    only on (seed, epoch, split, world_size), so every rank computes the same global plan and
    takes batches ``rank::world_size`` — equal counts on every rank.
    """

    def __init__(
        self,
        paths: str | Path | list[str | Path],
        cfg: ReaderConfig = ReaderConfig(),
        *,
        split: Literal["train", "val", "all"] = "train",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        assert split in ("train", "val", "all"), f"split {split!r} not in train/val/all"
        assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
        self.cfg, self.split, self.rank, self.world_size = cfg, split, rank, world_size
        self.epoch = 0
        self.stores = open_stores(paths)
        self.d, self.k = self.stores[0][1]["d"], self.stores[0][1]["k"]
        self.aux_layers: list[int] = list(self.stores[0][1].get("aux_layers") or []) if cfg.aux else []
        if cfg.aux:
            check_aux_layers(self.stores)
        self._shards: list[tuple[Path | str, str]] = []  # (shard dir or URL, hidden codec)
        keys, starts, lengths, ids = [], [], [], []
        for path, manifest in self.stores:
            for record in manifest["shards"]:
                group = location.open_group(location.join(path, record["name"]), "r")
                offsets = group["offsets"][...]  # (S+1,)
                names = [str(s) for s in group["sample_ids"][...].tolist()]
                if offsets.shape != (record["num_sequences"] + 1,) or len(names) != record["num_sequences"]:
                    raise StoreError(f"{location.join(path, record['name'])}: offsets/sample_ids disagree with the manifest")
                keys += [len(self._shards)] * len(names)
                starts.append(offsets[:-1])
                lengths.append(np.diff(offsets))
                ids += names
                self._shards.append((location.join(path, record["name"]), manifest["hidden_codec"]))
        keep = np.array([split == "all" or (is_held_out(s, cfg.val_fraction) == (split == "val")) for s in ids], bool)
        self._key = np.asarray(keys, np.int64)[keep]  # (S,)
        self._start = np.concatenate(starts or [np.zeros(0, np.int64)])[keep]  # (S,)
        length = np.concatenate(lengths or [np.zeros(0, np.int64)])[keep]  # (S,)
        self._length = length if cfg.max_length is None else np.minimum(length, cfg.max_length)  # (S,)
        self.sample_ids = [s for s, k in zip(ids, keep) if k]
        self._open: dict[int, dict[str, Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = {}  # zarr handles are reopened in each worker
        return state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches (sequence indices) of the split for ``epoch``, balanced for world_size."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, self.epoch if epoch is None else epoch])
        n = len(self._length)
        order = rng.permutation(n) if cfg.shuffle else np.arange(n)
        window = cfg.bucket_size if cfg.shuffle else max(n, 1)
        batches: list[list[int]] = []
        for lo in range(0, n, window):
            part = order[lo : lo + window]
            part = part[np.argsort(self._length[part], kind="stable")]
            current, longest = [], 0
            for i in part.tolist():
                wider = max(longest, int(self._length[i]))
                full = cfg.max_batch_size is not None and len(current) >= cfg.max_batch_size
                if current and (wider * (len(current) + 1) > cfg.max_tokens or full):
                    batches.append(current)
                    current, wider = [], int(self._length[i])
                current.append(i)
                longest = wider
            if current:
                batches.append(current)
        if cfg.shuffle:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return balance_batches(batches, self.world_size)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches for ``epoch``."""
        return self.global_batches(epoch)[self.rank :: self.world_size]

    def __len__(self) -> int:
        return len(self.batches())

    def __iter__(self) -> Iterator[Batch]:
        mine = self.batches()
        info = torch.utils.data.get_worker_info()
        if info is not None:
            mine = mine[info.id :: info.num_workers]
        for seqs in mine:
            yield self.load(seqs)

    def load(self, seqs: list[int]) -> Batch:
        """Read sequences (indices into this split) into a right-padded ``Batch``."""
        samples = []
        for i in seqs:
            key = int(self._key[i])
            arrays, codec = self._arrays(key), self._shards[key][1]
            a, b = int(self._start[i]), int(self._start[i] + self._length[i])
            scale = arrays["hidden_scale"][a:b] if codec == "int8" else None  # (L,)
            lse = torch.from_numpy(arrays["logsumexp"][a:b])  # (L,)
            topk_logits = torch.from_numpy(arrays["topk_logits"][a:b]).float()  # (L, K)
            samples.append({
                "input_ids": torch.from_numpy(arrays["input_ids"][a:b].astype(np.int64)),  # (L,)
                "hidden": decode_hidden(arrays["hidden"][a:b], codec, scale),  # (L, d)
                "loss_mask": torch.from_numpy(arrays["loss_mask"][a:b].astype(bool)),  # (L,)
                "topk_ids": torch.from_numpy(arrays["topk_ids"][a:b].astype(np.int64)),  # (L, K)
                "topk_logp": topk_logits - lse[:, None],  # (L, K)
            })
            if self.aux_layers:
                aux_scale = arrays["aux_hidden_scale"][a:b] if codec == "int8" else None  # (L, A)
                samples[-1]["aux_hidden"] = decode_hidden(arrays["aux_hidden"][a:b], codec, aux_scale)  # (L, A*d)
        return pad_batch(samples)

    def _arrays(self, key: int) -> dict[str, Any]:
        """Zarr arrays of shard ``key``, opened once per process."""
        if key not in self._open:
            group = location.open_group(self._shards[key][0], "r")
            self._open[key] = {name: array for name, array in group.arrays()}
        return self._open[key]


def predicted_token_counts(paths: str | Path | list[str | Path], vocab_size: int) -> np.ndarray:
    """How often each target token follows a loss-masked position in the stores (the draft-vocabulary
    statistics, ``specdraft.vocab``); reads only ``input_ids``, ``loss_mask`` and ``offsets``."""
    from specdraft.vocab import count_predicted_tokens

    counts = np.zeros(vocab_size, dtype=np.int64)
    for path, manifest in open_stores(paths):
        for record in manifest["shards"]:
            group = location.open_group(location.join(path, record["name"]), "r")
            counts += count_predicted_tokens(group["input_ids"][...], group["loss_mask"][...], group["offsets"][...],
                                             vocab_size)
    return counts
