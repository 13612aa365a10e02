"""Hand-off to serving (specdraft/freshness/handoff.py, issue 33 Deliver 6): the promoted draft at ``exports/current``,
replaced atomically while a reader keeps reading it, the one before kept as ``previous``; rollback swaps them
back, and ``specdraft rollback`` does it from the command line."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from flows.cli import main
import pytest

from specdraft.freshness.handoff import check_exports, exchange, publish, read_meta, rollback, stable_exports
from specdraft.outputs import OutputError, mark_output


def _draft(root: Path, version: int) -> tuple[Path, dict[str, str]]:
    draft = root / f"draft-{version}"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text(json.dumps({"version": version}))
    (draft / "model.safetensors").write_bytes(bytes([version]) * 4096)
    export = root / f"export-{version}" / "speculators"
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps({"version": version}))
    return draft, {"speculators": str(export)}


def test_publish_keeps_previous_and_rollback_swaps(tmp_path, capsys):
    exports = tmp_path / "exports"
    for version in (1, 2):
        publish(exports, *_draft(tmp_path, version), meta={"version": version})
    assert read_meta(exports / "current")["version"] == 2 and read_meta(exports / "previous")["version"] == 1
    assert json.loads((exports / "current" / "speculators" / "config.json").read_text()) == {"version": 2}
    assert stable_exports(exports) == {"speculators": str(exports.absolute() / "current" / "speculators")}
    publish(exports, *_draft(tmp_path, 3), meta={"version": 3})  # version 1 is gone, 2 is previous
    assert read_meta(exports / "previous")["version"] == 2
    # no temporaries left; the marker says whose the directory is
    assert sorted(p.name for p in exports.iterdir()) == [".specdraft-output.json", "current", "previous"]
    assert rollback(exports)["version"] == 2 and read_meta(exports / "previous")["version"] == 3
    assert main(["rollback", "--exports", str(exports)]) == 0  # the rollback undone from the command line
    assert read_meta(exports / "current")["version"] == 3
    assert "now serving version 3" in capsys.readouterr().out
    assert main(["rollback", "--exports", str(tmp_path / "nothing")]) == 1


def test_a_reader_never_sees_a_missing_or_half_written_current(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    if not exchange(a, b):  # pragma: no cover - a file system without RENAME_EXCHANGE
        import pytest

        pytest.skip("no renameat2(RENAME_EXCHANGE) here: the two-rename fallback has a microsecond gap")
    exports = tmp_path / "exports"
    publish(exports, *_draft(tmp_path / "v0", 0), meta={"version": 0})
    seen, errors, stop = set(), [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                meta = json.loads((exports / "current" / "handoff.json").read_text())
                seen.add(meta["version"])
            except (OSError, ValueError) as err:
                errors.append(repr(err))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for version in range(1, 21):
            publish(exports, *_draft(tmp_path / f"v{version}", version), meta={"version": version})
    finally:
        stop.set()
        reader.join()
    assert errors == [] and len(seen) > 1


def _users(root: Path) -> dict[str, bytes]:
    """A user's own directory holding ``current/`` and ``previous/``; returns its files' contents."""
    for name in ("current", "previous"):
        (root / name).mkdir(parents=True)
        (root / name / "notes.txt").write_text(f"the user's {name}")
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_directory_the_hand_off_did_not_write_is_refused_untouched(tmp_path, capsys):
    """A user's directory holding current/ and previous/ (issue 44 item 5): publish and rollback refuse it in one
    line and leave every file as it was; so does another command's output. Neighbours: absent, empty, a hand-off's
    own (marker), and one a hand-off wrote before the marker existed are written."""
    users = tmp_path / "users"
    before = _users(users)
    with pytest.raises(OutputError, match=r"handoff.exports=.*users is not empty and is not a hand-off directory"):
        publish(users, *_draft(tmp_path, 1), meta={"version": 1})
    with pytest.raises(OutputError, match="--exports .*users"):
        rollback(users)
    assert main(["rollback", "--exports", str(users)]) == 2 and "not a hand-off directory" in capsys.readouterr().err
    assert _files(users) == before and sorted(p.name for p in users.iterdir()) == ["current", "previous"]
    other = tmp_path / "other"
    mark_output(other, "export")
    (other / "current").mkdir()
    with pytest.raises(OutputError, match="the output of `specdraft export`"):
        check_exports(other)
    check_exports(tmp_path / "absent")  # absent, empty: the hand-off's
    (tmp_path / "empty").mkdir()
    publish(tmp_path / "empty", *_draft(tmp_path / "e", 1), meta={"version": 1})
    legacy = tmp_path / "legacy"  # written by a hand-off before the marker: current/handoff.json
    (legacy / "current").mkdir(parents=True)
    (legacy / "current" / "handoff.json").write_text(json.dumps({"version": 4}))
    publish(legacy, *_draft(tmp_path / "l", 5), meta={"version": 5})
    assert read_meta(legacy / "previous")["version"] == 4 and (legacy / ".specdraft-output.json").is_file()


def test_a_killed_hand_offs_temporaries_are_removed_by_the_next(tmp_path):
    """What a hand-off killed midway leaves (a half copy, the old current on its way to previous) is removed by
    the next hand-off or rollback; a file of the user's beside them stays."""
    exports = tmp_path / "exports"
    publish(exports, *_draft(tmp_path, 1), meta={"version": 1})
    (exports / ".current.tmp-1-deadbeef").mkdir()
    (exports / ".current.tmp-1-deadbeef" / "model.safetensors").write_bytes(b"half")
    (exports / ".previous.tmp-1-cafef00d").mkdir()
    (exports / "README.txt").write_text("the user's note")
    publish(exports, *_draft(tmp_path, 2), meta={"version": 2})
    assert sorted(p.name for p in exports.iterdir()) == [".specdraft-output.json", "README.txt", "current", "previous"]
    (exports / ".current.tmp-2-deadbeef").mkdir()
    rollback(exports)
    assert not (exports / ".current.tmp-2-deadbeef").exists() and read_meta(exports / "current")["version"] == 1
