"""Output directories a command owns (README "Guarantees"): nothing lost to an ``--out``.

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

Paths may be object-store URLs (``specdraft/store/location.py``); containment is then compared on
the URL text.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from specdraft.store import location

MARKER = ".specdraft-output.json"  # {"command": "export"}: the command whose output the directory is


class OutputError(ValueError):
    """An ``--out`` the command must not write: one of its inputs, or someone else's non-empty directory."""


def _key(path: str | Path) -> str:
    """A comparable form: the resolved local path, or the URL without its trailing slash."""
    loc = location.as_location(path)
    return str(loc).rstrip("/") if location.is_url(loc) else str(Path(loc).expanduser().resolve())


def _contains(parent: str, child: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def refuse_own_input(out: str | Path, inputs: Mapping[str, Sequence[str | Path] | str | Path | None], *,
                     option: str = "--out") -> None:
    """Raise ``OutputError`` naming both paths when ``out`` is, is inside, or holds one of ``inputs``
    (option name -> path or paths; ``None`` and empty entries are skipped). ``option``: how the
    command names ``out`` (``workdir=`` for ``specdraft run``)."""
    o = _key(out)
    for name, paths in inputs.items():
        if paths is None or isinstance(paths, (str, Path)):
            paths = [] if paths in (None, "") else [paths]
        for path in paths:
            p = _key(path)
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
    names = _entries(out)
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
    mine = {*written, MARKER}
    return [name for name in _entries(out) if name not in mine]
