"""One writer, one reader (issue 44 item 6; specdraft/jsonl.py): text with U+2028, U+2029, U+0085, control
characters (no NUL), CR, non-BMP characters and an escaped lone surrogate goes through every JSON Lines writer
of specdraft — the traffic window's files, the kept held-out slices, the regression set, ingest's rejects — and
every reader reads the rows back as they were, one row a line. Before: ``ensure_ascii=False`` wrote U+2028 raw
and ``str.splitlines`` cut the row in two (bad JSON that crashed the held-out eval)."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.ingest import write_rejects
from pipelines.prompt_files import read_records
from specdraft import jsonl
from specdraft.configs.fresh import TrafficSettings
from specdraft.evaluation.questions import load_question_sets
from specdraft.freshness.traffic import keep_held_out, read_slice, read_window, regression_questions, write_window

TEXTS = ["line\u2028separator", "para\u2029graph", "next\u0085line", "ctl \x01\x07\x1b\x1f\x7f", "cr\rlf\r\n",
         "tab\tform\x0c vt\x0b fs\x1c gs\x1d rs\x1e", "non-BMP \U0001F600 \U0001D518 \U00020000", "plain ascii",
         "é ü 中文"]


def test_dumps_line_is_one_line_that_reads_back():
    rows = [{"text": t} for t in TEXTS] + [{"surrogate": "\ud800 lone"}]
    text = jsonl.dumps_rows(rows)
    assert text.count("\n") == len(rows) and len(text.splitlines()) == len(rows)  # even str.splitlines agrees
    assert "\u2028" not in text and "é ü 中文" in text and "\U0001F600" in text  # readable, nothing to split on
    data = text.encode()  # a lone surrogate is escaped: the text is UTF-8
    assert [row for _, row in jsonl.read_rows(data)] == rows


def test_every_writer_and_its_reader(tmp_path):
    root = tmp_path / "traffic"
    (root / "2026-11-26").mkdir(parents=True)
    raw = "".join(json.dumps({"messages": [{"role": "user", "content": t}]}, ensure_ascii=False) + "\n"
                  for t in TEXTS)  # a gateway that writes U+2028 raw: read as one row a line
    (root / "2026-11-26" / "gw.jsonl").write_text(raw, encoding="utf-8", newline="")
    window = read_window(TrafficSettings(path=str(root), days=1, replay=0.0, held_out=0.4))
    assert window.rejects == [] and window.held_out and window.prompts
    assert sorted(r["messages"][0]["content"] for r in window.prompts + window.held_out) == sorted(TEXTS)
    written = write_window(window, str(tmp_path / "out"))

    # prompts.jsonl: the prompt reader of ingest
    read = [record for _, record, _ in read_records(Path(written["prompts"]))]
    assert read == window.prompts
    # held_out.jsonl: the question reader of eval, and the slice reader of the gate
    questions = load_question_sets([written["held_out"]])
    assert [q["turns"][0] for q in questions] == [r["messages"][0]["content"] for r in window.held_out]
    rejects: list = []
    assert [q["turns"] for q in read_slice(written["held_out"], rejects)] == [q["turns"] for q in questions]
    assert rejects == []
    # the kept slice (written whole, as read) and the regression set built from it
    home = tmp_path / "heldout"
    kept, _ = keep_held_out(written["held_out"], home, "2026-11-26")
    assert kept.read_bytes() == Path(written["held_out"]).read_bytes()
    again, counts = regression_questions(home, "2026-11-27", None, cap=100)
    assert [q["turns"] for q in again] == [q["turns"] for q in questions] and counts["rejected"] == 0
    regression = tmp_path / "regression.jsonl"
    regression.write_text(jsonl.dumps_rows(again))  # pipelines.stages.prepare_traffic's writer
    assert [q["turns"] for q in load_question_sets([regression])] == [q["turns"] for q in questions]
    # ingest's rejects (an excerpt of a bad row, a lone surrogate escape in it)
    bad = [{"source": "x", "line": i, "reason": "bad_json", "excerpt": t} for i, t in enumerate(TEXTS + ["\udcff"])]
    path = write_rejects(tmp_path / "rejects.jsonl", bad)
    assert [row for _, row in jsonl.read_rows(Path(path).read_bytes())] == bad


def test_old_files_with_raw_separators_still_read(tmp_path):
    """Slices kept before this writer (U+2028 raw): the readers split on "\\n" only, so they read too."""
    home = tmp_path / "heldout"
    home.mkdir()
    rows = [{"question_id": i, "turns": [t]} for i, t in enumerate(TEXTS)]
    (home / "2026-11-25.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    questions, counts = regression_questions(home, "2026-11-26", None, cap=100)
    assert [q["turns"][0] for q in questions] == TEXTS and counts["rejected"] == 0
    assert [q["turns"][0] for q in load_question_sets([home / "2026-11-25.jsonl"])] == TEXTS


def test_training_metrics_read_by_the_same_rule(tmp_path):
    """``pipelines.plots.read_training_metrics`` (the curves and the replayed metrics of a finished run): the rows of a
    run killed mid-write, its cut last line left out instead of a JSONDecodeError."""
    from pipelines.plots import read_training_metrics

    rows = [{"kind": "params", "note": "a\u2028b"}, {"kind": "metrics", "step": 1, "loss": 2.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes((jsonl.dumps_rows(rows) + '{"kind": "metrics", "step": 2, "lo').encode())
    assert read_training_metrics(path) == rows
