"""Issue 31 item 6: empty inputs succeeded with nothing done. ``regenerate`` with no conversation to answer and
``eval`` with no question now exit 2 with one line naming the input (a ``ConfigError``), unless the setting
``allow_empty=true`` says an empty run is meant; a question with an empty turn is not decoded as a question, it is
listed in the report's ``questions_skipped`` with its reason. The real CLI on the shipped toy target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from specdraft.config import ConfigError
from specdraft.evaluation.questions import load_question_sets
from specdraft.models import build_draft, draft_config_from_target, save_draft
from specdraft.targets.identity import target_record
from specdraft.targets.loading import load_target_config, load_target_heads
from specdraft.toy.build import PREBUILT_DIR


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    """The shipped toy target and a (random) draft made for it."""
    if not (PREBUILT_DIR / "model.safetensors").is_file():
        pytest.skip("the shipped toy target is not in this checkout")
    heads = load_target_heads(PREBUILT_DIR)
    config = draft_config_from_target(load_target_config(PREBUILT_DIR), "beagle", **target_record(PREBUILT_DIR))
    draft = save_draft(build_draft(config, heads.embed, heads.lm_head), tmp_path_factory.mktemp("empty") / "draft")
    return {"target": PREBUILT_DIR, "draft": draft}


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith(f"specdraft {command}")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_regenerate_with_no_conversation_exits_2_unless_allow_empty(toy, tmp_path, capsys):
    """Today: exit 0, "rows in 0, out 0", nothing said."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("")
    argv = ["regenerate", "--target", str(toy["target"]), "--prompts", str(prompts), "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 2
    line = one_line(capsys, "regenerate")
    assert str(prompts) in line and "no conversation" in line and "allow_empty=true" in line
    assert not list((tmp_path / "a").glob("part-*.parquet"))
    assert main([*argv, "--out", str(tmp_path / "b"), "allow_empty=true"]) == 0  # meant: done, with nothing


def test_eval_with_no_question_exits_2_before_a_model_loads_unless_allow_empty(toy, tmp_path, capsys):
    """Today: exit 0 with tau null and no warning."""
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n")
    argv = ["eval", "--target", str(toy["target"]), "--draft", str(toy["draft"]), "--questions", str(questions),
            "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "a" / "report.json")]) == 2
    line = one_line(capsys, "eval")
    assert str(questions) in line and "no question" in line and "allow_empty=true" in line
    assert not (tmp_path / "a" / "report.json").exists()
    assert main([*argv, "--out", str(tmp_path / "b" / "report.json"), "allow_empty=true"]) == 0
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["overall"]["tau"] is None and report["questions_skipped"] == []


def test_a_question_with_an_empty_turn_is_skipped_with_its_reason(toy, tmp_path, capsys):
    """Today: the empty turns are rendered and decoded as if they were questions."""
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": 7, "category": "x", "turns": ["   "]},
            {"question_id": 8, "category": "x", "turns": ["What is 2 + 3?", ""]},
            {"question_id": 9, "category": "x", "turns": ["What is 2 + 3?"]}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    skipped: list[dict] = []
    kept = load_question_sets([questions], skipped=skipped)
    assert [q["question_id"] for q in kept] == [9] and [q["index"] for q in kept] == [0]
    assert [(s["question_id"], s["reason"]) for s in skipped] == [(7, "empty_turn"), (8, "empty_turn")]
    assert skipped[1]["detail"] == "turn 1 is empty"
    assert main(["eval", "--target", str(toy["target"]), "--draft", str(toy["draft"]), "--questions", str(questions),
                 "--out", str(tmp_path / "report.json"), "--quiet", "workers=1", "decode.max_new_tokens=4",
                 "pld.enabled=false"]) == 0, capsys.readouterr().err[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert {r["question_id"] for r in report["records"]} == {9}
    assert [s["question_id"] for s in report["questions_skipped"]] == [7, 8]
    assert report["question_kinds"] == {"q": {"turns": 3}}  # read and counted by kind, the skipped ones too
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ConfigError, match="1 skipped"):  # only empty questions: nothing to evaluate
        load_question_sets([blank])


def test_eval_of_questions_in_no_format_or_of_garbage_exits_2_in_one_line(toy, tmp_path, capsys):
    """Issue 44 item 3: a row in no known question format was a 20-line traceback and exit 1; a file of binary
    garbage a UnicodeDecodeError. Now one line naming the file, the row and its keys, exit 2, before a model loads."""
    argv = ["eval", "--target", str(toy["target"]), "--draft", str(toy["draft"]), "--quiet", "--out",
            str(tmp_path / "report.json"), "--questions"]
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"query": "What is 2 + 2?", "answer": "4"}) + "\n")
    assert main([*argv, str(questions)]) == 2
    assert "q.jsonl line 1: no question: keys ['answer', 'query']" in one_line(capsys, "eval")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(bytes(range(128, 256)) + b"\n{cut")
    assert main([*argv, str(garbage)]) == 2
    assert "no question to evaluate (2 skipped: ['bad_json', 'not_utf8'])" in one_line(capsys, "eval")
    assert not (tmp_path / "report.json").exists()
