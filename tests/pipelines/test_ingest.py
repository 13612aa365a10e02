"""Ingest: every prompt format, the shared data files, a malformed corpus fully reported, dedup."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.conversations import SCHEMA, check_messages, read_conversations, write_conversations
from pipelines.ingest import ingest
from pipelines.configs import IngestConfig
from pipelines.prompt_files import expand_inputs, list_inputs

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sharegpt(i: int, turns: int = 2) -> dict:
    conv = []
    for t in range(turns):
        conv += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": f"answer {i}.{t}"}]
    return {"id": f"sg{i}", "conversations": conv}


def test_sharegpt_json_and_jsonl(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([sharegpt(0), sharegpt(1, turns=1)]))
    write_jsonl(tmp_path / "b.jsonl", [{**sharegpt(2), "conversations": [
        {"from": "system", "value": "Be nice."},
        {"from": "user", "value": "hi"}, {"from": "chatgpt", "value": "hello"},
        {"from": "Human", "value": "again"}, {"from": "bard", "value": "yes"},
    ]}])
    rows, summary = ingest([tmp_path / "a.json", tmp_path / "b.jsonl"])
    assert [r["id"] for r in rows] == ["a:sg0", "a:sg1", "b:sg2"]
    assert [r["source"] for r in rows] == ["a", "a", "b"]
    assert rows[0]["messages"] == [
        {"role": "user", "content": "question 0.0"}, {"role": "assistant", "content": "answer 0.0"},
        {"role": "user", "content": "question 0.1"}, {"role": "assistant", "content": "answer 0.1"},
    ]
    assert [m["role"] for m in rows[2]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert summary["rows_in"] == 3 and summary["rows_out"] == 3 and summary["rejected"] == 0


def test_openai_messages_mt_bench_and_humaneval(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                      {"role": "assistant", "content": "A"}]},
        {"id": 7, "messages": [{"role": "user", "content": "only a question"}]},
    ])
    write_jsonl(tmp_path / "mtb.jsonl", [{"question_id": 81, "category": "writing", "turns": ["first", "second"]}])
    write_jsonl(tmp_path / "he.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\r\n    pass\r\n"}])
    rows, summary = ingest(tmp_path)  # a directory: its files, sorted
    by_id = {r["id"]: r for r in rows}
    first = next(r for r in rows if r["source"] == "chat" and r["id"] != "chat:7")
    assert first["id"].startswith("chat:") and len(first["id"]) == len("chat:") + 16  # sha256 prefix
    assert by_id["chat:7"]["messages"] == [{"role": "user", "content": "only a question"}]
    assert by_id["mtb:81"]["messages"] == [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]
    assert by_id["he:HumanEval/0"]["messages"] == [{"role": "user", "content": "def f():\n    pass"}]
    assert summary["rows_by_source"] == {"chat": 2, "he": 1, "mtb": 1}


def test_parquet_in_either_schema_and_our_own_round_trip(tmp_path):
    records = [sharegpt(0), sharegpt(1)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "sg.parquet")
    pq.write_table(pa.Table.from_pylist([
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    ]), tmp_path / "oa.parquet")
    rows, summary = ingest([tmp_path / "sg.parquet", tmp_path / "oa.parquet"])
    assert [r["id"] for r in rows][:2] == ["sg:sg0", "sg:sg1"] and rows[2]["source"] == "oa"
    assert summary["rejected"] == 0
    # our own output read back as input keeps its ids and sources
    write_conversations(tmp_path / "out" / "rows.parquet", rows)
    again, summary = ingest(tmp_path / "out" / "rows.parquet")
    assert again == rows and summary["rejected"] == 0
    assert read_conversations([tmp_path / "out"]) == rows


def test_globs_directories_and_missing_inputs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "d" / "x.jsonl", [sharegpt(0)])
    write_jsonl(tmp_path / "d" / "sub" / "y.jsonl", [sharegpt(1)])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    assert [p.name for p in expand_inputs(tmp_path / "d")] == ["y.jsonl", "x.jsonl"]  # sorted paths
    assert [p.name for p in expand_inputs(str(tmp_path / "d" / "**" / "*.jsonl"))] == ["y.jsonl", "x.jsonl"]
    files = expand_inputs([tmp_path / "d" / "x.jsonl", str(tmp_path / "d" / "*.jsonl")])
    assert [p.name for p in files] == ["x.jsonl"]  # no repeats
    with pytest.raises(FileNotFoundError):
        expand_inputs(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError):
        expand_inputs(str(tmp_path / "*.parquet"))
    with pytest.raises(ValueError, match="unsupported"):
        expand_inputs(tmp_path / "d" / "notes.txt")
    files, skipped = list_inputs(tmp_path / "d")  # what a directory holds besides prompt files is reported
    assert [p.name for p in files] == ["y.jsonl", "x.jsonl"]
    assert [(Path(s["source"]).name, s["kind"], s["reason"]) for s in skipped] == [("notes.txt", "file", "unsupported_file")]


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared data not available")
def test_shared_data_files(tmp_path):
    rows, summary = ingest(SHARED, rejects_path=tmp_path / "rejects.jsonl")
    assert summary["rows_in"] == summary["rows_out"] + summary["rejected"]
    counts = summary["rows_by_source"]
    assert counts["mt_bench"] == 80 and counts["humaneval"] == 164
    assert counts["sharegpt_sample"] + summary["rejected"] == 500
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows)
    mt = by_id["mt_bench:81"]["messages"]
    assert [m["role"] for m in mt] == ["user", "user"] and mt[0]["content"].startswith("Compose an engaging")
    he = by_id["humaneval:HumanEval/0"]["messages"]
    assert len(he) == 1 and he[0]["content"].startswith("from typing import List")
    sg = by_id["sharegpt_sample:identity_0"]["messages"]
    assert sg[0] == {"role": "user", "content": "Who are you?"} and sg[1]["role"] == "assistant"
    assert all(check_messages(r["messages"]) is None for r in rows)
    # ids are stable: a second ingest gives the same rows
    assert ingest(SHARED)[0] == rows


BAD = [  # (raw JSONL line, expected reason)
    ('{"id": "x", "conversations": [{"from": "human", "value": "hi"}', "bad_json"),
    ('[1, 2, 3]', "not_an_object"),
    ('{"id": "nofields", "text": "hello"}', "missing_field"),
    ('{"conversations": "not a list"}', "bad_type"),
    ('{"conversations": [{"from": "human"}]}', "missing_field"),
    ('{"conversations": [{"from": "human", "value": 42}]}', "bad_type"),
    ('{"conversations": ["just text"]}', "bad_type"),
    ('{"conversations": []}', "empty"),
    ('{"conversations": [{"from": "human", "value": "   "}]}', "empty"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}', "empty"),
    ('{"conversations": [{"from": "tool", "value": "x"}]}', "unknown_role"),
    ('{"messages": [{"role": "function", "content": "x"}]}', "unknown_role"),
    ('{"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]}', "non_alternating"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}, '
     '{"from": "gpt", "value": "b"}]}', "non_alternating"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}', "non_alternating"),
    ('{"messages": [{"role": "system", "content": "only system"}]}', "empty"),
    ('{"turns": ["ok", 5]}', "bad_type"),
    ('{"prompt": ""}', "empty"),
    ('{"prompt": "' + "x" * 500 + '"}', "too_long"),
    ('{"turns": ["1", "2", "3", "4"]}', "too_many_turns"),
    ('{"id": {"nested": 1}, "prompt": "p"}', "bad_type"),
    ('{"id": "g1", "prompt": "dup content"}', None),  # kept
    ('{"id": "g2", "prompt": "  dup content\\r\\n"}', "duplicate"),
    ('{"id": "g1", "prompt": "other content"}', "duplicate_id"),
    ('"a string"', "not_an_object"),
]


def test_malformed_corpus_is_fully_reported(tmp_path):
    lines = []
    for raw, _ in BAD:
        lines += [raw, ""]  # blank lines are not rows
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    rejects_path = tmp_path / "rej" / "rejects.jsonl"
    rows, summary = ingest(tmp_path / "bad.jsonl", IngestConfig(max_chars=400, max_turns=3), rejects_path)

    expected = [(2 * i + 1, reason) for i, (_, reason) in enumerate(BAD) if reason is not None]
    rejects = [json.loads(line) for line in rejects_path.read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects] == expected
    assert all(r["source"] == str(tmp_path / "bad.jsonl") and r["index"] is None for r in rejects)
    assert all(r["detail"] and r["excerpt"] == BAD[(r["line"] - 1) // 2][0][:300] for r in rejects)
    assert [r["id"] for r in rows] == ["bad:g1"]
    assert summary["rows_in"] == len(BAD) and summary["rows_out"] == 1 and summary["rejected"] == len(BAD) - 1
    counts = {}
    for _, reason in expected:
        counts[reason] = counts.get(reason, 0) + 1
    assert summary["rejects_by_reason"] == dict(sorted(counts.items()))
    assert summary["duplicates"] == 1


def test_bad_rows_in_a_json_array_are_reported_by_index(tmp_path):
    (tmp_path / "arr.json").write_text(json.dumps([sharegpt(0), {"conversations": []}, 3, sharegpt(0)]))
    rows, summary = ingest(tmp_path / "arr.json", rejects_path=tmp_path / "r.jsonl")
    rejects = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["index"], r["reason"]) for r in rejects] == [(1, "empty"), (2, "not_an_object"), (3, "duplicate")]
    assert len(rows) == 1 and summary["rows_in"] == 4


def test_json_file_holding_jsonl_is_read_line_by_line(tmp_path):
    write_jsonl(tmp_path / "misnamed.json", [sharegpt(0), "{broken", sharegpt(1)])
    rows, summary = ingest(tmp_path / "misnamed.json")
    assert len(rows) == 2 and summary["rejects_by_reason"] == {"bad_json": 1}


def test_dedup_by_normalized_content_across_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [sharegpt(0), {"conversations": [
        {"from": "human", "value": "question 1.0"}, {"from": "gpt", "value": "different answer"}]}])
    write_jsonl(tmp_path / "b.jsonl", [
        {"id": "other", "conversations": [  # same as a.jsonl's sg0 up to whitespace and role spelling
            {"from": "user", "value": " question 0.0\r\n"}, {"from": "assistant", "value": "answer 0.0 "},
            {"from": "human", "value": "question 0.1"}, {"from": "chatgpt", "value": "answer 0.1"}]},
        {"conversations": [{"from": "human", "value": "question 1.0"}, {"from": "gpt", "value": "answer 1.0"}]},
    ])
    rows, summary = ingest(tmp_path)
    assert len(rows) == 3 and summary["duplicates"] == 1
    rows, summary = ingest(tmp_path, IngestConfig(dedup="prompts"))  # same user turns -> one prompt
    assert len(rows) == 2 and summary["duplicates"] == 2
    rows, summary = ingest(tmp_path, IngestConfig(dedup="none"))
    assert len(rows) == 4 and summary["rejected"] == 0


def test_hash_ids_are_stable_and_content_based(tmp_path):
    record = {"messages": [{"role": "user", "content": "same"}]}
    write_jsonl(tmp_path / "p.jsonl", [record])
    (tmp_path / "elsewhere").mkdir()
    write_jsonl(tmp_path / "elsewhere" / "p.jsonl", [{"messages": [{"role": "user", "content": " same "}]}])
    first = ingest(tmp_path / "p.jsonl")[0][0]["id"]
    assert first == ingest(tmp_path / "elsewhere" / "p.jsonl")[0][0]["id"]
    write_jsonl(tmp_path / "q.jsonl", [record])
    assert ingest(tmp_path / "q.jsonl")[0][0]["id"] == "q" + first[1:]


def test_conversation_file_io_and_shapes(tmp_path):
    rows = [{"id": "a", "source": "s", "messages": [{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": ""}]}]
    path = write_conversations(tmp_path / "c.parquet", rows)
    assert pq.read_schema(path).equals(SCHEMA, check_metadata=False)
    assert read_conversations(path) == rows
    assert [p.name for p in tmp_path.iterdir()] == ["c.parquet"]  # no temp file left
    assert check_messages(rows[0]["messages"], complete=True) is None  # an empty answer is an answer
    assert check_messages(rows[0]["messages"])[0] == "empty"  # but not an ingestable dataset turn
    assert check_messages([{"role": "user", "content": "q"}], complete=True)[0] == "non_alternating"
    assert check_messages([{"role": "user", "content": "q"}, {"role": "user", "content": "r"}]) is None
    with pytest.raises(FileNotFoundError):
        read_conversations(tmp_path / "missing")
