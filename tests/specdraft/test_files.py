"""Files and directories written whole: a path holds the old content or the new one, never a mix or a temporary."""

import os
from pathlib import Path

import pytest

from specdraft import files

DEAD_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have it


def test_write_bytes_replaces_whole_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a" / "b.json"
    assert files.write_text(path, "old") == path and path.read_text() == "old"  # parents created

    def fail(tmp, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        files.write_bytes(path, b"new")
    assert path.read_text() == "old" and sorted(p.name for p in path.parent.iterdir()) == ["b.json"]
    monkeypatch.undo()
    files.write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in path.parent.iterdir()) == ["b.json"]


def test_write_directory_replaces_on_success_only(tmp_path):
    out = tmp_path / "draft"
    with files.write_directory(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".draft.tmp-") and not list(tmp.iterdir())
        (tmp / "old.txt").write_text("1")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]

    with pytest.raises(RuntimeError), files.write_directory(out) as tmp:
        (tmp / "new.txt").write_text("2")
        raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]  # left as it was
    assert [p.name for p in tmp_path.iterdir()] == ["draft"]  # no temporary left

    with files.write_directory(out) as tmp:
        (tmp / "new.txt").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["draft"]


def test_write_directory_keeps_what_a_concurrent_writer_finished(tmp_path):
    out = tmp_path / "target"
    with files.write_directory(out, keep=lambda done: (done / "DONE").is_file()) as tmp:
        (tmp / "mine.txt").write_text("late")
        out.mkdir()
        (out / "DONE").write_text("first")
    assert sorted(p.name for p in out.iterdir()) == ["DONE"]
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_remove_dead_temps_spares_live_writers_and_other_names(tmp_path):
    out = tmp_path / "target"
    dead = tmp_path / f".target.tmp-{DEAD_PID}-deadbeef"
    dead.mkdir()
    (dead / "half.bin").write_bytes(b"x")
    mine = files.temp_path(out)  # this process: alive
    mine.write_text("writing")
    other = tmp_path / f".other.tmp-{DEAD_PID}-deadbeef"
    other.write_text("not ours")
    assert files.remove_dead_temps(out) == [dead]
    assert not dead.exists() and mine.exists() and other.exists()
