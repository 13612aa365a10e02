"""Output directories a command owns (docs/guarantees.md): nothing lost to an ``--out``.

A command that writes a directory checks it first (``check_output``, before any work):

* an ``--out`` equal to, inside, or a parent of any of the command's inputs (``--draft``,
  ``--target``, ``--store``, ``--prompts``, ...) is refused, ``--overwrite`` or not: a command
  never deletes or mixes into its own input;
* an absent or empty ``--out`` is the command's;
* a non-empty one is the command's only when it is that same command's earlier output — a rerun,
  which resumes (``train``, ``dump``, ``regenerate``) or replaces its own files (``export``). The
  command says so with a small marker file, ``.specdraft-output.json`` (``mark_output``); outputs
  written before the marker existed are known by the files only that command writes (``own``);
* any other non-empty directory is refused unless ``overwrite``, and even then the command
  replaces only the files it writes itself: the user's other files stay (``foreign_entries``).

While a command writes a local ``--out`` it holds the directory's lock file, ``.specdraft-lock``
(``held_output``: pid, host, command), so a second run into the same directory is refused while the
first lives; a lock left by a dead process of this host is taken over with one line. ``specdraft run`` holds
its workdir's lock the same way (the CLI takes it before Prefect starts; the flow takes it too, for a
deployment's run, and finds it already this process's). A command that ends having written nothing but its
marker leaves the directory as it found it.

Paths may be object-store URLs (``specdraft/store/location.py``); containment is then compared on
the URL text.
"""

from __future__ import annotations

import fnmatch
import json
import os
import socket
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from specdraft.store import location

MARKER = ".specdraft-output.json"  # {"command": "export"}: the command whose output the directory is


class OutputError(ValueError):
    """An ``--out`` the command must not write: one of its inputs, or someone else's non-empty directory."""


def path_key(path: str | Path) -> str:
    """A comparable form: the resolved local path, or the URL without its trailing slash (two paths naming one
    directory have one key: ``a/../b``, ``./b``, a symlink to it)."""
    loc = location.as_location(path)
    return str(loc).rstrip("/") if location.is_url(loc) else str(Path(loc).expanduser().resolve())


def repeated_paths(paths: Iterable[str | Path]) -> list[tuple[str, str]]:
    """(earlier path, later path) for each path of ``paths`` naming the same directory as an earlier one
    (``path_key``): ``--store S S``, ``--store S ./S``."""
    seen: dict[str, str] = {}
    twice = []
    for path in paths:
        key = path_key(path)
        if key in seen:
            twice.append((seen[key], str(path)))
        seen.setdefault(key, str(path))
    return twice


def _contains(parent: str, child: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def refuse_own_input(out: str | Path, inputs: Mapping[str, Sequence[str | Path] | str | Path | None], *,
                     option: str = "--out") -> None:
    """Raise ``OutputError`` naming both paths when ``out`` is, is inside, or holds one of ``inputs``
    (option name -> path or paths; ``None`` and empty entries are skipped). ``option``: how the
    command names ``out`` (``workdir=`` for ``specdraft run``)."""
    o = path_key(out)
    for name, paths in inputs.items():
        if paths is None or isinstance(paths, (str, Path)):
            paths = [] if paths in (None, "") else [paths]
        for path in paths:
            p = path_key(path)
            if _contains(o, p) or _contains(p, o):
                how = "is" if o == p else ("is inside" if _contains(p, o) else "holds")
                raise OutputError(
                    f"{_named(option, out)} {how} the input {name} {path}: a command never writes over its own input "
                    "(not even with --overwrite) — choose another output directory")


def written_by(out: str | Path) -> str | None:
    """The command whose marker ``out`` holds (None: no marker, or an unreadable one)."""
    marker = location.join(location.as_location(out), MARKER)
    try:
        return json.loads(location.read_text(marker)).get("command")
    except (OSError, ValueError, AttributeError):
        return None


def _entries(out: str | Path) -> list[str]:
    return [name for name in location.list_dir(out) if name]


def check_output(
    out: str | Path,
    command: str,
    *,
    inputs: Mapping[str, Sequence[str | Path] | str | Path | None] = {},
    overwrite: bool = False,
    own: Iterable[str] = (),
    option: str = "--out",
) -> bool:
    """Refuse an ``out`` that ``command`` must not write (``OutputError``, one line naming the directory
    and ``--overwrite``, or both paths for an input); True when ``out`` is ``command``'s own earlier
    output (a rerun). Writes nothing.

    ``own``: glob patterns of the names only ``command`` writes, which mark an output written before
    the marker file existed as its own.
    """
    refuse_own_input(out, inputs, option=option)
    loc = location.as_location(out)
    if not location.is_url(loc) and Path(loc).exists() and not Path(loc).is_dir():
        raise OutputError(f"{_named(option, out)} is a file, not a directory: choose a directory")
    names = [name for name in _entries(out) if name != LOCK]  # a writer's lock: ``lock_output`` answers it
    if not names:
        return False
    if MARKER in names:
        if written_by(out) == command:
            return True
    elif any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in own):
        return True
    if overwrite:
        return False
    owner = written_by(out)
    whose = f"the output of `specdraft {owner}`" if owner else f"not an earlier `specdraft {command}` output"
    raise OutputError(
        f"{_named(option, out)} is not empty and is {whose}: refusing to write into it — choose an empty or new "
        f"directory, or pass --overwrite (replaces only the files {command} writes; the others stay)")


def _named(option: str, out: str | Path) -> str:
    """``--out DIR`` or ``workdir=DIR``: the output as the user gave it."""
    return f"{option}{out}" if option.endswith("=") else f"{option} {out}"


def mark_output(out: str | Path, command: str) -> None:
    """Create ``out`` if needed and record that ``command`` writes it (the marker file)."""
    loc = location.as_location(out)
    location.make_dirs(loc)
    if written_by(loc) != command:
        location.write_text(location.join(loc, MARKER), marker_text(command))


def marker_text(command: str) -> str:
    """The marker file's content (for a command that writes its whole directory at once)."""
    return json.dumps({"command": command}) + "\n"


def foreign_entries(out: str | Path, written: Iterable[str]) -> list[str]:
    """The names in the local directory ``out`` that a command writing ``written`` (and the marker)
    does not write: the user's files, which a replacement of ``out`` carries over."""
    mine = {*written, MARKER, LOCK}
    return [name for name in _entries(out) if name not in mine]


# --------------------------------------------------------------------------- one writer per output

LOCK = ".specdraft-lock"  # {"pid", "host", "command"}: the process writing the directory now


class OutputLocked(OutputError):
    """An ``--out`` another live process is writing now (its lock file)."""


def _lock_holder(lock: Path) -> dict | None:
    """The lock's record (None: gone, or unreadable)."""
    try:
        held = json.loads(lock.read_text())
        return held if isinstance(held, dict) else None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _take_lock(lock: Path, command: str) -> None:
    """Create ``lock`` exclusively with this process's record: written whole to a temporary file, then
    hard-linked into place (``link`` fails when the lock exists, so no reader ever sees half a record)."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command}) + "\n"
    tmp = lock.with_name(f"{lock.name}.{os.getpid()}.tmp")
    tmp.write_text(record)
    try:
        os.link(tmp, lock)
    finally:
        tmp.unlink()


def lock_output(out: str | Path, command: str) -> Path | None:
    """Take ``out``'s lock for ``command`` (creating ``out``): one writer per output directory. A lock held
    by a live process — or by one on another host, which cannot be asked — is an ``OutputLocked`` naming the
    lock file and its holder; a lock left by a dead process of this host is taken over, said in one line on
    stderr. Returns the lock file; None for an object-store URL (there is no exclusive create to lock with) and for a
    lock this process holds already (the outer holder — ``specdraft run`` around its flow — releases it)."""
    loc = location.as_location(out)
    if location.is_url(loc):
        return None
    root = Path(loc).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    lock = root / LOCK
    for _ in range(3):  # a lock released or taken over between the tries: try again
        try:
            _take_lock(lock, command)
            return lock
        except FileExistsError:
            pass
        held = _lock_holder(lock)
        if held is None:
            continue
        pid, host = int(held.get("pid", -1)), str(held.get("host", "?"))
        if pid == os.getpid() and host == socket.gethostname():
            return None  # this process holds it: a nested hold, released by the outer one
        who = f"`specdraft {held.get('command', '?')}` (pid {pid} on {host})"
        if host != socket.gethostname() or _alive(pid):
            raise OutputLocked(
                f"{out} is being written by {who}: its lock {lock} is held — wait for it to finish, or choose "
                "another --out (if that process is gone, delete the lock file)")
        print(f"specdraft {command}: taking over the stale lock {lock} of {who}, which is no longer running",
              file=sys.stderr)
        try:
            lock.unlink()
        except FileNotFoundError:
            pass
    raise OutputLocked(f"{out}: could not take its lock {lock} (other processes keep taking it)")


def unlock_output(lock: Path | None) -> None:
    """Release a lock this process holds (``lock_output``'s return); one another process took over is left."""
    if lock is not None and (_lock_holder(lock) or {}).get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


@contextmanager
def held_output(out: str | Path, command: str) -> Iterator[None]:
    """``out`` locked for ``command`` while the block runs (``lock_output``), and afterwards left as it was
    when the block wrote nothing there: a command refused (or failed) before its work removes the marker it
    wrote and the directory it created, so a refused run leaves no ``--out`` behind."""
    loc = location.as_location(out)
    local = None if location.is_url(loc) else Path(loc).expanduser()
    existed = local is not None and local.exists()
    before = {p.name for p in local.iterdir()} if existed and local.is_dir() else set()
    lock = lock_output(out, command)
    try:
        yield
    finally:
        unlock_output(lock)
        if local is not None and local.is_dir() and MARKER not in before:
            if {p.name for p in local.iterdir()} <= before | {MARKER}:  # nothing written but the marker
                (local / MARKER).unlink(missing_ok=True)
                if not existed:
                    local.rmdir()
