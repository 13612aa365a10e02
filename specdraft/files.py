"""Local files and directories written whole: a temporary sibling, then a rename into place.

README "Object stores" (the commit rules; local paths are the rename half of them): a path that
exists holds a complete file or directory, because it is written under a hidden temporary name
in the same directory and renamed into place (a POSIX rename is atomic) only once complete. A
temporary is named ``.<name>.tmp-<pid>-<8 hex>``: readers skip hidden names, and the pid says
whose it is (``remove_dead_temps``). Every temp-file-then-rename of the project is one of the two
writers here; ``specdraft/store/location.py`` adds the object-store URL case (one PUT, no rename)
on top of them.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def temp_path(path: str | Path) -> Path:
    """A unique hidden sibling of ``path`` to write into: ``.<name>.tmp-<pid>-<8 hex>``."""
    path = Path(path)
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write the file ``path`` (parents created) so that it is either absent, as before, or complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode())


@contextmanager
def write_directory(out_dir: str | Path, *, keep: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out_dir`` to fill; when the block ends without an error
    it replaces ``out_dir``, on any error it is removed and ``out_dir`` is left as it was.

    An existing ``out_dir`` is renamed aside (to another temporary name) before the temporary is
    renamed in, then deleted, so ``out_dir`` is never a mix of old and new files. ``keep(out_dir)``,
    asked when the block ends and ``out_dir`` exists: True keeps that directory and drops the new
    one (a concurrent writer finished the same work first).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    tmp.mkdir()
    try:
        yield tmp
        if not out.exists():
            tmp.rename(out)
        elif keep is None or not keep(out):
            old = temp_path(out)
            out.rename(old)
            try:
                tmp.rename(out)
            finally:
                shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_dead_temps(path: str | Path) -> list[Path]:
    """Delete the temporaries of ``path`` whose writing process is gone (killed writers); returns them.

    The pid in a temporary's name is only meaningful on this machine: use it where one machine
    writes ``path`` (not a directory shared by the nodes of a cluster).
    """
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            remove(tmp)
            removed.append(tmp)
    return removed


def remove(path: str | Path) -> None:
    """Delete a file or a whole directory; nothing when absent."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
