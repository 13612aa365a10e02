"""The traffic window (specdraft/freshness/traffic.py, issue 33 Deliver 1): three dated days, a malformed line, a
duplicate across days, a missing day, reused logged answers and replay of an earlier day — every row counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.config import ConfigError, from_dict, parse_overrides
from specdraft.configs.fresh import TrafficSettings
from specdraft.freshness.traffic import keep_held_out, read_window, regression_questions, write_window

SERVED = "toy-target"


def _row(text: str, answer: str | None = None, model: str = SERVED) -> str:
    row = {"messages": [{"role": "user", "content": text}], "created": 1764201600}
    if answer is not None:
        row["response"] = {"model": model, "choices": [{"message": {"role": "assistant", "content": answer}}]}
    return json.dumps(row)


def write_traffic(root: Path) -> Path:
    """Days 11-20 .. 11-26: 11-24 missing; 11-26 holds a malformed line and a duplicate of 11-25."""
    days = {
        "2026-11-20": [_row(f"old question {i}") for i in range(10)],  # replay pool
        "2026-11-25": [_row("what is 2 + 2?", "4"), _row("sort 3, 1, 2")],
        "2026-11-26": [_row("what is 2 + 2?", "four"),  # a duplicate (of 11-25's prompt) with another answer
                       "{not json",
                       _row("reverse pencil", "licnep"),  # answered by the served model: reused
                       _row("spell 80", "eighty", model="another-model"),  # another model: regenerated
                       json.dumps({"messages": [{"role": "assistant", "content": "hi"}]})],  # no user turn
        "2026-11-23": [_row("count to three")],
    }
    for day, lines in days.items():
        (root / day).mkdir(parents=True)
        (root / day / "gateway-0.jsonl").write_text("\n".join(lines) + "\n")
    (root / "2026-11-26" / "notes.txt").write_text("not a log")
    return root


def test_window_counts_every_row(tmp_path):
    root = write_traffic(tmp_path / "traffic")
    settings = TrafficSettings(path=str(root), days=4, served_model=SERVED, replay=1.0, replay_days=7,
                               held_out=0.0)
    window = read_window(settings)
    assert window.days == ["2026-11-26", "2026-11-25", "2026-11-23"]
    assert window.replay_days == ["2026-11-20"]
    assert window.warnings == [f"traffic: day 2026-11-24 has no folder under {root}"]
    assert [(Path(r["file"]).name, r["line"], r["reason"]) for r in window.rejects] == [
        ("gateway-0.jsonl", 2, "bad_json"), ("gateway-0.jsonl", 5, "no_user_turn"),
        ("notes.txt", None, "unsupported_file")]  # a file that is no log: counted, not read
    assert "not JSON" in window.rejects[0]["detail"] and "no user turn" in window.rejects[1]["detail"]
    c = window.counts
    # window: 11-26 (3 good rows) + 11-25 (2, one a duplicate) + 11-23 (1) = 5 unique; replay: 5 of 10
    assert (c["read"], c["rejected"], c["deduplicated"], c["over_cap"]) == (16, 3, 1, 0)
    assert (c["rejected.bad_json"], c["rejected.no_user_turn"], c["rejected.unsupported_file"]) == (1, 1, 1)
    assert c["read_replay_days"] == 10  # of the 16 read: the replay day's rows (the window's: 6)
    assert (c["reused"], c["replayed"], c["replay_pool"], c["dropped_replay"]) == (2, 5, 10, 5)
    assert c["to_regenerate"] == 3 + 5  # sort, spell 80, count to three + the replayed rows
    assert c["read"] == c["to_regenerate"] + c["reused"] + c["held_out"] + c["deduplicated"] + c["over_cap"] \
        + c["dropped_replay"] + c["replay_reused"] + c["replay_held_out"]
    reused = {r["messages"][0]["content"]: r["messages"][-1]["content"] for r in window.reused}
    assert reused == {"what is 2 + 2?": "four", "reverse pencil": "licnep"}  # the newest day's answer wins
    assert sum(r["messages"][0]["content"].startswith("old question") for r in window.prompts) == 5


def test_cap_held_out_and_files(tmp_path):
    root = write_traffic(tmp_path / "traffic")
    window = read_window(TrafficSettings(path=str(root), days=4, max_conversations=2, replay=0.0, held_out=0.5))
    c = window.counts
    assert c["over_cap"] == 3 and c["replayed"] == 0 and c["reused"] == 0  # no served_model: nothing reused
    assert c["held_out"] + c["to_regenerate"] == 2
    again = read_window(TrafficSettings(path=str(root), days=4, max_conversations=2, replay=0.0, held_out=0.5))
    assert again.held_out == window.held_out  # the split is stable from night to night
    written = write_window(window, str(tmp_path / "out"))
    saved = json.loads(Path(written["window"]).read_text())
    assert saved["counts"] == c and saved["warnings"] == window.warnings
    assert len(Path(written["rejects"]).read_text().split("\n")) == 3 + 1  # the last line ends too
    if window.held_out:
        question = json.loads(Path(written["held_out"]).read_text().splitlines()[0])
        assert set(question) == {"question_id", "category", "turns"}


def test_end_day_and_bad_settings(tmp_path):
    root = write_traffic(tmp_path / "traffic")
    window = read_window(TrafficSettings(path=str(root), days=1, end="2026-11-25", replay=0.0, held_out=0.0))
    assert window.days == ["2026-11-25"] and window.counts["to_regenerate"] == 2
    # the override as typed (data.traffic.end=2026-11-25): YAML reads it as a date, the setting keeps the day
    assert from_dict(TrafficSettings, parse_overrides(["end=2026-11-25"])).end == "2026-11-25"
    with pytest.raises(ConfigError, match="data.traffic.end"):  # a YAML timestamp is not a day
        from_dict(TrafficSettings, parse_overrides(["end=2026-11-25 10:00:00"]))
    with pytest.raises(ConfigError, match="data.traffic.end"):
        TrafficSettings(end="26/11/2026")
    with pytest.raises(ConfigError, match="data.traffic.held_out"):
        from_dict(TrafficSettings, {"held_out": 0.9})
    with pytest.raises(ConfigError, match="no YYYY-MM-DD day folders .1 rejected .not_a_day 1.; the first: .*traffic"):
        read_window(TrafficSettings(path=str(tmp_path)))  # tmp_path holds only the folder traffic/


def test_window_from_s3(tmp_path, s3_bucket):
    import fsspec

    root = write_traffic(tmp_path / "traffic")
    fs = fsspec.filesystem("s3")
    for path in (p for p in root.rglob("*") if p.is_file()):  # notes.txt too: rejected on both
        fs.pipe_file(f"{s3_bucket}/logs/{path.relative_to(root)}", path.read_bytes())
    local = read_window(TrafficSettings(path=str(root), days=4, served_model=SERVED, held_out=0.0))
    remote = read_window(TrafficSettings(path=f"{s3_bucket}/logs", days=4, served_model=SERVED, held_out=0.0))
    assert remote.counts == local.counts and remote.reused == local.reused
    assert [(r["line"], r["reason"]) for r in remote.rejects] == [(r["line"], r["reason"]) for r in local.rejects]


def _questions(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"question_id": t, "category": "traffic", "turns": [t]}) + "\n"
                            for t in texts))
    return str(path)


def test_held_out_slices_are_kept_and_earlier_ones_make_the_regression_set(tmp_path):
    home = tmp_path / "heldout"
    for end, texts in (("2026-11-23", ["a", "b", "c"]), ("2026-11-24", ["c", "d", "e"]),
                       ("2026-11-25", ["e", "f"])):
        kept, warning = keep_held_out(_questions(tmp_path / f"{end}.jsonl", texts), home, end)
        assert kept == home / f"{end}.jsonl" and warning == ""
    assert keep_held_out(_questions(tmp_path / "same.jsonl", ["e", "f"]), home, "2026-11-25") == (
        home / "2026-11-25.jsonl", "")  # a rerun of the same night: the same slice
    kept, warning = keep_held_out(_questions(tmp_path / "other.jsonl", ["z"]), home, "2026-11-25")
    assert "differs" in warning and kept.read_text() == (tmp_path / "2026-11-25.jsonl").read_text()  # not rewritten
    # night 11-26: the earlier windows' slices, less this window's held-out questions ("f"), each question once
    now = _questions(tmp_path / "now.jsonl", ["f", "g"])
    questions, counts = regression_questions(home, "2026-11-26", now, cap=100)
    assert sorted(q["turns"][0] for q in questions) == ["a", "b", "c", "d", "e"]
    assert counts == {"questions": 5, "windows": ["2026-11-25", "2026-11-24", "2026-11-23"], "over_cap": 0,
                      "rejected": 0}
    questions, counts = regression_questions(home, "2026-11-26", now, cap=3)  # one from each window in turn
    assert [q["turns"][0] for q in questions] == ["e", "c", "a"] and counts["over_cap"] == 2
    assert regression_questions(home, "2026-11-23", None, cap=100)[1] == {"questions": 0, "windows": [],
                                                                          "over_cap": 0, "rejected": 0}  # none earlier


def test_replay_never_draws_a_row_held_out_in_its_own_window(tmp_path):
    root = write_traffic(tmp_path / "traffic")
    settings = TrafficSettings(path=str(root), days=4, replay=1.0, replay_days=7, held_out=0.3)
    earlier = read_window(TrafficSettings(path=str(root), days=1, end="2026-11-20", replay=0.0, held_out=0.3))
    window = read_window(settings)
    held = {r["messages"][0]["content"] for r in earlier.held_out}
    assert held and window.counts["replay_held_out"] == len(held)
    assert not held & {r["messages"][0]["content"] for r in window.prompts + window.reused}
