"""Prompt files as they ship (docs/store.md "JSON as it ships"): which files a
prompt input names (files, directories, globs, a packaged set's name such as ``sharegpt``) and their records, row by
row, for ``pipelines.ingest`` to normalize.

* JSONL: one record a line (a line ends at ``\\n`` only, ``specdraft.jsonl``: U+2028 in a record is text); blank
  lines are not rows; a UTF-8 byte-order mark is not part of the text.
* JSON: an array is read record by record through a bounded buffer (``read_json_array``), so ShareGPT's 125 MB
  file is never held as several copies; a file cut off mid-record gives every complete record and one
  ``truncated`` reject naming the byte offset; anything else is one document, or JSONL misnamed.
* Parquet: row batches; a file that cannot be read is an ``InputError`` naming it (exit 2), never a partial read.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specdraft import jsonl
from specdraft.config import ConfigError
from specdraft.packaged import resolve_prompt_inputs

SUFFIXES = (".json", ".jsonl", ".parquet")  # matched in any case


class InputError(ConfigError):
    """An input file that cannot be read at all (a Parquet file cut short or corrupt): one line naming it,
    exit 2 like any input the command cannot use — never a traceback, never a partial read."""


class Reject(ValueError):
    """A row that cannot be ingested: ``reason`` is a short code, the message the detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# --- inputs -------------------------------------------------------------------------------


def is_prompt_file(path: Path) -> bool:
    """A file ingest reads: its suffix is one of ``SUFFIXES``, in any case."""
    return path.suffix.lower() in SUFFIXES


def list_inputs(inputs: str | Path | Iterable[str | Path]) -> tuple[list[Path], list[dict[str, Any]]]:
    """Files named by ``inputs`` (files, directories, glob patterns, or a prompt set's name: ``sharegpt``, the
    file its package ships, ``specdraft.packaged``), in order, without repeats, and
    the files a directory or glob holds that are not prompt files: ``{kind, source, reason, detail}``
    records (reason ``unsupported_file``), skipped but reported."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    skipped: list[dict[str, Any]] = []
    for item in resolve_prompt_inputs([str(item) for item in inputs]):
        text = str(item)
        path = Path(text)
        if path.is_dir():
            entries = sorted(path.rglob("*"))
            candidates = [p for p in entries if p.is_file()]
            skipped += [{"kind": "file", "source": str(p), "line": None, "index": None, "reason": "unreadable",
                         "detail": f"under prompt input {text!r}: a symlink to {os.readlink(p)!r}, which does not "
                                   "exist; nothing was read", "excerpt": ""}
                        for p in entries if p.is_symlink() and not p.exists()]  # a dangling symlink: counted
        elif path.is_file():
            if not is_prompt_file(path):
                raise ValueError(f"{text}: unsupported prompt file type (expected one of {SUFFIXES})")
            candidates = [path]
        elif any(c in text for c in "*?["):
            candidates = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        else:
            raise FileNotFoundError(f"prompt input {text!r} does not exist")
        found = [p for p in candidates if is_prompt_file(p)]
        for p in candidates:
            if not is_prompt_file(p) and all(s["source"] != str(p) for s in skipped):
                skipped.append({"kind": "file", "source": str(p), "line": None, "index": None,
                                "reason": "unsupported_file",
                                "detail": f"under prompt input {text!r}: suffix {p.suffix or '(none)'!r} is not "
                                          f"one of {'/'.join(SUFFIXES)}; the file was not read", "excerpt": ""})
        if not found:
            raise FileNotFoundError(f"prompt input {text!r} matches no {'/'.join(SUFFIXES)} file"
                                    + (f" (it holds only {[Path(s['source']).name for s in skipped][:5]})"
                                       if skipped else ""))
        files += [f for f in found if f not in files]
    return files, skipped


def expand_inputs(inputs: str | Path | Iterable[str | Path]) -> list[Path]:
    """Files named by ``inputs`` (``list_inputs`` without the skipped files)."""
    return list_inputs(inputs)[0]


def read_records(path: Path) -> Iterator[tuple[dict[str, int | None], Any, str]]:
    """``(location, record or Reject, raw text)`` for every row of ``path``.

    ``location`` has ``line`` (1-based, JSONL) or ``index`` (0-based, JSON array / Parquet).
    Blank JSONL lines are not rows. A UTF-8 byte-order mark is not part of the text. A ``.json``
    array is read record by record (``read_json_array``: a file cut off mid-record gives its complete
    records and one reject); a ``.json`` file that is neither an array nor one JSON document is read
    as JSONL (a common misnaming). Bytes that are not UTF-8 are kept as surrogate escapes
    (``surrogateescape``), so the row holding them is found and rejected (``check_encoding``)
    instead of being read with replacement characters.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        index = 0
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for record in batch.to_pylist():
                    yield {"line": None, "index": index}, record, ""
                    index += 1
        except (pa.ArrowException, OSError) as err:  # a file cut short or not Parquet: no row of it can be trusted
            raise InputError(f"{path}: not a readable Parquet file after {index} rows ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]})") from None
        return
    if suffix == ".json":
        with open(path, "rb") as raw:
            bom = len(jsonl.BOM) if raw.read(len(jsonl.BOM)) == jsonl.BOM else 0
        with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as fh:
            head = fh.read(JSON_CHUNK_CHARS)
            if head.lstrip().startswith("["):
                yield from read_json_array(path, fh, head, bom)
                return
            text = head + fh.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            records = data if isinstance(data, list) else [data]
            for index, record in enumerate(records):
                yield {"line": None, "index": index}, record, ""
            return
    else:
        text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    for number, line in jsonl.text_lines(text):  # split on "\n" only: U+2028 in a row is text, not a line end
        try:
            yield {"line": number, "index": None}, json.loads(line), line
        except json.JSONDecodeError as err:
            yield {"line": number, "index": None}, Reject("bad_json", f"invalid JSON: {err}"), line


JSON_CHUNK_CHARS = 1 << 20  # characters read per step of a JSON array
MAX_RECORD_CHARS = 64 << 20  # a JSON array record still incomplete after this many characters is refused
WHITESPACE = re.compile(r"[ \t\n\r]*")
NEAR_END = 16  # characters: a syntax error this close to the end of the buffer may be a value cut by the chunk edge


def _incomplete(buf: str, err: json.JSONDecodeError) -> bool:
    """Whether ``err`` may be the end of ``buf`` cutting a value short (more text could complete it: an
    unterminated string, a ``\\uXXXX`` escape, literal or number cut at the edge), rather than a syntax error
    that no more text can repair."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(buf) - NEAR_END


def read_json_array(path: Path, fh: Any, buf: str, bom: int) -> Iterator[tuple[dict[str, int | None], Any, str]]:
    """The records of the JSON array whose text ``fh`` reads (``buf``: what was already read of it), one at a
    time (``json.JSONDecoder.raw_decode`` over a buffer of about ``JSON_CHUNK_CHARS``: memory is one record
    and one chunk, not the file). Every complete record is yielded; the first thing that is not a record (the
    file cut off mid-record, as ShareGPT's package ships it, or a syntax error) is one ``Reject`` naming the
    file, the record's index and its byte offset, and reading stops there (the bytes after it are counted)."""
    decoder, size = json.JSONDecoder(), path.stat().st_size
    pos = buf.index("[") + 1
    offset = bom + len(buf[:pos].encode("utf-8", "surrogateescape"))  # bytes of the file before buf[pos]
    eof, index, want_value = False, 0, True

    def fill() -> None:
        nonlocal buf, pos, eof
        more = fh.read(JSON_CHUNK_CHARS)
        eof = not more
        buf, pos = buf[pos:] + more, 0

    def stop(reason: str, what: str) -> tuple[dict[str, int | None], Reject, str]:
        left = size - offset
        detail = (f"{path}: record {index} (from byte {offset}): {what}; the {index} complete records before it "
                  f"were read, the last {left} bytes of the file were not")
        return {"line": None, "index": index}, Reject(reason, detail), buf[pos:pos + 1000]

    while True:
        end = WHITESPACE.match(buf, pos).end()
        if end == len(buf) and not eof:
            fill()
            continue
        offset += len(buf[pos:end].encode("utf-8", "surrogateescape"))
        pos = end
        if pos == len(buf):
            yield stop("truncated", "the file ends without the JSON array's closing ']'")
            return
        if not want_value:
            if buf[pos] not in ",]":
                yield stop("bad_json", f"invalid JSON: ',' or ']' expected after the previous record, found {buf[pos]!r}")
                return
            offset, pos, want_value = offset + 1, pos + 1, True
            if buf[pos - 1] == "]":
                break
            continue
        if buf[pos] == "]" and index == 0:  # the empty array
            offset, pos = offset + 1, pos + 1
            break
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not _incomplete(buf, err):
                yield stop("bad_json", f"invalid JSON: {err.msg} at byte "
                                       f"{offset + len(buf[pos:err.pos].encode('utf-8', 'surrogateescape'))}")
                return
            if not eof and len(buf) - pos < MAX_RECORD_CHARS:
                fill()
                continue
            yield stop("truncated", "the file ends inside it: the JSON array is cut off mid-record" if eof
                       else f"a record longer than {MAX_RECORD_CHARS} characters")
            return
        if end == len(buf) and not eof:  # a number may go on in the next chunk
            fill()
            continue
        yield {"line": None, "index": index}, record, ""
        offset += len(buf[pos:end].encode("utf-8", "surrogateescape"))
        pos, index, want_value = end, index + 1, False
        if pos > JSON_CHUNK_CHARS:
            buf, pos = buf[pos:], 0
    rest = buf[pos:] + fh.read()
    if rest.strip():
        yield stop("bad_json", f"text after the JSON array's closing ']': {rest.strip()[:40]!r}")
