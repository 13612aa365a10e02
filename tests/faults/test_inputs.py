"""Fault injection, issue 22 class 4: input changed or dropped without a count.

Every input row that is rejected, changed or skipped is counted with its reason in the stage's
summary and its rejects file, and so is every file a prompt directory holds that is not read.
Real files, real Ray (the session's local cluster), the real local S3 server for the parts a
changed prompt rewrites.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.conversations import read_conversations
from pipelines.ingest import ingest, load_conversations
from specdraft.store import location
from specdraft.toy.conversations import generate_conversations


def prompt_rows(n: int, seed: int = 11) -> list[dict]:
    """Toy conversations (the toy target's own vocabulary) as OpenAI-style prompt records with ids."""
    return [{"id": f"q{i}", "messages": m} for i, m in enumerate(generate_conversations(n, seed))]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path | str) -> list[dict]:
    return [json.loads(line) for line in location.read_text(path).splitlines()]


# --- ingest: bytes that are not UTF-8 ----------------------------------------------------------


def test_non_utf8_bytes_reject_the_row_and_say_where(tmp_path):
    good = json.dumps({"id": "ok", "prompt": "caf\u00e9 is fine"}).encode()
    bad = b'{"id": "bad", "prompt": "caf\xe9 in latin-1"}'  # \xe9 alone is not UTF-8
    (tmp_path / "p.jsonl").write_bytes(good + b"\n" + bad + b"\n")
    rows, summary = ingest(tmp_path / "p.jsonl", rejects_path=tmp_path / "rejects.jsonl")
    assert [r["id"] for r in rows] == ["p:ok"] and rows[0]["messages"][0]["content"] == "caf\u00e9 is fine"
    assert summary["rejects_by_reason"] == {"bad_encoding": 1} and summary["rows_in"] == 2
    (reject,) = read_jsonl(tmp_path / "rejects.jsonl")
    assert reject["line"] == 2 and reject["reason"] == "bad_encoding" and "0xe9" in reject["detail"]
    assert "\\xe9" in reject["excerpt"]  # the raw bytes shown, escaped, in a UTF-8 file
    assert all("\ufffd" not in m["content"] for r in rows for m in r["messages"])


def test_non_utf8_bytes_in_a_json_array_and_an_unpaired_surrogate_reject_their_row(tmp_path):
    records = [b'{"id": "a", "prompt": "fine"}', b'{"id": "b", "prompt": "bro\xffken"}',
               b'{"id": "c", "prompt": "lone \\ud800 surrogate"}']
    (tmp_path / "arr.json").write_bytes(b"[" + b", ".join(records) + b"]")
    rows, summary = ingest(tmp_path / "arr.json", rejects_path=tmp_path / "r.jsonl")
    assert [r["id"] for r in rows] == ["arr:a"]
    assert [(r["index"], r["reason"]) for r in read_jsonl(tmp_path / "r.jsonl")] == [(1, "bad_encoding"),
                                                                                      (2, "bad_encoding")]
    assert summary["rows_in"] == summary["rows_out"] + summary["rejected"] == 3


# --- ingest: files of a prompt directory ---------------------------------------------------------


def test_upper_case_suffixes_are_read_and_other_files_are_counted_as_skipped(tmp_path):
    write_jsonl(tmp_path / "d" / "lower.jsonl", [{"id": "1", "prompt": "one"}])
    write_jsonl(tmp_path / "d" / "UPPER.JSONL", [{"id": "2", "prompt": "two"}])
    (tmp_path / "d" / "Mixed.Json").write_text(json.dumps([{"id": "3", "prompt": "three"}]))
    (tmp_path / "d" / "notes.txt").write_text("not prompts")
    (tmp_path / "d" / "more.jsonl.bak").write_text('{"id": "4", "prompt": "four"}\n')
    (tmp_path / "d" / "gone.jsonl").symlink_to(tmp_path / "moved.jsonl")  # a dangling symlink (issue 44 item 7)
    rows, summary = ingest(tmp_path / "d", rejects_path=tmp_path / "rejects.jsonl")
    assert sorted(r["id"] for r in rows) == ["Mixed:3", "UPPER:2", "lower:1"]
    skipped = {Path(s["source"]).name: s["reason"] for s in summary["skipped_files"]}
    assert skipped == {"notes.txt": "unsupported_file", "more.jsonl.bak": "unsupported_file",
                       "gone.jsonl": "unreadable"}
    assert summary["files_skipped"] == 3
    files = [r for r in read_jsonl(tmp_path / "rejects.jsonl") if r["kind"] == "file"]
    assert sorted(Path(r["source"]).name for r in files) == ["gone.jsonl", "more.jsonl.bak", "notes.txt"]
    assert all(r["reason"] == "unsupported_file" and repr(Path(r["source"]).suffix) in r["detail"] for r in files
               if r["reason"] != "unreadable")


def test_a_prompt_directory_given_to_dump_is_ingested_not_read_as_empty(tmp_path):
    write_jsonl(tmp_path / "prompts" / "a.jsonl", [{"id": "1", "prompt": "one"}, {"id": "2", "prompt": "two"}])
    rows, ingested = load_conversations([tmp_path / "prompts"])
    assert [r["id"] for r in rows] == ["a:1", "a:2"] and ingested["rows_out"] == 2


def test_rows_changed_by_normalization_are_counted(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"id": "1", "prompt": "line\r\nbreak"}, {"id": "2", "prompt": " padded "},
                                       {"id": "3", "prompt": "as is"}])
    rows, summary = ingest(tmp_path / "p.jsonl")
    assert len(rows) == 3 and summary["rows_changed"] == 2
    assert summary["changes_by_reason"] == {"crlf_to_lf": 1, "whitespace_stripped": 1}


# --- regenerate: a prompt whose text changed under the same id --------------------------------------


def test_a_changed_prompt_is_answered_again_once_and_counted(local_ray, tiny_toy_target, tmp_path):
    from pipelines.regenerate import regenerate
    from pipelines.configs import RegenerateConfig

    records = prompt_rows(4)
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    out = tmp_path / "out"
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=2)
    first = regenerate(tiny_toy_target, prompts, out, cfg, progress=False)
    assert first["rows_out"] == 4 and first["rows_changed"] == 0
    before = {r["id"]: r for r in read_conversations(out)}
    untouched = {p: p.read_bytes() for p in out.glob("part-*.parquet")
                 if "p:q0" not in pq.read_table(p, columns=["id"]).column("id").to_pylist()}

    new_text = "what is the color of the sky at night"
    records[0] = {"id": "q0", "messages": [{"role": "user", "content": new_text}]}  # same id, other prompt
    write_jsonl(prompts, records)
    second = regenerate(tiny_toy_target, prompts, out, cfg, progress=False)
    assert second["rows_changed"] == 1 and second["changed_ids"] == ["p:q0"]
    assert second["rows_in"] == 1 and second["rows_out"] == 1 and second["rows_skipped"] == 3
    assert second["rows_total"] == 4
    after = read_conversations(out)
    assert sorted(r["id"] for r in after) == ["p:q0", "p:q1", "p:q2", "p:q3"]  # answered once, no duplicate
    by_id = {r["id"]: r for r in after}
    assert by_id["p:q0"]["messages"][0] == {"role": "user", "content": new_text}
    assert all(by_id[i] == before[i] for i in ("p:q1", "p:q2", "p:q3"))  # the other answers kept as they were
    assert all(p.read_bytes() == data for p, data in untouched.items())  # their parts not rewritten

    third = regenerate(tiny_toy_target, prompts, out, cfg, progress=False)
    assert third["rows_in"] == 0 and third["rows_changed"] == 0 and third["rows_skipped"] == 4

    records.pop()  # a prompt removed from the set: its answer is kept and counted
    write_jsonl(prompts, records)
    fourth = regenerate(tiny_toy_target, prompts, out, cfg, progress=False)
    assert fourth["rows_in"] == 0 and fourth["rows_only_in_output"] == 1 and fourth["only_in_output_ids"] == ["p:q3"]


def test_a_changed_prompts_old_answer_leaves_its_part_at_a_url(s3_bucket):
    """The part rewrite a changed prompt needs, on the real local S3 server: the stale row leaves its
    part (the others and their digests stay), a part left empty is deleted."""
    from pipelines.conversations import done_prompts, drop_answers, prompt_digest, write_part

    out = f"{s3_bucket}/regenerated"
    prompts = [{"id": f"t:{i}", "source": "t", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    answered = [{**p, "messages": p["messages"] + [{"role": "assistant", "content": f"a{i}"}]}
                for i, p in enumerate(prompts)]
    write_part(out, prompts[:2], answered[:2])
    write_part(out, prompts[2:], answered[2:])
    done = done_prompts(out)
    assert {i: d for i, (d, _) in done.items()} == {p["id"]: prompt_digest(p["messages"]) for p in prompts}
    drop_answers(done, ["t:0", "t:2"])
    assert read_conversations(out) == [answered[1]]
    assert sum(n.startswith("part-") for n in location.list_dir(out)) == 1
    assert {i: d for i, (d, _) in done_prompts(out).items()} == {"t:1": prompt_digest(prompts[1]["messages"])}


# --- dump: what ingest rejected is recorded in the store ------------------------------------------


def test_dump_records_ingest_rejects_in_the_store(local_ray, tiny_toy_target, tmp_path, capsys):
    from flows.cli import main

    answered = [{"id": f"c{i}", "messages": m} for i, m in enumerate(generate_conversations(3, 5))]
    raw = tmp_path / "convs.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in answered) + "{not json\n")
    out = tmp_path / "store"
    assert main(["dump", "--target", str(tiny_toy_target), "--prompts", str(raw), "--out", str(out), "--quiet",
                 "samples_per_shard=4", "max_length=96"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ingest"]["rejects_by_reason"] == {"bad_json": 1} and printed["rows_out"] == 3
    (reject,) = read_jsonl(out / "rejects.jsonl")
    assert reject["reason"] == "bad_json" and reject["line"] == 4 and reject["excerpt"] == "{not json"
    recorded = json.loads((out / "summary.json").read_text())
    assert recorded["ingest"]["rejected"] == 1 and recorded["ingest"]["rejects_path"] == str(out / "rejects.jsonl")


@pytest.mark.parametrize("name", ["prompts.JSONL", "prompts.Jsonl"])
def test_an_upper_case_suffix_named_directly_is_read(tmp_path, name):
    write_jsonl(tmp_path / name, [{"id": "1", "prompt": "one"}])
    rows, summary = ingest(tmp_path / name)
    assert [r["id"] for r in rows] == ["prompts:1"] and summary["rejected"] == 0
