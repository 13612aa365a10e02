"""The feature store: schema, shard I/O, manifest, validation and the training reader.

Implements DESIGN.md "The target and its features" — the contract between the dump stage
(``pipelines/dump.py``, which produces the arrays) and training (which reads them):

* a store is a directory of Zarr v3 shards ``shard-XXXXX.zarr`` plus ``manifest.json``;
  per shard, all sequences concatenated: ``input_ids`` int32 [N], ``loss_mask`` uint8 [N],
  ``hidden`` [N, d] (codec ``fp16`` float16 | ``bf16`` bfloat16 bits as uint16 | ``int8`` with
  ``hidden_scale`` float32 [N], lossy), ``topk_ids`` int32 [N, K], ``topk_logits`` float16
  [N, K], ``logsumexp`` float32 [N], ``offsets`` int64 [S+1], ``sample_ids`` string [S];
* ``write_shard`` writes one shard into a temporary directory and renames it into place, so a
  ``shard-*.zarr`` name always holds a complete shard (temporaries are never read);
* ``validate`` checks a store against its manifest (counts, shapes, dtypes, offsets, sha256);
* ``FeatureDataset`` yields ``objectives.Batch`` objects: length-bucketed, right-padded,
  deterministic for (seed, epoch), split into equal batch counts per DDP rank, with a held-out
  split by sample-id hash.

Only this module of ``specdraft`` imports zarr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, ZstdCodec

from specdraft.objectives import Batch, pad_batch

SCHEMA_VERSION = 1
FORMAT_NAME = "specdraft-features"
MANIFEST_FILE = "manifest.json"
SHARD_ATTR = "specdraft_shard"
HIDDEN_CODECS = ("fp16", "bf16", "int8")
LOSSY_CODECS = ("int8",)
COMPRESSIONS = ("zstd", "blosc", "none")
TOKEN_ARRAYS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logits", "logsumexp")
SEQUENCE_ARRAYS = ("offsets", "sample_ids")

class StoreError(RuntimeError):
    """A store that is missing, incomplete, corrupt or inconsistent with another."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.zarr"


def shard_index(name: str) -> int | None:
    """Index of a final shard name ``shard-XXXXX.zarr``; None for anything else (temporaries)."""
    if not (name.startswith("shard-") and name.endswith(".zarr")):
        return None
    digits = name[len("shard-") : -len(".zarr")]
    return int(digits) if digits.isdigit() else None


def temp_shard_name(index: int) -> str:
    """A unique hidden name to write shard ``index`` into before the rename."""
    return f".{shard_name(index)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def array_schema(d: int, k: int, codec: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Array name -> (numpy dtype, trailing shape); the leading dim is N tokens or S(+1)."""
    assert codec in HIDDEN_CODECS, f"hidden codec {codec!r} not in {HIDDEN_CODECS}"
    hidden_dtype = {"fp16": "float16", "bf16": "uint16", "int8": "int8"}[codec]
    schema = {
        "input_ids": ("int32", ()),
        "loss_mask": ("uint8", ()),
        "hidden": (hidden_dtype, (d,)),
        "topk_ids": ("int32", (k,)),
        "topk_logits": ("float16", (k,)),
        "logsumexp": ("float32", ()),
        "offsets": ("int64", ()),
        "sample_ids": ("str", ()),
    }
    if codec == "int8":
        schema["hidden_scale"] = ("float32", ())
    return schema


def bytes_per_token_reference(d: int, k: int) -> int:
    """Uncompressed fp16 bytes per token: hidden 2d + topk 4K+2K + ids 4 + mask 1 (+ lse 4)."""
    return 2 * d + 6 * k + 5


# --- hidden-state codecs -----------------------------------------------------------------------


def encode_hidden(hidden: torch.Tensor, codec: str) -> dict[str, np.ndarray]:
    """(N, d) float states -> the stored arrays (``hidden`` and, for int8, ``hidden_scale``)."""
    assert hidden.dim() == 2, f"hidden must be (N, d); got {tuple(hidden.shape)}"
    h = hidden.detach().to("cpu")
    if codec == "fp16":
        return {"hidden": h.to(torch.float16).numpy()}  # (N, d) float16
    if codec == "bf16":
        bits = h.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # (N, d) uint16
        return {"hidden": bits}
    if codec == "int8":
        h = h.float()
        scale = h.abs().amax(dim=-1).clamp(min=1e-12) / 127.0  # (N,)
        q = torch.round(h / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, d)
        return {"hidden": q.numpy(), "hidden_scale": scale.numpy().astype(np.float32)}
    raise ValueError(f"hidden codec {codec!r} not in {HIDDEN_CODECS}")


def decode_hidden(hidden: np.ndarray, codec: str, scale: np.ndarray | None = None) -> torch.Tensor:
    """Stored ``hidden`` (N, d) (+ ``hidden_scale`` (N,) for int8) -> float32 (N, d)."""
    if codec == "fp16":
        return torch.from_numpy(np.ascontiguousarray(hidden)).float()  # (N, d)
    if codec == "bf16":
        bits = torch.from_numpy(np.ascontiguousarray(hidden).view(np.int16))  # (N, d)
        return bits.view(torch.bfloat16).float()  # (N, d)
    if codec == "int8":
        assert scale is not None, "int8 hidden needs its hidden_scale"
        q = torch.from_numpy(np.ascontiguousarray(hidden)).float()  # (N, d)
        return q * torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))[:, None]  # (N, d)
    raise ValueError(f"hidden codec {codec!r} not in {HIDDEN_CODECS}")


# --- checksums, shard writing ------------------------------------------------------------------


def array_digest(values: np.ndarray) -> str:
    """sha256 of an array's little-endian C-order bytes (strings: of their JSON list)."""
    if values.dtype.kind in ("U", "T", "O", "S"):
        blob = json.dumps([str(v) for v in values.tolist()]).encode()
    else:
        blob = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes()
    return hashlib.sha256(blob).hexdigest()


def _compressors(compression: str, level: int):
    if compression == "zstd":
        return ZstdCodec(level=level)
    if compression == "blosc":
        return BloscCodec(cname="zstd", clevel=level, shuffle="shuffle")
    if compression == "none":
        return None
    raise ValueError(f"compression {compression!r} not in {COMPRESSIONS}")


def write_shard(
    store_dir: str | Path,
    index: int,
    arrays: dict[str, np.ndarray],
    attrs: dict[str, Any],
    *,
    chunk_tokens: int = 1024,
    compression: str = "zstd",
    level: int = 3,
) -> dict[str, Any]:
    """Write shard ``index`` of ``store_dir`` (temp dir, then rename); returns its record.

    ``arrays`` holds every array of ``array_schema``; ``attrs`` must carry ``d``, ``k`` and
    ``hidden_codec``. The record (``attrs`` plus counts and per-array sha256) is stored as the
    shard group's ``specdraft_shard`` attribute, written last, and returned for the manifest.
    """
    store_dir = Path(store_dir)
    schema = array_schema(attrs["d"], attrs["k"], attrs["hidden_codec"])
    missing = sorted(set(schema) - set(arrays))
    assert not missing, f"shard {index}: missing arrays {missing}"
    offsets = np.asarray(arrays["offsets"])
    n_tokens, n_seqs = int(arrays["input_ids"].shape[0]), int(arrays["sample_ids"].shape[0])
    assert offsets.shape == (n_seqs + 1,) and offsets[0] == 0 and offsets[-1] == n_tokens, (
        f"shard {index}: offsets {offsets[:3]}..{offsets[-1:]} do not match {n_seqs} sequences / {n_tokens} tokens"
    )
    assert chunk_tokens >= 1, "chunk_tokens must be >= 1"
    final = store_dir / shard_name(index)
    tmp = store_dir / temp_shard_name(index)
    checksums = {}
    try:
        group = zarr.open_group(store=str(tmp), mode="w", zarr_format=3)
        for name, (dtype, tail) in schema.items():
            values = np.asarray(arrays[name])
            if name == "sample_ids":
                values = np.asarray([str(v) for v in values.tolist()], dtype=str)
            else:
                values = np.ascontiguousarray(values, dtype=dtype)
            assert values.shape[1:] == tail, f"shard {index}: {name} has shape {values.shape}, want (*, {tail})"
            rows = chunk_tokens if name in TOKEN_ARRAYS or name == "hidden_scale" else 65536
            chunks = (max(1, min(rows, values.shape[0])), *tail)
            array = group.create_array(
                name,
                shape=values.shape,
                dtype=str if name == "sample_ids" else dtype,
                chunks=chunks,
                compressors=_compressors(compression, level),
            )
            if values.size:
                array[...] = values
            checksums[name] = array_digest(values)
        record = {
            **attrs,
            "index": index,
            "name": final.name,
            "num_sequences": n_seqs,
            "num_tokens": n_tokens,
            "num_loss_tokens": int(np.asarray(arrays["loss_mask"]).sum()),
            "checksums": checksums,
        }
        record["bytes"] = _dir_bytes(tmp)
        group.attrs[SHARD_ATTR] = record  # last write: a shard without it is incomplete
        if final.exists():  # a retried writer finished this shard first: same plan, same bytes
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return record


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_shard_record(path: str | Path) -> dict[str, Any]:
    """The ``specdraft_shard`` record of a shard directory; StoreError when absent/unreadable."""
    try:
        group = zarr.open_group(store=str(path), mode="r", zarr_format=3)
        return dict(group.attrs[SHARD_ATTR])
    except Exception as err:  # noqa: BLE001 - any zarr/JSON failure means the shard is unusable
        raise StoreError(f"{path}: not a complete shard ({type(err).__name__}: {err})") from None


def list_shard_dirs(store_dir: str | Path) -> tuple[dict[int, Path], list[Path]]:
    """(final shards by index, leftover temporary shard directories) in ``store_dir``."""
    store_dir = Path(store_dir)
    finals, temps = {}, []
    if store_dir.is_dir():
        for path in sorted(store_dir.iterdir()):
            idx = shard_index(path.name)
            if idx is not None and path.is_dir():
                finals[idx] = path
            elif path.name.startswith(".shard-") and ".tmp-" in path.name:
                temps.append(path)
    return finals, temps


# --- manifest ------------------------------------------------------------------------------------


def make_manifest(*, header: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Manifest = ``header`` (target, features, d, k, hidden_codec, ...) + shard records + totals."""
    for key in ("target_id", "d", "k", "hidden_codec"):
        assert key in header, f"manifest header needs {key!r}"
    shards = sorted(shards, key=lambda r: r["index"])
    indices = [r["index"] for r in shards]
    assert len(set(indices)) == len(indices), f"duplicate shard records {indices}"
    tokens = sum(r["num_tokens"] for r in shards)
    nbytes = sum(r["bytes"] for r in shards)
    rejected: dict[str, int] = {}
    for r in shards:
        for reason, count in r.get("rejected", {}).items():
            rejected[reason] = rejected.get(reason, 0) + count
    schema = array_schema(header["d"], header["k"], header["hidden_codec"])
    return {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        **header,
        "lossy": header["hidden_codec"] in LOSSY_CODECS,
        "dtypes": {name: dtype for name, (dtype, _) in schema.items()},
        "num_shards": len(shards),
        "shards": shards,
        "totals": {
            "sequences": sum(r["num_sequences"] for r in shards),
            "tokens": tokens,
            "loss_tokens": sum(r["num_loss_tokens"] for r in shards),
            "truncated": sum(r.get("truncated", 0) for r in shards),
            "rejected": rejected,
            "bytes": nbytes,
            "bytes_per_token": nbytes / tokens if tokens else None,
            "bytes_per_token_reference": bytes_per_token_reference(header["d"], header["k"]),
        },
    }


def write_manifest(store_dir: str | Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` atomically (temp file + rename)."""
    path = Path(store_dir) / MANIFEST_FILE
    tmp = path.with_name(f".{MANIFEST_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(store_dir: str | Path) -> dict[str, Any]:
    """The store's manifest; StoreError when missing (dump incomplete) or of another schema."""
    path = Path(store_dir) / MANIFEST_FILE
    if not path.is_file():
        raise StoreError(f"{store_dir}: no {MANIFEST_FILE} — not a store, or its dump is incomplete (rerun to resume)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: unreadable manifest ({err})") from None
    if manifest.get("format") != FORMAT_NAME or manifest.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('schema_version')}, "
            f"this reader understands {FORMAT_NAME!r} v{SCHEMA_VERSION}"
        )
    return manifest


# --- validation ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ValidationReport:
    store: str
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    num_shards: int
    num_sequences: int
    num_tokens: int

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_problems(self) -> None:
        if self.problems:
            raise StoreError(f"{self.store}: {len(self.problems)} problem(s):\n  " + "\n  ".join(self.problems))


def validate(store_dir: str | Path, checksums: bool = True, progress: bool = False) -> ValidationReport:
    """Check every shard of a store against its manifest; lists all problems, never raises."""
    from tqdm.auto import tqdm

    store_dir = Path(store_dir)
    problems: list[str] = []
    warnings: list[str] = []
    try:
        manifest = read_manifest(store_dir)
    except StoreError as err:
        return ValidationReport(store=str(store_dir), problems=(str(err),), warnings=(), num_shards=0,
                                num_sequences=0, num_tokens=0)
    finals, temps = list_shard_dirs(store_dir)
    warnings += [f"{t.name}: leftover temporary shard (ignored by readers)" for t in temps]
    listed = {r["index"] for r in manifest["shards"]}
    warnings += [f"{p.name}: shard not listed in the manifest (ignored)" for i, p in finals.items() if i not in listed]
    schema = array_schema(manifest["d"], manifest["k"], manifest["hidden_codec"])
    for record in tqdm(manifest["shards"], desc="validate", unit="shard", disable=not progress):
        problems += _check_shard(store_dir, record, schema, checksums)
    seen: dict[str, str] = {}
    for record in manifest["shards"]:  # no sample may be stored twice
        try:
            ids = zarr.open_group(store=str(store_dir / record["name"]), mode="r", zarr_format=3)["sample_ids"][...]
        except Exception:  # noqa: BLE001 - already reported by _check_shard
            continue
        for sid in map(str, ids.tolist()):
            if sid in seen:
                problems.append(f"{record['name']}: sample {sid!r} also stored in {seen[sid]}")
            seen.setdefault(sid, record["name"])
    totals = manifest["totals"]
    if totals["tokens"] != sum(r["num_tokens"] for r in manifest["shards"]):
        problems.append("manifest: totals.tokens differs from the sum over shards")
    if totals["sequences"] != sum(r["num_sequences"] for r in manifest["shards"]):
        problems.append("manifest: totals.sequences differs from the sum over shards")
    if manifest["num_shards"] != len(manifest["shards"]):
        problems.append("manifest: num_shards differs from the number of shard records")
    return ValidationReport(store=str(store_dir), problems=tuple(problems), warnings=tuple(warnings),
                            num_shards=len(manifest["shards"]), num_sequences=totals["sequences"],
                            num_tokens=totals["tokens"])


def _check_shard(store_dir: Path, record: dict, schema: dict, checksums: bool) -> list[str]:
    name = record.get("name", shard_name(record["index"]))
    path = store_dir / name
    if not path.is_dir():
        return [f"{name}: missing"]
    try:
        attrs = read_shard_record(path)
    except StoreError as err:
        return [f"{name}: {err}"]
    out = []
    for key in ("num_sequences", "num_tokens", "checksums"):
        if attrs.get(key) != record.get(key):
            out.append(f"{name}: {key} in shard attributes differs from the manifest")
    n, s = record["num_tokens"], record["num_sequences"]
    group = zarr.open_group(store=str(path), mode="r", zarr_format=3)
    for array_name, (dtype, tail) in schema.items():
        lead = s + 1 if array_name == "offsets" else s if array_name == "sample_ids" else n
        try:
            array = group[array_name]
        except KeyError:
            out.append(f"{name}/{array_name}: missing array")
            continue
        if tuple(array.shape) != (lead, *tail):
            out.append(f"{name}/{array_name}: shape {tuple(array.shape)}, manifest says {(lead, *tail)}")
            continue
        if array_name != "sample_ids" and np.dtype(array.dtype) != np.dtype(dtype):
            out.append(f"{name}/{array_name}: dtype {array.dtype}, expected {dtype}")
            continue
        if not checksums and array_name != "offsets":
            continue
        try:
            values = array[...]
        except Exception as err:  # noqa: BLE001 - corrupt chunk bytes surface as codec errors
            out.append(f"{name}/{array_name}: unreadable ({type(err).__name__}: {err})")
            continue
        if array_name == "offsets" and values.size and (values[0] != 0 or values[-1] != n or np.any(np.diff(values) <= 0)):
            out.append(f"{name}/offsets: not strictly increasing from 0 to {n}")
        if checksums and array_digest(values) != record["checksums"].get(array_name):
            out.append(f"{name}/{array_name}: sha256 mismatch (data corrupted or truncated)")
    return out


# --- reader -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ReaderConfig:
    max_tokens: int = 16384  # padded tokens per batch (B * T); a longer sequence gets a batch of its own
    max_length: int | None = None  # sequences are truncated to this many tokens
    max_batch_size: int | None = None
    val_fraction: float = 0.0  # fraction of sample ids held out (by hash) for validation
    seed: int = 0
    shuffle: bool = True  # False: batches in length order, same every epoch
    bucket_size: int = 1024  # sequences sorted by length within windows of this many

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1 and self.bucket_size >= 1, "max_tokens and bucket_size must be >= 1"
        assert self.max_length is None or self.max_length >= 1, "max_length must be >= 1"
        assert 0.0 <= self.val_fraction < 1.0, f"val_fraction {self.val_fraction} not in [0, 1)"


def is_held_out(sample_id: str, fraction: float) -> bool:
    """Whether ``sample_id`` belongs to the validation split (stable across stores and runs)."""
    h = int(hashlib.sha256(str(sample_id).encode()).hexdigest()[:15], 16)
    return h / 16**15 < fraction


def open_stores(paths: str | Path | list[str | Path]) -> list[tuple[Path, dict[str, Any]]]:
    """(dir, manifest) per store; StoreError unless all share the target, d and K."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    assert paths, "no store given"
    stores = [(Path(p), read_manifest(p)) for p in paths]
    first_dir, first = stores[0]
    for path, manifest in stores[1:]:
        for key in ("target_id", "d", "k"):
            if manifest[key] != first[key]:
                raise StoreError(f"stores disagree on {key}: {first_dir} has {first[key]!r}, {path} has {manifest[key]!r}")
    for path, manifest in stores:
        missing = [r["name"] for r in manifest["shards"] if not (path / r["name"]).is_dir()]
        if missing:
            raise StoreError(f"{path}: shards listed in the manifest are missing: {missing[:5]}")
    return stores


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
        self._shards: list[tuple[Path, str]] = []  # (shard dir, hidden codec)
        keys, starts, lengths, ids = [], [], [], []
        for path, manifest in self.stores:
            for record in manifest["shards"]:
                group = zarr.open_group(store=str(path / record["name"]), mode="r", zarr_format=3)
                offsets = group["offsets"][...]  # (S+1,)
                names = [str(s) for s in group["sample_ids"][...].tolist()]
                if offsets.shape != (record["num_sequences"] + 1,) or len(names) != record["num_sequences"]:
                    raise StoreError(f"{path / record['name']}: offsets/sample_ids disagree with the manifest")
                keys += [len(self._shards)] * len(names)
                starts.append(offsets[:-1])
                lengths.append(np.diff(offsets))
                ids += names
                self._shards.append((path / record["name"], manifest["hidden_codec"]))
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
        return pad_batch(samples)

    def _arrays(self, key: int) -> dict[str, Any]:
        """Zarr arrays of shard ``key``, opened once per process."""
        if key not in self._open:
            group = zarr.open_group(store=str(self._shards[key][0]), mode="r", zarr_format=3)
            self._open[key] = {name: array for name, array in group.arrays()}
        return self._open[key]


def predicted_token_counts(paths: str | Path | list[str | Path], vocab_size: int) -> np.ndarray:
    """How often each target token follows a loss-masked position in the stores (the draft-vocabulary
    statistics, ``specdraft.vocab``); reads only ``input_ids``, ``loss_mask`` and ``offsets``."""
    from specdraft.vocab import count_predicted_tokens

    counts = np.zeros(vocab_size, dtype=np.int64)
    for path, manifest in open_stores(paths):
        for record in manifest["shards"]:
            group = zarr.open_group(store=str(path / record["name"]), mode="r", zarr_format=3)
            counts += count_predicted_tokens(group["input_ids"][...], group["loss_mask"][...], group["offsets"][...],
                                             vocab_size)
    return counts
