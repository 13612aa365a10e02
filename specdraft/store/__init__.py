"""The feature store: schema, shard writing, manifest and validation, and the training reader.

Implements the feature store of docs/concepts.md "The core in one page" — the contract between the dump stage
(``pipelines/dump.py``, which produces the arrays) and training (which reads them). A store is a
directory (a local path or an fsspec URL such as ``s3://bucket/prefix``) of Zarr v3 shards
``shard-XXXXX.zarr`` plus ``manifest.json``:

* ``location``  local path or URL: listing, deletion, atomic whole-file writes, opening Zarr groups;
* ``schema``    array names/dtypes/shapes, hidden-state codecs, shard names, digests;
* ``writer``    ``write_shard``: one shard into a temporary directory, renamed into place
                (at a URL: in place, its record written last);
* ``manifest``  the manifest (header, shard records, totals) and ``validate``;
* ``plan``      a dump's shard plan, its resume (which shards are kept), its shard records and summary;
* ``chunks``    a shard's chunks read and checked (crc32c, lost chunks, fill-valued chunks listed);
* ``batching``  the held-out split and an epoch's batch plan (shared with the online features);
* ``prefetcher``  ``Prefetcher``: the next batches read on a background thread;
* ``reader``    ``FeatureDataset``: ``batch.Batch`` objects for training.

Only this package of ``specdraft`` imports zarr, and it imports no training code. The names below are loaded
from their submodule on first use (PEP 562), so ``import specdraft.store.location`` — what the traffic reader
needs — loads neither zarr nor torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM = {  # submodule -> the names this package offers from it
    "batching": ("balance_batches", "is_held_out", "plan_batches"),
    "manifest": ("ValidationReport", "make_manifest", "read_manifest", "validate", "write_manifest"),
    "plan": ("dump_summary", "plan_digest", "plan_shards", "resume_shards", "shard_attrs"),
    "prefetcher": ("Prefetcher",),
    "reader": ("EpochBatches", "FeatureDataset", "StoreWarning", "common_aux_layers", "open_stores",
        "predicted_token_counts"),
    "schema": ("AUX_ARRAYS", "CHUNK_CHECKSUM", "COMPRESSIONS", "FORMAT_NAME", "HIDDEN_CODECS", "LOSSY_CODECS",
        "MANIFEST_FILE", "SCHEMA_VERSION", "SEQUENCE_ARRAYS", "SHARD_ATTR", "StoreError", "TOKEN_ARRAYS",
        "array_digest", "array_schema", "bytes_per_token_reference", "decode_hidden", "encode_hidden", "shard_index",
        "shard_name", "temp_shard_name"),
    "writer": ("ZARR_VERSION", "list_shard_dirs", "read_shard_record", "write_shard"),
}
_MODULE = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_MODULE)


_SUBMODULES = ("batching", "chunks", "location", "manifest", "plan", "prefetcher", "reader", "schema", "writer")


def __getattr__(name: str) -> Any:
    """A name of ``__all__`` or a submodule (``store.location``), imported on first use."""
    if name in _SUBMODULES:
        return importlib.import_module(f"specdraft.store.{name}")
    module = _MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'specdraft.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"specdraft.store.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE) | set(_SUBMODULES))
