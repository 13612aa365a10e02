"""Hand-off to serving: the promoted draft at a stable place a server reads,
``<exports>/current``, replaced atomically, the one before kept as ``<exports>/previous`` for ``specdraft rollback``.

``current`` is written whole under a hidden sibling name (``specdraft.files.temp_path``) and then exchanged
with the old ``current`` in one ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+, glibc 2.28+): a server reading
``current`` sees the old directory or the new one, never a half-written checkpoint and never no directory.
Where the exchange is not available (another OS, a file system without it) two renames replace it, and
``current`` is absent between them for microseconds (still never half-written). The old directory then
becomes ``previous`` (the one before it is deleted). Rollback exchanges ``current`` and ``previous``.

``current`` holds ``draft/`` (the draft directory: config.json + model.safetensors), one folder per serving
export (``speculators/``, ``vllm/``, ...) and ``handoff.json`` (version, source, time). A vLLM server loads
its draft once at start: after a hand-off it must be restarted to serve the new one (the summary prints the
command, pointing at ``current``, so the same command serves whatever ``current`` holds).

The hand-off directory is an output like any other (``specdraft.outputs``, docs/guarantees.md): it holds the
marker ``.specdraft-output.json`` of the command ``handoff``, and a directory the hand-off did not write (not
empty, no such marker, no ``current/handoff.json`` of a hand-off from before the marker) is refused —
``publish`` and ``rollback`` never rename or delete a user's ``current/`` or ``previous/``. One hand-off at a
time writes it (its lock), and the hidden temporaries of a killed one are removed by the next.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from specdraft import files
from specdraft.outputs import MARKER, OutputError, check_output, lock_output, mark_output, unlock_output, written_by

CURRENT, PREVIOUS, META = "current", "previous", "handoff.json"
COMMAND = "handoff"  # the hand-off directory's owner in its marker file (``specdraft.outputs``)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: str | Path, b: str | Path) -> bool:
    """Swap the two existing paths ``a`` and ``b`` atomically; False (nothing changed) where the system
    cannot (no ``renameat2``, or the file system refuses the flag)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), f"{a} <-> {b}")


def _replace(new: Path, current: Path) -> Path | None:
    """Put the complete directory ``new`` at ``current``; returns where the old ``current`` is now (None: none)."""
    if not current.exists():
        new.rename(current)
        return None
    if exchange(new, current):
        return new  # ``new`` now holds the old directory
    old = files.temp_path(current)
    current.rename(old)
    new.rename(current)
    return old


def _retire(old: Path, previous: Path) -> None:
    """``old`` becomes ``previous``; the one before it is deleted."""
    if previous.exists():
        aside = files.temp_path(previous)
        previous.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    old.rename(previous)


def check_exports(root: str | Path, option: str = "handoff.exports=") -> None:
    """Refuse (``specdraft.outputs.OutputError``, one line naming ``option`` and the directory) a hand-off
    directory the hand-off did not write: one that is not absent, empty, marked ``handoff``, or — written
    before the marker existed — holding ``current/handoff.json``. Writes nothing."""
    root = Path(root)
    if (root / CURRENT / META).is_file() and not (root / MARKER).is_file():
        return  # a hand-off's, from before the marker: ``publish`` marks it
    try:
        check_output(root, COMMAND, option=option)
    except OutputError:
        if not root.is_dir():
            raise  # a file: said as for every output
        owner = written_by(root)
        whose = f"the output of `specdraft {owner}`" if owner else "not a hand-off directory (no current/handoff.json)"
        sep = "" if option.endswith("=") else " "
        raise OutputError(
            f"{option}{sep}{root} is not empty and is {whose}: the hand-off never renames or deletes what it did not "
            f"write — point {option.rstrip('=')} at an empty or new directory (or one a hand-off wrote)") from None


def _clear_temporaries(root: Path) -> None:
    """Remove what a killed hand-off or rollback left (``.current.tmp-*``, ``.previous.tmp-*``: a half copy, or
    the old ``current`` on its way to ``previous``); called holding the lock, so no live writer owns them."""
    for stale in [*root.glob(f".{CURRENT}.tmp-*"), *root.glob(f".{PREVIOUS}.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def publish(root: str | Path, draft_dir: str | Path, exports: dict[str, str], meta: dict[str, Any]) -> Path:
    """Copy the draft and its exports (format -> directory) into ``<root>/current`` (the old one becomes
    ``previous``); ``meta`` (version, model, target...) is written as ``handoff.json``. Returns ``current``."""
    root = Path(root)
    check_exports(root)
    lock = lock_output(root, COMMAND)
    current, tmp = root / CURRENT, files.temp_path(root / CURRENT)
    try:
        mark_output(root, COMMAND)
        _clear_temporaries(root)
        tmp.mkdir()
        shutil.copytree(draft_dir, tmp / "draft")
        for fmt, path in sorted(exports.items()):
            shutil.copytree(path, tmp / fmt)
        (tmp / META).write_text(json.dumps({**meta, "published": time.time(), "draft": str(draft_dir),
                                            "exports": sorted(exports)}, indent=2))
        files.make_readable(tmp)
        old = _replace(tmp, current)
        if old is not None:
            _retire(old, root / PREVIOUS)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        unlock_output(lock)
    return current


def rollback(root: str | Path) -> dict[str, Any]:
    """Serve ``previous`` again: ``current`` and ``previous`` exchanged (the rolled-back draft stays as
    ``previous``, so a second rollback undoes the first). Returns the ``handoff.json`` now current.
    ``FileNotFoundError`` when there is nothing to roll back to; ``OutputError`` for a directory the hand-off
    did not write (``check_exports``)."""
    root = Path(root)
    current, previous = root / CURRENT, root / PREVIOUS
    if not previous.is_dir() or not current.is_dir():
        raise FileNotFoundError(f"{root}: no {CURRENT}/ and {PREVIOUS}/ to swap (nothing handed off twice yet)")
    check_exports(root, option="--exports")
    lock = lock_output(root, COMMAND)
    try:
        _clear_temporaries(root)
        if not exchange(current, previous):
            aside = files.temp_path(current)
            current.rename(aside)
            previous.rename(current)
            aside.rename(previous)
    finally:
        unlock_output(lock)
    return read_meta(current)


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META
    return json.loads(path.read_text()) if path.is_file() else {}


def stable_exports(root: str | Path) -> dict[str, str]:
    """format -> ``<root>/current/<format>``: the paths a serve command names, whatever ``current`` holds."""
    current = Path(root).absolute() / CURRENT
    return {fmt: str(current / fmt) for fmt in read_meta(current).get("exports", [])}
