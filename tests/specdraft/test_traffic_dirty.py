"""Dirty traffic never stops a night (issue 44 item 7): a bad byte, a bad line, a bad day folder, an odd file, an
empty or missing directory — each counted as a reject with its reason beside the good rows next to it, and the
window read; only a window with nothing usable left is one line (ConfigError: exit 2)."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import os
from pathlib import Path

import pytest

from specdraft.config import ConfigError
from specdraft.configs.fresh import TrafficSettings
from specdraft.freshness.traffic import dated_days, read_window

DAY, BEFORE = "2026-11-26", "2026-11-25"


def row(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}, ensure_ascii=False).encode()


def day(root: Path, name: str, files: dict[str, bytes]) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for file, data in files.items():
        (folder / file).write_bytes(data)
    return folder


def window(root: Path, **kw):
    return read_window(TrafficSettings(path=str(root), days=kw.pop("days", 2), replay=0.0, held_out=0.0, **kw))


def reasons(w) -> list[tuple[str, int | None, str]]:
    return [(Path(r["file"]).name, r["line"], r["reason"]) for r in w.rejects]


def prompts(w) -> list[str]:
    return sorted(r["messages"][0]["content"] for r in w.prompts)


def test_a_bad_byte_rejects_its_line_and_its_neighbours_are_read(tmp_path):
    # line 2 holds a byte that is no UTF-8 (Latin-1 é); lines 1 and 3 around it, and a line of UTF-8 é, are read
    data = b"\n".join([row("before"), b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', row("after"),
                       row("café ok")]) + b"\n"
    day(tmp_path, DAY, {"gw.jsonl": data})
    w = window(tmp_path)
    assert prompts(w) == ["after", "before", "café ok"]
    assert reasons(w) == [("gw.jsonl", 2, "not_utf8")] and "0xe9" in w.rejects[0]["detail"]
    assert w.counts["rejected.not_utf8"] == 1 and w.counts["read"] == 3


def test_bad_lines_each_rejected_with_their_reason(tmp_path):
    lines = [row("good"), b'{"messages": [{"role": "user", "content": "cut off',  # truncated: the log's last write
             b"[1, 2]", b'{"messages": []}', b'{"messages": [{"role": "bot", "content": "x"}]}',
             b'{"messages": [{"role": "user", "content": "\\ud800 lone"}]}',  # an escaped lone surrogate
             b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 pair"}]}',  # an escaped pair: text
             b'{"messages": [{"role": "user", "content": "q"}], "response": "text"}', b"", b"   ", row("last")]
    day(tmp_path, DAY, {"gw.jsonl": b"\r\n".join(lines)})  # CRLF line ends: not part of the JSON
    w = window(tmp_path)
    assert prompts(w) == ["good", "last", "\U0001F600 pair"]
    assert reasons(w) == [("gw.jsonl", 2, "bad_json"), ("gw.jsonl", 3, "not_object"), ("gw.jsonl", 4, "no_messages"),
                          ("gw.jsonl", 5, "bad_message"), ("gw.jsonl", 6, "not_utf8"),
                          ("gw.jsonl", 8, "bad_response")]  # blank lines 9-10: no rows, no rejects
    assert "Unterminated string" in w.rejects[0]["detail"]


def test_a_line_split_only_at_newline(tmp_path):
    # U+2028, U+2029 and U+0085 as raw characters inside a row (another tool wrote them): text, not line ends
    text = "a\u2028b\u2029c\u0085d"
    day(tmp_path, DAY, {"gw.jsonl": row(text) + b"\n" + row("next") + b"\n"})
    w = window(tmp_path)
    assert prompts(w) == sorted([text, "next"]) and w.rejects == []


def test_log_files_by_name(tmp_path):
    gz = gzip.compress(row("from gz") + b"\n")
    folder = day(tmp_path, DAY, {"a.jsonl": row("plain") + b"\n", "B.JSONL": row("upper case") + b"\n",
                                 "c.jsonl.gz": gz, "d.JSONL.GZ": gzip.compress(row("gz upper") + b"\n"),
                                 "e.jsonl.gz": gz[: len(gz) // 2],  # a gzip cut short: rejected whole
                                 "f.json": row("not a log suffix"), "notes.txt": b"hello",
                                 ".g.jsonl.tmp-1-abc": row("a writer's temporary")})
    os.symlink(folder / "gone.jsonl", folder / "h.jsonl")  # a dangling symlink
    (folder / "i.jsonl").mkdir()  # a folder named like a log
    w = window(tmp_path)
    assert prompts(w) == ["from gz", "gz upper", "plain", "upper case"]
    assert reasons(w) == [("e.jsonl.gz", None, "bad_gzip"), ("f.json", None, "unsupported_file"),
                          ("h.jsonl", None, "unreadable"), ("i.jsonl", None, "unreadable"),
                          ("notes.txt", None, "unsupported_file")]
    assert "FileNotFoundError" in w.rejects[2]["detail"]


def test_day_folders_by_name(tmp_path):
    today = dt.datetime.now(dt.timezone.utc).date()
    names = {"2026-13-01": "bad month", "2026-02-30": "bad day", "logs": "odd name", "2026-11-5": "odd name too",
             (today + dt.timedelta(days=2)).isoformat(): "future",
             (today + dt.timedelta(days=1)).isoformat(): "tomorrow", today.isoformat(): "today"}
    for name, text in names.items():
        day(tmp_path, name, {"gw.jsonl": row(text) + b"\n"})
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README.md").write_text("our logs")
    rejects: list[dict] = []
    present = dated_days(str(tmp_path), rejects)
    assert present == [today.isoformat(), (today + dt.timedelta(days=1)).isoformat()]  # a day of slack
    by_name = {Path(r["file"]).name: r["reason"] for r in rejects}
    assert by_name == {"2026-13-01": "bad_day", "2026-02-30": "bad_day", "logs": "not_a_day",
                       "2026-11-5": "not_a_day", "README.md": "not_a_day",
                       (today + dt.timedelta(days=2)).isoformat(): "future_day"}
    w = window(tmp_path)  # the window ends on the newest real day: tomorrow (a gateway east of UTC)
    assert prompts(w) == ["today", "tomorrow"] and w.counts["rejected"] == 6
    assert w.counts["rejected.bad_day"] == 2 and w.counts["rejected.future_day"] == 1


def test_empty_and_missing_days_are_warnings_and_the_night_goes_on(tmp_path):
    day(tmp_path, DAY, {"gw.jsonl": row("only row") + b"\n"})
    day(tmp_path, BEFORE, {"gw.jsonl": b"", "gw2.jsonl": b"\n\n"})  # an empty day: files with no row
    w = window(tmp_path, days=3)
    assert prompts(w) == ["only row"] and w.rejects == []
    assert w.warnings == [f"traffic: day 2026-11-24 has no folder under {tmp_path}",
                          f"traffic: day {BEFORE} has no usable row under {tmp_path}"]


def test_nothing_usable_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        window(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"no YYYY-MM-DD day folders$"):  # an empty directory
        window(tmp_path)
    (tmp_path / "logs").mkdir()  # no day folder at all: the odd names said
    with pytest.raises(ConfigError, match=r"no YYYY-MM-DD day folders \(1 rejected \(not_a_day 1\)"):
        window(tmp_path)
    day(tmp_path, DAY, {"gw.jsonl": b"\xff\xfe garbage\n{cut", "notes.txt": b""})
    with pytest.raises(ConfigError, match=r"no usable row in the window 2026-11-26 back 2 days \(1 day folders; "
                                          r"4 rejected \(bad_json 1, not_a_day 1, not_utf8 1, unsupported_file 1\)"):
        window(tmp_path)
    day(tmp_path, DAY, {"gw2.jsonl": row("one good row")})  # its neighbour: one good row and the night goes on
    assert prompts(window(tmp_path)) == ["one good row"]
