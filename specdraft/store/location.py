"""Where a store lives: a local directory, or an object-store URL (fsspec: ``s3://bucket/prefix``, ``gs://``).

docs/store.md "Object stores": a store lives at a local path or an object-store URL so that every node of
a cluster reads the same store. This module is the one seam between the store's logic and its
storage; it also serves the regenerate stage's output directory.

Commit rules (what makes a write visible as complete):

* local path: write a temporary name, then rename it into place (POSIX rename is atomic;
  ``specdraft/files.py`` holds the two writers, a file and a directory);
* URL: object stores have no rename. One object is published only when its upload completes
  (a single PUT, or a completed multipart upload), so a file written here in one ``pipe_file``
  call is its own commit. Anything made of several objects (a Zarr shard, a store) is complete
  only once its marker object is written last: the shard's group ``zarr.json`` carrying its
  record, the store's ``manifest.json``.

Credentials and endpoints come from the environment and fsspec's own configuration
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or an instance role,
``FSSPEC_S3_*`` variables, ``~/.config/fsspec/``); nothing here takes, logs or records them.
Only this module imports fsspec, and only for URLs; zarr only when a group is opened (the traffic reader lists
and reads files here without it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from specdraft import files

if TYPE_CHECKING:
    import zarr

Location = Union[str, Path]
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://")


def is_url(location: Location) -> bool:
    """Whether ``location`` is an fsspec URL (``file://`` counts as a local path)."""
    text = str(location)
    return bool(_URL.match(text)) and not text.startswith("file://")


def as_location(location: Location) -> Path | str:
    """A local ``Path``, or the URL as a string without a trailing slash."""
    if is_url(location):
        return str(location).rstrip("/")
    text = str(location)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def join(location: Location, name: str) -> Path | str:
    """``location / name`` for a path or a URL."""
    location = as_location(location)
    return f"{location}/{name}" if isinstance(location, str) else location / name


def name_of(location: Location) -> str:
    """The last component of a path or URL."""
    location = as_location(location)
    return location.rsplit("/", 1)[-1] if isinstance(location, str) else location.name


def _fs(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for ``url``, its listing cache dropped (other processes write)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache(path)
    return fs, path


def make_dirs(location: Location) -> None:
    """Create a local directory (and parents); a URL prefix needs no creating."""
    location = as_location(location)
    if isinstance(location, Path):
        location.mkdir(parents=True, exist_ok=True)


def exists(location: Location) -> bool:
    location = as_location(location)
    if isinstance(location, Path):
        return location.exists()
    fs, path = _fs(location)
    return fs.exists(path)


def is_dir(location: Location) -> bool:
    """A local directory, or a URL prefix holding at least one object."""
    location = as_location(location)
    if isinstance(location, Path):
        return location.is_dir()
    fs, path = _fs(location)
    return fs.isdir(path)


def list_dir(location: Location) -> list[str]:
    """Sorted names directly under ``location`` (files and directories/prefixes); [] when absent."""
    location = as_location(location)
    if isinstance(location, Path):
        return sorted(p.name for p in location.iterdir()) if location.is_dir() else []
    fs, path = _fs(location)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != path.rstrip("/")})


def list_tree(location: Location) -> set[str]:
    """Every file under ``location``, as paths relative to it joined with ``/`` (one walk; at a URL one
    recursive listing); an empty set when absent."""
    location = as_location(location)
    if isinstance(location, Path):
        return {os.path.relpath(os.path.join(top, name), location).replace(os.sep, "/")
                for top, _, names in os.walk(location) for name in names}
    fs, path = _fs(location)
    root = path.rstrip("/") + "/"
    return {key[len(root):] for key in fs.find(path) if key.startswith(root)}


def remove(location: Location) -> None:
    """Delete a file or a whole directory/prefix; nothing when absent."""
    location = as_location(location)
    if isinstance(location, Path):
        files.remove(location)
        return
    fs, path = _fs(location)
    keys = fs.find(path) + ([path] if fs.isfile(path) else [])
    if keys:
        fs.rm(sorted(set(keys)))
    fs.invalidate_cache(path)


def read_bytes(location: Location) -> bytes:
    """A file's bytes; FileNotFoundError when absent."""
    location = as_location(location)
    if isinstance(location, Path):
        return location.read_bytes()
    fs, path = _fs(location)
    return fs.cat_file(path)


def read_text(location: Location) -> str:
    return read_bytes(location).decode()


def write_bytes(location: Location, data: bytes) -> Path | str:
    """Write a whole file so that it is either absent or complete: local temp + rename, URL one PUT."""
    location = as_location(location)
    if isinstance(location, str):
        fs, path = _fs(location)
        fs.pipe_file(path, data)  # the object appears only once its upload completes
        return location
    return files.write_bytes(location, data)


def write_text(location: Location, text: str) -> Path | str:
    return write_bytes(location, text.encode())


@contextmanager
def write_directory(location: Location) -> Iterator[Path | str]:
    """Yield where to write the directory ``location``: locally a temporary sibling renamed into place
    when the block ends without an error (``files.write_directory``); at a URL, which has no rename,
    ``location`` itself, emptied first of what a killed writer left there — complete only once the
    caller's last write, its marker object, is there."""
    location = as_location(location)
    if isinstance(location, Path):
        with files.write_directory(location) as tmp:
            yield tmp
        return
    remove(location)
    yield location


def tree_bytes(location: Location) -> int:
    """Total bytes of the files under a directory/prefix."""
    location = as_location(location)
    if isinstance(location, Path):
        return sum(f.stat().st_size for f in location.rglob("*") if f.is_file())
    fs, path = _fs(location)
    return int(sum(fs.sizes(fs.find(path))))


def open_group(location: Location, mode: str) -> zarr.Group:
    """The Zarr v3 group at ``location`` (local directory, or fsspec URL through Zarr's FsspecStore)."""
    import zarr

    location = as_location(location)
    if isinstance(location, Path):
        return zarr.open_group(store=str(location), mode=mode, zarr_format=3)
    from zarr.storage import FsspecStore

    return zarr.open_group(store=FsspecStore.from_url(location, read_only=mode == "r"), mode=mode, zarr_format=3)
