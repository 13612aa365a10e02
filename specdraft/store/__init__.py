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

Only this package of ``specdraft`` imports zarr, and it imports no training code.
"""

from specdraft.store.batching import balance_batches, is_held_out, plan_batches
from specdraft.store.manifest import ValidationReport, make_manifest, read_manifest, validate, write_manifest
from specdraft.store.plan import dump_summary, plan_digest, plan_shards, resume_shards, shard_attrs
from specdraft.store.prefetcher import Prefetcher
from specdraft.store.reader import (
    EpochBatches,
    FeatureDataset,
    StoreWarning,
    common_aux_layers,
    open_stores,
    predicted_token_counts,
)
from specdraft.store.schema import (
    AUX_ARRAYS,
    CHUNK_CHECKSUM,
    COMPRESSIONS,
    FORMAT_NAME,
    HIDDEN_CODECS,
    LOSSY_CODECS,
    MANIFEST_FILE,
    SCHEMA_VERSION,
    SEQUENCE_ARRAYS,
    SHARD_ATTR,
    TOKEN_ARRAYS,
    StoreError,
    array_digest,
    array_schema,
    bytes_per_token_reference,
    decode_hidden,
    encode_hidden,
    shard_index,
    shard_name,
    temp_shard_name,
)
from specdraft.store.writer import ZARR_VERSION, list_shard_dirs, read_shard_record, write_shard

__all__ = [
    "AUX_ARRAYS", "CHUNK_CHECKSUM", "COMPRESSIONS", "FORMAT_NAME", "HIDDEN_CODECS", "LOSSY_CODECS", "MANIFEST_FILE",
    "SCHEMA_VERSION", "SEQUENCE_ARRAYS", "SHARD_ATTR", "TOKEN_ARRAYS", "ZARR_VERSION", "EpochBatches",
    "FeatureDataset", "Prefetcher", "StoreError", "StoreWarning", "ValidationReport", "array_digest", "array_schema",
    "balance_batches", "bytes_per_token_reference", "common_aux_layers", "decode_hidden", "dump_summary",
    "encode_hidden", "is_held_out", "list_shard_dirs", "make_manifest", "open_stores", "plan_batches",
    "plan_digest", "plan_shards", "predicted_token_counts", "read_manifest", "read_shard_record", "resume_shards",
    "shard_attrs", "shard_index", "shard_name", "temp_shard_name", "validate", "write_manifest", "write_shard",
]
