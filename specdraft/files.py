"""Local files and directories written whole: a temporary sibling, then a rename into place.

docs/store.md "Object stores" (the commit rules; local paths are the rename half of them): a path that
exists holds a complete file or directory, because it is written under a hidden temporary name
in the same directory and renamed into place (a POSIX rename is atomic) only once complete. A
temporary is named ``.<name>.tmp-<pid>-<8 hex>``: readers skip hidden names, and the pid says
whose it is (``remove_dead_temps``). Every temp-file-then-rename of the project is one of the two
writers here; ``specdraft/store/location.py`` adds the object-store URL case (one PUT, no rename)
on top of them.

What they write is readable like any model checkout, whatever the umask: directories 0755, files
0644 (an engine or a reader running as another user loads an exported draft, a store, a toy
target); write permissions stay the owner's only.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

READABLE_DIR = 0o755
READABLE_FILE = 0o644


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
        os.chmod(tmp, READABLE_FILE | (tmp.stat().st_mode & 0o111))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode())


@contextmanager
def write_directory(
    out_dir: str | Path, *, keep: Callable[[Path], bool] | None = None, carry: Iterable[str] = ()
) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out_dir`` to fill; when the block ends without an error
    it replaces ``out_dir``, on any error it is removed and ``out_dir`` is left as it was.

    An existing ``out_dir`` is renamed aside (to another temporary name) before the temporary is
    renamed in, then deleted, so ``out_dir`` is never a mix of old and new files. ``keep(out_dir)``,
    asked when the block ends and ``out_dir`` exists: True keeps that directory and drops the new
    one (a concurrent writer finished the same work first). ``carry``: names in the existing
    ``out_dir`` that are not this writer's (``specdraft.outputs.foreign_entries``): hard-linked
    (copied where links fail) into the new directory before the swap, so they stay as they were.
    The new directory and what it holds are made readable (0755 / 0644) before it is renamed in.
    A symlink ``out_dir`` (a mounted serving volume) stays a link: the directory it points to is replaced.
    """
    out = Path(os.path.realpath(out_dir))  # a symlinked out_dir: written where it points, the link kept
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    tmp.mkdir()
    try:
        yield tmp
        make_readable(tmp)
        for name in carry:
            if (out / name).exists() or (out / name).is_symlink():
                if (tmp / name).exists():
                    raise FileExistsError(f"{out / name}: the writer of {out} writes this name too; not carrying it")
                _link_tree(out / name, tmp / name)
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


def make_readable(root: str | Path) -> None:
    """Give ``root`` and everything under it read access for all: directories 0755, files 0644
    (execute bits kept); symlinks are left alone."""
    root = Path(root)
    os.chmod(root, READABLE_DIR)
    for parent, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, READABLE_DIR)
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, READABLE_FILE | (os.stat(path).st_mode & 0o111))


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as a copy of ``src`` made of hard links (the same files, not new ones), modes kept."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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
