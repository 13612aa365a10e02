"""The store manifest (header + shard records + totals) and validation of a store against it.

``manifest.json`` is the store's last write (a temp file renamed into place, or at a URL one PUT):
a store without it is incomplete, whatever shards it holds. It records the target the features came
from (``target_id`` and the content fingerprint ``target_fingerprint``, ``specdraft.targets.identity``), which
``check_store_target`` compares with the target a consumer (train, a resumed dump) is given.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.store import location
from specdraft.store.schema import (
    FORMAT_NAME,
    LOSSY_CODECS,
    MANIFEST_FILE,
    SCHEMA_VERSION,
    StoreError,
    array_digest,
    array_schema,
    bytes_per_token_reference,
    shard_name,
)
from specdraft.store.writer import list_shard_dirs, read_shard_record
from specdraft.targets import Target


def make_manifest(*, header: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Manifest = ``header`` (target, features, d, k, hidden_codec, ...) + shard records + totals."""
    missing = [key for key in ("target_id", "d", "k", "hidden_codec") if key not in header]
    if missing:
        raise StoreError(f"manifest header lacks {missing}")
    shards = sorted(shards, key=lambda r: r["index"])
    aux = header.get("aux_layers") or []
    odd = [r["index"] for r in shards if (r.get("aux_layers") or []) != aux]
    if odd:
        raise StoreError(f"shards {odd[:5]} hold other aux_layers than the header's {aux}")
    indices = [r["index"] for r in shards]
    if len(set(indices)) != len(indices):
        raise StoreError(f"duplicate shard records {sorted(i for i in set(indices) if indices.count(i) > 1)}")
    tokens = sum(r["num_tokens"] for r in shards)
    nbytes = sum(r["bytes"] for r in shards)
    rejected: dict[str, int] = {}
    for r in shards:
        for reason, count in r.get("rejected", {}).items():
            rejected[reason] = rejected.get(reason, 0) + count
    num_aux = len(header.get("aux_layers") or [])
    schema = array_schema(header["d"], header["k"], header["hidden_codec"], num_aux)
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
            "bytes_per_token_reference": bytes_per_token_reference(header["d"], header["k"], num_aux),
        },
    }


def write_manifest(store_dir: str | Path, manifest: dict[str, Any]) -> Path | str:
    """Write ``manifest.json`` atomically (temp file + rename; at a URL one PUT)."""
    return location.write_text(location.join(store_dir, MANIFEST_FILE), json.dumps(manifest, indent=1) + "\n")


def read_manifest(store_dir: str | Path) -> dict[str, Any]:
    """The store's manifest; StoreError when missing (dump incomplete), of another schema, or listing a shard twice."""
    path = location.join(store_dir, MANIFEST_FILE)
    try:
        text = location.read_text(path)
    except (FileNotFoundError, IsADirectoryError):
        raise StoreError(f"{store_dir}: no {MANIFEST_FILE} — not a store, or its dump is incomplete (rerun to resume)") from None
    try:
        manifest = json.loads(text)
    except (OSError, json.JSONDecodeError) as err:
        raise StoreError(f"{path}: unreadable manifest ({err})") from None
    if manifest.get("format") != FORMAT_NAME or manifest.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('schema_version')}, "
            f"this reader understands {FORMAT_NAME!r} v{SCHEMA_VERSION}"
        )
    listed = Counter(str(r.get("name")) for r in manifest.get("shards") or [] if isinstance(r, dict))
    twice = sorted(name for name, count in listed.items() if count > 1)
    if twice:  # every reader (train, dump's resume, validate-store) would read its samples once per listing
        raise StoreError(f"{store_dir}: shard {twice[0]} is listed {listed[twice[0]]} times in {MANIFEST_FILE}"
                         f"{f' (and {len(twice) - 1} more shards)' if len(twice) > 1 else ''}: a manifest lists each "
                         "shard once — its samples would be trained on more than once; remove the repeated record")
    return manifest


def recorded_target(store_dir: str | Path) -> dict[str, Any] | None:
    """The target a store records (``target_id``, ``target_fingerprint``): its manifest's, or for a dump
    that has not finished, the first complete shard's; None for an empty or new directory."""
    try:
        manifest = read_manifest(store_dir)
    except StoreError:
        finals, _ = list_shard_dirs(store_dir) if location.is_dir(store_dir) else ({}, [])
        for _, path in sorted(finals.items()):
            try:
                return read_shard_record(path)
            except StoreError:
                continue
        return None
    return manifest


def check_store_target(store_dir: str | Path, target: Target | str | Path, *, legacy_mismatch: str = "warn") -> None:
    """``specdraft.targets.identity.check_pairing`` for a store: ``TargetMismatch`` (naming the store and both
    fingerprints) unless its features came from ``target``. A store without a record passes."""
    from specdraft.targets.identity import check_pairing  # the target side only where a store meets a target

    recorded = recorded_target(store_dir)
    if recorded is not None:
        check_pairing(store_dir, recorded, target, what="feature store", legacy_mismatch=legacy_mismatch)


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

    store_dir = location.as_location(store_dir)
    problems: list[str] = []
    warnings: list[str] = []
    try:
        manifest = read_manifest(store_dir)
    except StoreError as err:
        return ValidationReport(store=str(store_dir), problems=(str(err),), warnings=(), num_shards=0,
                                num_sequences=0, num_tokens=0)
    finals, temps = list_shard_dirs(store_dir)
    warnings += [f"{location.name_of(t)}: leftover temporary shard (ignored by readers)" for t in temps]
    listed = {r["index"] for r in manifest["shards"]}
    warnings += [f"{location.name_of(p)}: shard not listed in the manifest (ignored)"
                 for i, p in finals.items() if i not in listed]
    schema = array_schema(manifest["d"], manifest["k"], manifest["hidden_codec"], len(manifest.get("aux_layers") or []))
    for record in tqdm(manifest["shards"], desc="validate", unit="shard", disable=not progress):
        problems += _check_shard(store_dir, record, schema, checksums)
    seen: dict[str, str] = {}
    for record in manifest["shards"]:  # no sample may be stored twice
        try:
            ids = location.open_group(location.join(store_dir, record["name"]), "r")["sample_ids"][...]
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


def _check_shard(store_dir: Path | str, record: dict, schema: dict, checksums: bool) -> list[str]:
    name = record.get("name", shard_name(record["index"]))
    path = location.join(store_dir, name)
    if not location.is_dir(path):
        return [f"{name}: missing"]
    try:
        attrs = read_shard_record(path)
    except StoreError as err:
        return [f"{name}: {err}"]
    out = []
    for key in ("num_sequences", "num_tokens", "checksums", "aux_layers"):
        if attrs.get(key) != record.get(key):
            out.append(f"{name}: {key} in shard attributes differs from the manifest")
    n, s = record["num_tokens"], record["num_sequences"]
    group = location.open_group(path, "r")
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
