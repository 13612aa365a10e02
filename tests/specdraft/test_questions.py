"""Question files as users have them (issue 44 items 3 and 7; specdraft/evaluation/questions.py): MT-Bench
``turns``, chat ``messages``, GSM8K ``question``, Alpaca ``instruction`` (+ ``input``), HumanEval ``prompt`` —
read and counted by kind; a row in none of them is one line naming the file, the row and its keys (exit 2);
a line that is no UTF-8 or no JSON is skipped with its reason, its neighbours read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.config import ConfigError
from specdraft.evaluation.questions import describe_kinds, load_question_sets, read_questions


def write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


FORMATS = {
    "mt_bench": ([{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}],
                 "turns", [["Write a poem.", "Shorter."]], [81]),
    "gsm8k": ([{"question": "Janet has 3 ducks...", "answer": "#### 3"}], "question", [["Janet has 3 ducks..."]],
              [None]),
    "alpaca": ([{"instruction": "Translate.", "input": "bonjour", "output": "hello"},
                {"instruction": "Name a colour.", "input": "", "output": "red"}], "instruction",
               [["Translate.\n\nbonjour"], ["Name a colour."]], [None, None]),
    "humaneval": ([{"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "..."}], "prompt",
                  [["def f(x):\n"]], ["HumanEval/0"]),
    "chat": ([{"id": "c1", "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Hello"},
                                        {"role": "user", "content": "Bye"}]}], "messages", [["Hi", "Bye"]], ["c1"]),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_is_read_and_counted_by_kind(tmp_path, name):
    rows, kind, turns, ids = FORMATS[name]
    questions = read_questions(write(tmp_path / f"{name}.jsonl", rows))
    assert [q["turns"] for q in questions] == turns and {q["kind"] for q in questions} == {kind}
    assert [q["question_id"] for q in questions] == ids


def test_formats_mixed_over_files_and_as_a_json_list(tmp_path):
    files = [write(tmp_path / f"{name}.jsonl", FORMATS[name][0]) for name in FORMATS]
    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps([{"turns": ["a"]}, {"prompt": "b"}]))
    kinds: dict = {}
    questions = load_question_sets([*files, listed], kinds=kinds)
    assert [q["index"] for q in questions] == list(range(8))
    assert kinds == {"mt_bench": {"turns": 1}, "gsm8k": {"question": 1}, "alpaca": {"instruction": 2},
                     "humaneval": {"prompt": 1}, "chat": {"messages": 1}, "listed": {"turns": 1, "prompt": 1}}
    assert describe_kinds({"mt_bench": {"turns": 80}}) == "mt_bench: 80 questions (turns 80)"
    assert describe_kinds({"listed": {"turns": 1, "prompt": 1}}) == "listed: 2 questions (prompt 1, turns 1)"
    assert [q["question_id"] for q in questions][:3] == [81, 1, 2]  # no id: the question's global number


@pytest.mark.parametrize("rows, said", [
    ([{"question_id": 1, "turns": ["ok"]}, {"text": "x", "label": 1}],
     r"q.jsonl line 2: no question: keys \['label', 'text'\]; expected a row with one of 'turns'"),
    ([{"turns": ["ok"]}, [1, 2]], r"q.jsonl line 2: no question: a JSON list, not an object"),
    ([{"turns": []}], r"q.jsonl line 1: 'turns' needs a non-empty list of strings"),
    ([{"turns": "one string"}], r"q.jsonl line 1: 'turns' needs a non-empty list of strings"),
    ([{"question": 3}], r"q.jsonl line 1: 'question' is int, expected a string"),
    ([{"instruction": "x", "input": ["a"]}], r"q.jsonl line 1: 'input' is list, expected a string"),
    ([{"messages": [{"role": "assistant", "content": "hi"}]}], r"q.jsonl line 1: 'messages' has no user turn"),
    ([{"messages": "hi"}], r"q.jsonl line 1: 'messages' needs a list"),
])
def test_a_row_in_no_format_is_one_line_naming_file_row_and_keys(tmp_path, rows, said):
    with pytest.raises(ConfigError, match=said):
        load_question_sets([write(tmp_path / "q.jsonl", rows)])


def test_a_json_list_row_in_no_format_names_its_index(tmp_path):
    path = tmp_path / "q.json"
    path.write_text(json.dumps([{"turns": ["a"]}, {"query": "b"}]))
    with pytest.raises(ConfigError, match=r"q.json row 1: no question: keys \['query'\]"):
        read_questions(path)
    path.write_text('[{"turns": ["a"]}, {"tur')  # a JSON list cut short: one line, no partial read
    with pytest.raises(ConfigError, match=r"q.json: not a JSON list \(JSONDecodeError"):
        read_questions(path)


def test_bad_lines_are_skipped_with_their_reason_and_neighbours_read(tmp_path):
    path = tmp_path / "held_out.jsonl"
    good = [json.dumps({"question_id": i, "turns": [f"q{i}"]}).encode() for i in range(3)]
    path.write_bytes(b"\n".join([good[0], b'{"question_id": 9, "turns": ["caf\xe9"]}', good[1],
                                 b'{"question_id": 10, "turns": ["cut', b"", good[2]]) + b"\n")
    skipped: list = []
    questions = load_question_sets([path], skipped=skipped)
    assert [q["question_id"] for q in questions] == [0, 1, 2]
    assert [(s["line"], s["reason"]) for s in skipped] == [(2, "not_utf8"), (4, "bad_json")]
    assert all(s["dataset"] == "held_out" and s["file"] == str(path) for s in skipped)


def test_a_file_of_garbage_is_one_line(tmp_path):
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(bytes(range(128, 256)) * 4 + b"\n\x89PNG\r\n\x1a\n{{")
    with pytest.raises(ConfigError, match=r"garbage.jsonl: no question to evaluate \(4 skipped: "
                                          r"\['bad_json', 'not_utf8'\]\)"):
        load_question_sets([garbage])
    good = write(tmp_path / "good.jsonl", [{"turns": ["fine"]}])  # beside a good file: the good one is evaluated
    skipped: list = []
    assert [q["dataset"] for q in load_question_sets([garbage, good], skipped=skipped)] == ["good"]
    assert [(s["line"], s["reason"]) for s in skipped] == [(1, "not_utf8"), (2, "not_utf8"), (3, "bad_json"),
                                                           (4, "bad_json")]
    with pytest.raises(ConfigError, match=r"--questions .*absent.jsonl: cannot be read \(FileNotFoundError"):
        load_question_sets([tmp_path / "absent.jsonl"])
