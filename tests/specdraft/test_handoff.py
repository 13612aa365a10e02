"""Hand-off to serving (specdraft/handoff.py, issue 33 Deliver 6): the promoted draft at ``exports/current``,
replaced atomically while a reader keeps reading it, the one before kept as ``previous``; rollback swaps them
back, and ``specdraft rollback`` does it from the command line."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from flows.cli import main
from specdraft.handoff import exchange, publish, read_meta, rollback, stable_exports


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
    assert sorted(p.name for p in exports.iterdir()) == ["current", "previous"]  # no temporaries left
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
