"""The target's identity: its content fingerprint (a digest of its ``config.json`` and its weights' bytes, cached
beside the model), the id derived from it that keys every stage, and the pairing check every consumer of an
artifact (regenerated answers, a store, a draft) makes before its expensive part: the artifact was made from
this target (docs/guarantees.md). Each value is computed once per ``specdraft.targets.Target``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from specdraft.files import write_text
from specdraft.targets import Target
from specdraft.targets.checkpoint import INDEX_FILE, weight_files

FINGERPRINT_CACHE = ".specdraft-fingerprint.json"  # beside the weights (hidden: readers skip it)
FINGERPRINT_BLOCK = 16 << 20  # bytes read per step: large blocks, one thread per file


class TargetMismatch(ValueError):
    """An artifact (regenerated answers, a feature store, a draft) made from another target than ``--target``."""


def _file_key(file: Path) -> dict[str, int]:
    st = file.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _file_digest(file: Path) -> str:
    """sha256 of one file's bytes, streamed in ``FINGERPRINT_BLOCK`` blocks (hashlib drops the GIL)."""
    digest, buf = hashlib.sha256(), bytearray(FINGERPRINT_BLOCK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _cache_paths(root: Path) -> list[Path]:
    """Where a target's fingerprint cache may live: beside the weights, else (a read-only directory)
    under ``$XDG_CACHE_HOME/specdraft`` (default ``~/.cache/specdraft``), keyed by the resolved path."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdraft" / "fingerprints"
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24]
    return [root / FINGERPRINT_CACHE, home / f"{key}.json"]


def _read_cache(root: Path) -> list[dict[str, Any]]:
    """The cached per-file entries of every cache of ``root`` (beside it first)."""
    caches = []
    for path in _cache_paths(root):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("files"), dict):
            caches.append(data["files"])
    return caches


def _write_cache(root: Path, files: dict[str, Any]) -> None:
    text = json.dumps({"algorithm": "sha256", "files": files}, indent=1, sort_keys=True) + "\n"
    for path in _cache_paths(root):
        try:
            write_text(path, text)
            return
        except OSError:  # a read-only model directory: the user cache next
            continue


def target_fingerprint(target: Target | str | Path) -> str:
    """The target's content fingerprint ``"sha256:<hex>"``: a digest of its ``config.json`` bytes and of its
    weights' (``weights_fingerprint``), so a checkpoint under another config (a layer count that is not its
    own) is another target, and a copy of both elsewhere the same one."""
    target = Target.of(target)

    def compute() -> str:
        digest = hashlib.sha256(b"config.json\0" + (target.path / "config.json").read_bytes() + b"\0")
        digest.update(weights_fingerprint(target).encode())
        return f"sha256:{digest.hexdigest()}"

    return target.cached("fingerprint", compute)


def weights_fingerprint(target: Target | str | Path) -> str:
    """A digest ``"sha256:<hex>"`` of the target's weights' bytes (all a target fingerprint was before it
    covered ``config.json``).

    It covers every ``*.safetensors`` file (name, size and the sha256 of its bytes), so a model
    updated in place, or another checkpoint of the same shape, has another fingerprint, and a copy of
    the same weights elsewhere the same one. Each file's digest is computed once (files in parallel,
    streamed in large blocks) and cached in ``FINGERPRINT_CACHE`` beside the weights (or, when the
    directory is read-only, under ``~/.cache/specdraft``) keyed by the file's name, size and mtime:
    a file rewritten in place is hashed again.
    """
    target = Target.of(target)
    return target.cached("weights_fingerprint", lambda: _weights_digest(target.path))


def _weights_digest(root: Path) -> str:
    """``weights_fingerprint``, computed (the per-file cache read, the missing digests computed and written)."""
    files = weight_files(root)
    cached = _read_cache(root)
    entries: dict[str, dict[str, Any]] = {}
    todo: list[tuple[Path, dict[str, int]]] = []
    for file in files:
        key = _file_key(file)
        hits = [c[file.name] for c in cached if isinstance(c.get(file.name), dict)]
        hit = next((h for h in hits if all(h.get(k) == v for k, v in key.items()) and h.get("sha256")), None)
        if hit is not None:
            entries[file.name] = {**key, "sha256": hit["sha256"]}
        else:
            todo.append((file, key))
    if todo:
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 8)) as pool:
            digests = list(pool.map(_file_digest, [file for file, _ in todo]))
        for (file, key), digest in zip(todo, digests):
            entries[file.name] = {**key, "sha256": digest}
        if all(_file_key(file) == key for file, key in todo):  # none rewritten while it was read
            _write_cache(root, entries)
    overall = hashlib.sha256()
    for name in sorted(entries):
        overall.update(f"{name}\0{entries[name]['size']}\0{entries[name]['sha256']}\n".encode())
    return f"sha256:{overall.hexdigest()}"


def target_id(target: Target | str | Path) -> str:
    """A stable identity ``"<dir name>@<sha256 prefix>"`` for a target directory: part of every stage key.

    The digest covers ``config.json`` and the weights' content (``weights_fingerprint``), so a model
    updated in place (or its config edited) gets a new id.
    """
    target = Target.of(target)

    def compute() -> str:
        digest = hashlib.sha256()
        digest.update(b"config.json\0" + (target.path / "config.json").read_bytes())
        digest.update(b"weights\0" + weights_fingerprint(target).encode())  # the id as before config.json joined it
        return f"{target.path.resolve().name}@{digest.hexdigest()[:16]}"

    return target.cached("id", compute)


def layout_id(target: Target | str | Path) -> str:
    """The identity of specdraft before content fingerprints: ``config.json``, the index file and the
    name and size of every safetensors file (not the weights). Only to check artifacts written then."""
    root = Target.of(target).path
    digest = hashlib.sha256()
    digest.update(b"config.json\0" + (root / "config.json").read_bytes())
    index = root / INDEX_FILE
    if index.is_file():
        digest.update(INDEX_FILE.encode() + b"\0" + index.read_bytes())
    for file in weight_files(root):
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
    return f"{root.resolve().name}@{digest.hexdigest()[:16]}"


def target_record(target: Target | str | Path) -> dict[str, str]:
    """What an artifact records of the target it was made from: ``target_id`` and ``target_fingerprint``."""
    target = Target.of(target)
    return {"target_id": target_id(target), "target_fingerprint": target_fingerprint(target)}


def check_pairing(artifact: str | Path, recorded: Mapping[str, Any], target: Target | str | Path, *,
                  what: str = "artifact", legacy_mismatch: str = "warn") -> None:
    """Check that ``artifact`` (its recorded ``target_fingerprint`` / ``target_id``) was made from ``target``.

    A recorded fingerprint must equal the target's: else ``TargetMismatch`` naming the artifact's path
    and fingerprint and the target's. An artifact written before fingerprints (none recorded) loads
    with a one-line warning, checked by its target id as then: a mismatch is a warning, or with
    ``legacy_mismatch="error"`` (where that id was checked before) an error.
    """
    assert legacy_mismatch in ("warn", "error"), f"legacy_mismatch={legacy_mismatch!r}: 'warn' or 'error'"
    target = Target.of(target)
    root = target.path
    recorded_fp, recorded_id = recorded.get("target_fingerprint") or "", recorded.get("target_id") or ""
    if recorded_fp:
        ours = target_fingerprint(target)
        # written when the fingerprint covered the weights only: its target id (unchanged) covers config.json
        earlier = (recorded_fp == weights_fingerprint(target)
                   and recorded_id.split("@")[-1] == target_id(target).split("@")[-1])
        if recorded_fp != ours and not earlier:
            raise TargetMismatch(
                f"{what} {artifact} was made from target {recorded_id or '?'} (fingerprint {recorded_fp}), but "
                f"--target {root.resolve()} is {target_id(target)} (fingerprint {ours}): give the {what}'s own "
                f"target, or remake the {what} from this one"
            )
        return
    if recorded_id and recorded_id == target_id(target):  # a content-derived id: as good as the fingerprint
        return
    legacy = layout_id(target)
    if recorded_id == legacy:
        _warn(f"{what} {artifact} records no target fingerprint (written before fingerprints): checked by its "
              f"target id {recorded_id} only (config and file sizes, not the weights)")
        return
    message = (f"{what} {artifact} records no target fingerprint (written before fingerprints) and its target id "
               f"{recorded_id or '(none)'} is not that of --target {root.resolve()} ({legacy})")
    if legacy_mismatch == "error":
        raise TargetMismatch(f"{message}: give the {what}'s own target, or remake the {what} from this one")
    _warn(f"{message}: its pairing with the target is not verified")


def _warn(line: str) -> None:
    print(f"[specdraft] WARNING: {line}", file=sys.stderr, flush=True)
