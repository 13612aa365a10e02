"""Ingest prompt sets into the conversation schema (README "Commands": the prompt formats `specdraft regenerate` and `dump` read).

Reads files, directories (their ``*.json``, ``*.jsonl``, ``*.parquet``, recursively) and glob
patterns. Each record's format is recognised by its fields:

* ShareGPT ``{"id", "conversations": [{"from", "value"}]}`` (JSON array or JSONL);
* OpenAI-style ``{"messages": [{"role", "content"}]}`` (also our own schema, kept as is);
* MT-Bench question files ``{"question_id", "turns": [str]}`` -> user turns only;
* HumanEval-style ``{"task_id", "prompt"}`` -> one user turn;
* Parquet files with any of these columns.

Roles map to ``system|user|assistant`` (human/user, gpt/assistant/chatgpt/bard, system);
contents are normalized (CRLF -> LF, surrounding whitespace stripped). Every input row ends
up either in the output or in the rejects JSONL with a reason — ``rows_in == rows_out +
rejected`` always holds, duplicates included (reason ``duplicate``).
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq

from pipelines.conversations import check_messages
from specdraft.store import location

SUFFIXES = (".json", ".jsonl", ".parquet")
ROLE_MAP = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
}
ID_FIELDS = ("id", "question_id", "task_id", "conversation_id")


@dataclass(frozen=True, kw_only=True, slots=True)
class IngestConfig:
    """Limits and dedup policy of the ingest stage."""

    max_chars: int = 100_000  # total characters of a conversation's messages
    max_turns: int = 32  # user turns per conversation
    dedup: Literal["messages", "prompts", "none"] = "messages"  # prompts: system + user turns only
    excerpt_chars: int = 300  # raw excerpt kept per reject


class Reject(ValueError):
    """A row that cannot be ingested: ``reason`` is a short code, the message the detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# --- inputs -------------------------------------------------------------------------------


def expand_inputs(inputs: str | Path | Iterable[str | Path]) -> list[Path]:
    """Files named by ``inputs`` (files, directories, glob patterns), in order, without repeats."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        path = Path(text)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise ValueError(f"{text}: unsupported prompt file type (expected one of {SUFFIXES})")
            found = [path]
        elif any(c in text for c in "*?["):
            found = sorted(Path(p) for p in glob.glob(text, recursive=True)
                           if Path(p).is_file() and Path(p).suffix in SUFFIXES)
        else:
            raise FileNotFoundError(f"prompt input {text!r} does not exist")
        if not found:
            raise FileNotFoundError(f"prompt input {text!r} matches no {'/'.join(SUFFIXES)} file")
        files += [f for f in found if f not in files]
    return files


def read_records(path: Path) -> Iterator[tuple[dict[str, int | None], Any, str]]:
    """``(location, record or Reject, raw text)`` for every row of ``path``.

    ``location`` has ``line`` (1-based, JSONL) or ``index`` (0-based, JSON array / Parquet).
    Blank JSONL lines are not rows. A ``.json`` file that is not one JSON document is read
    as JSONL (a common misnaming).
    """
    if path.suffix == ".parquet":
        index = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield {"line": None, "index": index}, record, ""
                index += 1
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            pass
        else:
            records = data if isinstance(data, list) else [data]
            for index, record in enumerate(records):
                yield {"line": None, "index": index}, record, ""
            return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield {"line": number, "index": None}, json.loads(line), line
        except json.JSONDecodeError as err:
            yield {"line": number, "index": None}, Reject("bad_json", f"invalid JSON: {err}"), line


# --- normalization --------------------------------------------------------------------------


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise Reject("bad_type", f"{where} is {type(value).__name__}, expected a string")
    return value.replace("\r\n", "\n").strip()


def _turn_list(value: Any, field: str) -> list:
    if not isinstance(value, list):
        raise Reject("bad_type", f"{field!r} is {type(value).__name__}, expected a list")
    return value


def _messages(items: list, role_key: str, content_key: str, field: str) -> list[dict[str, str]]:
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
        out.append({"role": role, "content": _text(item[content_key_i], f"{field}[{i}].{content_key_i}")})
    return out


def normalize_record(record: Any) -> tuple[list[dict[str, str]], str | None, str | None]:
    """``(messages, source id or None, source name or None)`` of one raw record; raises ``Reject``.

    The source name is only returned for rows already in our schema (``messages`` + ``source``),
    whose ``id`` and ``source`` are kept as they are.
    """
    if not isinstance(record, dict):
        raise Reject("not_an_object", f"row is {type(record).__name__}, expected an object")
    if record.get("conversations") is not None:
        messages = _messages(_turn_list(record["conversations"], "conversations"), "from", "value", "conversations")
    elif record.get("messages") is not None:
        messages = _messages(_turn_list(record["messages"], "messages"), "role", "content", "messages")
    elif record.get("turns") is not None:
        turns = _turn_list(record["turns"], "turns")
        messages = [{"role": "user", "content": _text(t, f"turns[{i}]")} for i, t in enumerate(turns)]
    elif record.get("prompt") is not None:
        messages = [{"role": "user", "content": _text(record["prompt"], "prompt")}]
    else:
        raise Reject("missing_field", f"no 'conversations', 'messages', 'turns' or 'prompt' field "
                                      f"(fields: {sorted(record)[:10]})")
    source_id = next((record[k] for k in ID_FIELDS if record.get(k) is not None), None)
    if source_id is not None and not isinstance(source_id, (str, int)):
        raise Reject("bad_type", f"id is {type(source_id).__name__}, expected a string or int")
    source_id = None if source_id is None or str(source_id).strip() == "" else str(source_id).strip()
    own_source = record.get("source") if "messages" in record and source_id is not None else None
    return messages, source_id, own_source if isinstance(own_source, str) and own_source else None


def content_hash(messages: list[dict[str, str]]) -> str:
    """sha256 (hex) of normalized ``messages``."""
    blob = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


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
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Normalized, deduplicated conversation rows of ``inputs`` and the stage summary.

    Every rejected row goes to ``rejects_path`` (JSONL: ``source``, ``line``, ``index``,
    ``reason``, ``detail``, ``excerpt``) and is counted per reason in the summary.
    """
    files = expand_inputs(inputs)
    rows: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    seen_content: dict[str, str] = {}
    seen_ids: set[str] = set()
    rows_in = 0
    for file in files:
        stem = file.stem
        for location, record, raw in read_records(file):
            rows_in += 1
            try:
                if isinstance(record, Reject):
                    raise record
                messages, source_id, own_source = normalize_record(record)
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
                rejects.append({"source": str(file), **location, "reason": err.reason, "detail": str(err),
                                "excerpt": excerpt[: cfg.excerpt_chars]})
                continue
            if key is not None:
                seen_content[key] = conv_id
            seen_ids.add(conv_id)
            rows.append({"id": conv_id, "source": source, "messages": messages})

    if rejects_path is not None:
        write_rejects(rejects_path, rejects)
    by_reason = Counter(r["reason"] for r in rejects)
    summary = {
        "stage": "ingest",
        "files": [str(f) for f in files],
        "rows_in": rows_in,
        "rows_out": len(rows),
        "rejected": len(rejects),
        "rejects_by_reason": dict(sorted(by_reason.items())),
        "duplicates": by_reason.get("duplicate", 0),
        "rows_by_source": dict(Counter(r["source"] for r in rows)),
        "rejects_path": None if rejects_path is None else str(rejects_path),
    }
    assert summary["rows_in"] == summary["rows_out"] + summary["rejected"]
    return rows, summary


def write_rejects(path: str | Path, rejects: list[dict[str, Any]]) -> Path | str:
    """Write reject records as JSONL (temp name, then rename; at an object-store URL one PUT)."""
    return location.write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))


def load_conversations(paths: Iterable[str | Path]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows ``{id, source, messages}`` and the ingest summary (None when nothing needed ingesting).

    Conversation Parquet (regenerate's output, ``pipelines.conversations``) is read as is; any
    other file (ShareGPT / OpenAI JSON(L), raw Parquet) goes through ``pipelines.ingest``, whose
    summary counts what it rejected. An object-store URL must hold conversation Parquet (regenerate's
    output written there).
    """
    from pipelines.conversations import read_conversations as read_parquet

    rows, raw = [], []
    for path in map(location.as_location, paths):
        if isinstance(path, str):  # a URL
            rows += read_parquet([path])
            continue
        if path.suffix == ".parquet" or path.is_dir():
            try:
                rows += read_parquet([path])
                continue
            except ValueError:  # not in the conversation schema: ingest it
                pass
        raw.append(path)
    if not raw:
        return rows, None
    ingested, summary = ingest(raw)
    return rows + ingested, summary
