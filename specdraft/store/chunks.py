"""A shard's chunks as the reader reads them: integrity checked chunk by chunk (docs/guarantees.md).

Every chunk of a shard written with checksums ends with its crc32c (the writer's Zarr ``crc32c`` codec,
checked on decode), and the chunks Zarr leaves unstored because they hold only fill values are listed in
the shard's record (``fill_chunks``), so a chunk that is absent and not listed is lost, not zeros. A bad
chunk is a one-line ``StoreError`` naming the store, shard, array and chunk, or, when the caller skips,
its rows are zeros and it is reported. Locally a chunk is read as its bytes and decoded through Zarr's
synchronous store and codec interfaces (``ShardArray``); at a URL through Zarr's own array reads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from zarr.core.buffer import default_buffer_prototype

try:  # Zarr's synchronous store and codec protocols (the local fast path); older 3.x: its async array reads
    from zarr.abc.codec import SupportsSyncCodec
    from zarr.abc.store import SupportsGetSync
except ImportError:  # pragma: no cover - the pinned zarr has them
    SupportsSyncCodec = SupportsGetSync = None

from specdraft.store import location
from specdraft.store.schema import CHUNK_CHECKSUM, StoreError


def chunk_key(array: Any, c: int) -> str:
    """The store key (relative to the array) of row chunk ``c`` of a Zarr array: ``c/3/0``."""
    return array.metadata.encode_chunk_key((c, *([0] * (array.ndim - 1))))


def absent_chunks(shard: str | Path, group: Any) -> dict[str, list[int]]:
    """Array name -> indices (along rows) of the chunks not stored in a shard, for the arrays that have
    any; one listing of the shard."""
    present = location.list_tree(shard)
    absent = {}
    for name, array in group.arrays():
        rows = array.chunks[0]
        lost = [c for c in range(-(-array.shape[0] // rows)) if f"{name}/{chunk_key(array, c)}" not in present]
        if lost:
            absent[name] = lost
    return dict(sorted(absent.items()))



MISSING_CHUNK = "is missing (lost after it was written: Zarr would read it as fill values)"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardArray:
    """One array of a shard as the reader reads it: Zarr's array, whether an absent chunk is lost
    (``complete``: written with checksums) unless it is one of ``fill`` (the fill-valued chunks the shard's
    record lists as unstored: read as fill values without a store access), and — where the store reads
    synchronously (a local directory) and every codec decodes synchronously — Zarr's codecs resolved for
    the array's chunks, so that a chunk is read as its bytes (``StorePath.get_sync``) and decoded in
    reverse codec order (``SupportsSyncCodec._decode_sync``: the crc32c checked, then the compressor,
    then the bytes codec), the Zarr v3 decode without the async pipeline's per-chunk, per-codec tasks
    (measured: those, not the checksum, were most of what the check cost). ``codecs`` None: read
    through Zarr's own array reads (an object store)."""

    array: Any  # zarr.Array
    complete: bool
    fill: frozenset[int] = frozenset()
    codecs: tuple[Any, ...] | None = None  # Zarr codecs in encode order: array->array, array->bytes, bytes->bytes
    spec: Any = None  # zarr ArraySpec of one chunk

    @classmethod
    def open(cls, array: Any, complete: bool, fill: frozenset[int] | None = None) -> "ShardArray":
        fill = fill or frozenset()
        codecs = tuple(array.metadata.codecs) if array.metadata.zarr_format == 3 else ()
        sync = (codecs and SupportsGetSync is not None and isinstance(array.store_path.store, SupportsGetSync)
                and all(isinstance(codec, SupportsSyncCodec) for codec in codecs))
        if not sync:
            return cls(array=array, complete=complete, fill=fill)
        spec = array.metadata.get_chunk_spec((0,) * array.ndim, array.config, default_buffer_prototype())
        return cls(array=array, complete=complete, fill=fill,
                   codecs=tuple(c.evolve_from_array_spec(spec) for c in codecs), spec=spec)

    def read_chunk(self, c: int) -> np.ndarray | None:
        """Row chunk ``c`` decoded (chunk rows, ...), None when it is not stored; a codec's exception (a
        failed crc32c: ``ValueError``) propagates."""
        data = (self.array.store_path / chunk_key(self.array, c)).get_sync(prototype=self.spec.prototype)
        if data is None:
            return None
        for codec in reversed(self.codecs):  # bytes->bytes (crc32c, compressor), array->bytes, array->array
            data = codec._decode_sync(data, self.spec)
        return data.as_numpy_array()


def shard_chunks(shard: Path | str, group: Any, record: dict[str, Any]
                 ) -> tuple[bool, dict[str, set[int]], dict[str, frozenset[int]]]:
    """What a shard's record says of its chunks: whether it was written with checksums (``verified``: an
    absent chunk it does not list as fill-valued is lost), array name -> the chunks lost (absent and not
    listed; one listing of the shard, only when verified), and array name -> the fill-valued chunks it
    lists as unstored."""
    verified = record.get("chunk_checksum") == CHUNK_CHECKSUM
    fill = {name: frozenset(chunks) for name, chunks in (record.get("fill_chunks") or {}).items()}
    if not verified:
        return False, {}, fill
    missing = {name: set(lost) - fill.get(name, frozenset()) for name, lost in absent_chunks(shard, group).items()}
    return True, {name: lost for name, lost in missing.items() if lost}, fill


def read_checked_rows(source: ShardArray, lo: int, hi: int | None, store, shard: str, missing: set[int] | None = None,
              skip: bool = False) -> tuple[np.ndarray, list[tuple[int, int, str]]]:
    """Rows [lo, hi) of a shard's array, every chunk checked: (values, bad chunks); ``values`` may be a
    read-only view of a decoded chunk.

    A chunk that fails its crc32c or cannot be decoded, or one lost from a shard written with checksums
    (absent but not among the fill-valued ones its record lists: one of ``missing``, listed when the shard
    was opened, or not there when read), raises a
    one-line ``StoreError`` naming ``store``, ``shard``, the array and the chunk; with ``skip`` its rows
    are zeros instead and it is returned as (first row, end row, description).

    A local shard is read chunk by chunk through Zarr's synchronous interfaces (``ShardArray.read_chunk``),
    each chunk's failure named as it happens; elsewhere (an object store) the fast path is one Zarr read,
    and chunks are read one by one only after a failure.
    """
    array = source.array
    hi = array.shape[0] if hi is None else hi
    step = array.chunks[0]
    chunks = range(lo // step, -(-hi // step)) if hi > lo else range(0)
    if source.codecs is None and (not missing or not any(c in missing for c in chunks)):
        try:
            return array[lo:hi], []
        except Exception:  # noqa: BLE001 - a bad chunk: found and named below
            pass
    whole = len(chunks) == 1 and chunks[0] not in source.fill and not (missing and chunks[0] in missing)
    if source.codecs is not None and whole:
        try:  # one chunk (a run within a chunk): its rows as a (read-only) view of the decoded chunk, no copy
            block = source.read_chunk(chunks[0])
            if block is not None:
                return block[lo - chunks[0] * step : hi - chunks[0] * step], []
        except Exception:  # noqa: BLE001 - a bad chunk: named below
            pass
    values = np.zeros((hi - lo, *array.shape[1:]), dtype=array.dtype if array.dtype.kind not in "OTU" else object)
    bad = []
    for c in chunks:
        a, b = max(lo, c * step), min(hi, (c + 1) * step)
        if c in source.fill:  # stored as nothing: it held only fill values when written
            values[a - lo : b - lo] = array.fill_value
            continue
        if missing and c in missing:
            reason = MISSING_CHUNK
        else:
            try:
                if source.codecs is None:
                    values[a - lo : b - lo] = array[a:b]
                    continue
                block = source.read_chunk(c)  # (chunk rows, ...) | None: absent
                if block is not None:
                    values[a - lo : b - lo] = block[a - c * step : b - c * step]
                    continue
                if not source.complete:  # written before the checksums: an absent chunk is fill values, as in Zarr
                    values[a - lo : b - lo] = array.fill_value
                    continue
                reason = MISSING_CHUNK
            except Exception as err:  # noqa: BLE001 - any codec failure is a corrupt chunk
                text = (str(err).splitlines() or [""])[0][:160]
                reason = ("fails its crc32c checksum (its bytes changed or were cut after it was written)"
                          if "checksum" in text.lower() else f"cannot be decoded ({type(err).__name__}: {text})")
        where = f"chunk {chunk_key(array, c)} (rows {c * step}-{min(array.shape[0], (c + 1) * step) - 1})"
        if not skip:
            raise StoreError(f"corrupt feature store {store}: shard {shard}, array {array.basename}, {where} {reason}; "
                             f"`specdraft validate-store {store}` lists every bad chunk, reader.on_corrupt=skip "
                             "trains without the sequences it holds") from None
        values[a - lo : b - lo] = 0
        bad.append((a, b, f"{shard}/{array.basename} {where} {reason.split(' (')[0]}"))
    return values, bad
