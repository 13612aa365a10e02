"""Shard writing: one writer per shard, into a temporary directory renamed into place when complete.

docs/store.md "Object stores" gives the commit rules; ``location.write_directory`` applies them.

Locally a ``shard-XXXXX.zarr`` name always holds a complete shard (temporaries are never read). At
an object-store URL there is no rename: the shard is written under its final prefix (a killed
writer's leftover keys removed first) and is complete only once its record is there. Either way the
shard record (counts, per-array sha256) is the group's last write. Also lists a store's shard
directories and reads a shard's record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

from specdraft.store import location
from specdraft.store.chunks import absent_chunks
from specdraft.store.schema import (
    AUX_ARRAYS,
    COMPRESSIONS,
    CHUNK_CHECKSUM,
    SHARD_ATTR,
    TOKEN_ARRAYS,
    StoreError,
    array_digest,
    array_schema,
    shard_index,
    shard_name,
)

ZARR_VERSION = zarr.__version__  # recorded in a dumped store's manifest
# at most this many (uncompressed) bytes in a chunk of a token array: a chunk's bytes stay in a core's L2
# cache while the reader reads, checks (crc32c) and decompresses them — 128 rows of hidden states at
# d = 4096 in fp16 instead of 1024 (8 MiB, where the checksum ran at memory speed, measured)
CHUNK_BYTES = 1 << 20


def _compressors(compression: str, level: int, checksums: bool = True) -> list:
    """The bytes-to-bytes codecs of every array: the compressor, then a crc32c of the compressed chunk
    (Zarr v3's ``crc32c`` codec, checked on every decode: ``reader`` names the chunk that fails it)."""
    crc = [Crc32cCodec()] if checksums else []
    if compression == "zstd":
        return [ZstdCodec(level=level), *crc]
    if compression == "blosc":
        return [BloscCodec(cname="zstd", clevel=level, shuffle="shuffle"), *crc]
    if compression == "none":
        return crc
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
    chunk_checksums: bool = True,
) -> dict[str, Any]:
    """Write shard ``index`` of ``store_dir`` (temp dir, then rename; at a URL in place); returns its record.

    A token array's chunks hold ``chunk_tokens`` rows, fewer where that would be over ``CHUNK_BYTES``.
    ``arrays`` holds every array of ``array_schema``; ``attrs`` must carry ``d``, ``k`` and
    ``hidden_codec``, and ``aux_layers`` when ``aux_hidden`` is stored. The record (``attrs`` plus
    counts and per-array sha256) is stored as the shard group's ``specdraft_shard`` attribute,
    written last, and returned for the manifest.

    Integrity (docs/guarantees.md): every chunk ends with its crc32c (``CHUNK_CHECKSUM``, recorded in the
    record), and the chunks Zarr leaves unstored because they hold only fill values are listed in the
    record (``fill_chunks``: array -> chunk indices), so a chunk absent on read that is not listed is a
    lost chunk, not zeros (shards written with checksums before ``fill_chunks`` store every chunk).
    ``chunk_checksums=False`` writes a shard as before them (no crc32c, no ``chunk_checksum`` or
    ``fill_chunks`` in the record): the reader's compatibility tests and the benchmark's unverified baseline.
    """
    store_dir = location.as_location(store_dir)
    schema = array_schema(attrs["d"], attrs["k"], attrs["hidden_codec"], len(attrs.get("aux_layers") or []))
    missing = sorted(set(schema) - set(arrays))
    assert not missing, f"shard {index}: missing arrays {missing}"
    offsets = np.asarray(arrays["offsets"])
    n_tokens, n_seqs = int(arrays["input_ids"].shape[0]), int(arrays["sample_ids"].shape[0])
    assert offsets.shape == (n_seqs + 1,) and offsets[0] == 0 and offsets[-1] == n_tokens, (
        f"shard {index}: offsets {offsets[:3]}..{offsets[-1:]} do not match {n_seqs} sequences / {n_tokens} tokens"
    )
    assert chunk_tokens >= 1, "chunk_tokens must be >= 1"
    checksums = {}
    # locally a temporary directory renamed into place; at a URL the final prefix, emptied of an earlier attempt
    with location.write_directory(location.join(store_dir, shard_name(index))) as out:
        group = location.open_group(out, "w")
        for name, (dtype, tail) in schema.items():
            values = np.asarray(arrays[name])
            if name == "sample_ids":
                values = np.asarray([str(v) for v in values.tolist()], dtype=str)
            else:
                values = np.ascontiguousarray(values, dtype=dtype)
            assert values.shape[1:] == tail, f"shard {index}: {name} has shape {values.shape}, want (*, {tail})"
            if name in (*TOKEN_ARRAYS, "hidden_scale", *AUX_ARRAYS):  # chunk_tokens rows, within CHUNK_BYTES
                rows = min(chunk_tokens, max(1, CHUNK_BYTES // (values.dtype.itemsize * int(np.prod(tail)))))
            else:
                rows = 65536
            chunks = (max(1, min(rows, values.shape[0])), *tail)
            array = group.create_array(
                name,
                shape=values.shape,
                dtype=str if name == "sample_ids" else dtype,
                chunks=chunks,
                compressors=_compressors(compression, level, chunk_checksums),
                config={"write_empty_chunks": False},  # fill-valued chunks unstored (and listed: ``fill_chunks``)
            )
            if values.size:
                array[...] = values
            checksums[name] = array_digest(values)
        record = {
            **attrs,
            "index": index,
            "name": shard_name(index),
            "num_sequences": n_seqs,
            "num_tokens": n_tokens,
            "num_loss_tokens": int(np.asarray(arrays["loss_mask"]).sum()),
            "checksums": checksums,
            **({"chunk_checksum": CHUNK_CHECKSUM, "fill_chunks": absent_chunks(out, group)} if chunk_checksums else {}),
        }
        record["bytes"] = location.tree_bytes(out)
        # last write: a shard without it is incomplete. A retried writer that finished this shard
        # first is replaced on the rename (same plan, same bytes)
        group.attrs[SHARD_ATTR] = record
    return record


def read_shard_record(path: str | Path) -> dict[str, Any]:
    """The ``specdraft_shard`` record of a shard directory; StoreError when absent/unreadable."""
    try:
        return dict(location.open_group(path, "r").attrs[SHARD_ATTR])
    except Exception as err:  # noqa: BLE001 - any zarr/JSON failure means the shard is unusable
        raise StoreError(f"{path}: not a complete shard ({type(err).__name__}: {err})") from None


def list_shard_dirs(store_dir: str | Path) -> tuple[dict[int, Path | str], list[Path]]:
    """(final shards by index, leftover temporary shard directories) in ``store_dir``.

    At a URL there are no temporaries, and a listed shard may be incomplete (``read_shard_record``).
    """
    if location.is_url(store_dir):
        names = location.list_dir(store_dir)
        return {shard_index(n): location.join(store_dir, n) for n in names if shard_index(n) is not None}, []
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
