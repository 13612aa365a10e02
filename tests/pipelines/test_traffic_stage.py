"""``data.traffic`` in the run (issue 33, Deliver 1): prepare reads the window into the run's prompt files, the
served model's logged answers are a file of their own that the regenerate stage ingests as they are (no
target, no Ray), and the counts reach the record the summary and MLflow read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.conversations import read_conversations
from pipelines.stages import prepare, regenerate_file
from pipelines.configs import RunConfig
from flows.preflight import check_run
from specdraft.config import ConfigError, from_dict
from specdraft.freshness.record import RegressionCounts
from tests.specdraft.test_traffic import SERVED, write_traffic


def test_prepare_reads_the_window_and_the_reused_rows_are_not_regenerated(tmp_path):
    root = write_traffic(tmp_path / "traffic")
    questions = Path(__file__).resolve().parents[2] / "configs" / "data" / "toy_questions.jsonl"  # every run evaluates
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "data": {"traffic": {
        "path": str(root), "days": 4, "served_model": SERVED, "replay": 0.0, "held_out": 0.0}},
        "eval": {"questions": [str(questions)]}})
    check_run(cfg)  # data.prompts may be empty when data.traffic.path is set
    prepared = prepare(cfg)
    assert [(Path(p.path).name, p.reuse) for p in prepared.prompts] == [("prompts.jsonl", False),
                                                                        ("reused.jsonl", True)]
    counts = prepared.traffic.counts
    assert (counts["reused"], counts["to_regenerate"], counts["rejected"], counts["deduplicated"]) == (2, 3, 3, 1)
    assert prepared.traffic.warnings == [f"traffic: day 2026-11-24 has no folder under {root}"]
    reused = regenerate_file(cfg, prepared, prepared.prompts[1])  # would need Ray and the target if regenerated
    rows = read_conversations([reused.conversations])
    assert sorted(r["messages"][-1]["content"] for r in rows) == ["four", "licnep"]
    assert reused.summary["rows_out"] == 2
    again = prepare(cfg)  # the same logs: the same files, the same keys (a rerun skips finished stages)
    assert [p.digest for p in again.prompts] == [p.digest for p in prepared.prompts]
    assert regenerate_file(cfg, again, again.prompts[1]).skipped


def test_run_refuses_missing_traffic(tmp_path):
    with pytest.raises(ConfigError, match="data.traffic.path"):
        check_run(from_dict(RunConfig, {"workdir": str(tmp_path / "runs"),
                                         "data": {"traffic": {"path": str(tmp_path / "nowhere")}}}))
    with pytest.raises(ConfigError, match="data.traffic.days"):
        from_dict(RunConfig, {"data": {"traffic": {"days": 0}}})


def test_each_window_keeps_its_held_out_slice_and_the_gate_reads_the_earlier_ones(tmp_path):
    from pipelines.summary import traffic_rows

    root = write_traffic(tmp_path / "traffic")
    for day, n in (("2026-11-21", 30), ("2026-11-22", 30)):
        (root / day).mkdir()
        (root / day / "gateway-0.jsonl").write_text("".join(
            json.dumps({"messages": [{"role": "user", "content": f"{day} question {i}"}]}) + "\n" for i in range(n)))

    def night(end: str, **gate):
        cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "gate": {"enabled": True, **gate},
                                    "eval": {"questions": [str(root / "2026-11-20" / "gateway-0.jsonl")]},
                                    "data": {"traffic": {"path": str(root), "days": 1, "end": end, "replay": 0.0,
                                                         "held_out": 0.3}}})
        return prepare(cfg).traffic

    first = night("2026-11-21")
    home = tmp_path / "runs" / "traffic" / "heldout"
    assert (home / "2026-11-21.jsonl").read_text() == Path(first.files.held_out).read_text()
    assert first.regression.questions == 0 and first.files.regression == ""
    assert any("alone (no earlier traffic window" in text for _, text in traffic_rows({"traffic": first.to_dict()}))
    second = night("2026-11-22", regression_max_questions=4)
    held = len(Path(first.files.held_out).read_text().splitlines())
    assert held > 4 and second.regression == RegressionCounts(questions=4, windows=["2026-11-21"], over_cap=held - 4,
                                                              rejected=0, eval_sets=1, max_questions=4)
    regression = [json.loads(line) for line in Path(second.files.regression).read_text().splitlines()]
    assert len(regression) == 4 and all(q["turns"][0].startswith("2026-11-21 question") for q in regression)
    assert sorted(p.name for p in home.iterdir()) == ["2026-11-21.jsonl", "2026-11-22.jsonl"]
    [(label, text)] = [row for row in traffic_rows({"traffic": second.to_dict()}) if row[0] == "gate"]
    assert text.startswith("regression set: the 1 eval set (eval.questions) + 4 questions from 1 earlier window's")
    # a kept slice cut short and with a byte that is no UTF-8 (issue 44 item 7): its lines counted, the night goes on
    with open(home / "2026-11-21.jsonl", "ab") as fh:
        fh.write(b'{"question_id": "x", "turns": ["caf\xe9"]}\n{"question_id": "y", "tur')
    third = night("2026-11-23", regression_max_questions=1000)
    assert third.regression.rejected == 2 and third.regression.questions == held + len(
        Path(second.files.held_out).read_text().splitlines())
    assert [r["reason"] for r in third.regression.rejects] == ["not_utf8", "bad_json"]
    assert any("2 lines of the kept held-out slices are not in the regression set" in w for w in third.warnings)



def test_shipped_mode_keeps_another_models_logged_answers_and_counts_the_unanswered(tmp_path):
    from pipelines.summary import mode_note, traffic_rows

    root = write_traffic(tmp_path / "traffic")
    settings = {"path": str(root), "days": 4, "served_model": SERVED, "replay": 0.0, "held_out": 0.0}
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "data": {"traffic": settings},
                                "regenerate": {"mode": "shipped"}})
    prepared = prepare(cfg)
    counts = prepared.traffic.counts
    assert (counts["to_regenerate"], counts["other_model_answers"], counts["reused"]) == (3, 1, 2)
    assert "(1 with another model's logged answer" in traffic_rows(prepared.to_dict())[0][1]
    shipped = regenerate_file(cfg, prepared, prepared.prompts[0])  # no Ray, no target generation
    assert [r["messages"][-1]["content"] for r in read_conversations([shipped.conversations])] == ["eighty"]
    s = shipped.summary
    assert (s["rows_shipped"], s["rows_regenerated"], s["rows_no_answer"]) == (1, 0, 2)
    assert mode_note(s) == " (shipped: 0 regenerated, 1 as shipped, 2 with no answer)"
    # target mode: the window's prompts carry no answer (its files and keys as before the modes)
    target = prepare(from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "data": {"traffic": settings}}))
    assert "other_model_answers" not in target.traffic.counts
    assert all(json.loads(line)["messages"][-1]["role"] == "user"
               for line in Path(target.prompts[0].path).read_text().splitlines())
