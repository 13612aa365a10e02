"""The conversation schema shared by ingest, regenerate and dump, and its Parquet IO.

One row per conversation::

    id: string          stable: "<source file stem>:<source id>", or "<stem>:<sha256[:16]>"
                        of the normalized messages when the source has no id
    source: string      the source file stem ("sharegpt_sample", "mt_bench", ...)
    messages: list<struct<role: string, content: string>>

Roles are ``system|user|assistant``: an optional leading system message, then turns that
strictly alternate user/assistant starting with a user turn. Two shapes are valid:

* ``complete`` (regenerate's output, what dump reads): alternating and ending with an
  assistant turn;
* ``prompt`` (ingest's output, regenerate's input): alternating and ending with either role,
  or a run of user turns only (a question file such as MT-Bench: the answers do not exist
  yet, regenerate writes them).

Files and directories may be local paths or object-store URLs (``s3://bucket/prefix``; see
``specdraft/store/location.py``; docs/store.md "Object stores"): a part is serialized in memory and
written whole — locally under a temporary name renamed into place, at a URL in one PUT — so it
is either absent or complete. Regenerate's parts record the digest of each prompt they answer
(``prompt_digest``, ``write_part``), so a rerun resumes by content: ``done_prompts`` reads them back
and ``drop_answers`` takes a changed prompt's old answer out of its part.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specdraft.store import location

ROLES = ("system", "user", "assistant")
MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("messages", pa.list_(MESSAGE_TYPE))])


def check_messages(messages: list[dict[str, str]], complete: bool = False) -> tuple[str, str] | None:
    """``None`` when ``messages`` has a valid shape, else ``(reason, detail)``.

    Reasons: ``empty`` (no turns, or a message without text), ``unknown_role``,
    ``non_alternating``. ``complete=True`` also requires a final assistant turn and allows an
    empty assistant turn (the target may answer with its end-of-turn token right away).
    """
    if not messages:
        return "empty", "no messages"
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            return "unknown_role", f"message {i} has role {m['role']!r}"
        if not m["content"].strip() and not (complete and m["role"] == "assistant"):
            return "empty", f"message {i} ({m['role']}) has no text"
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    roles = [m["role"] for m in turns]
    if not roles:
        return "empty", "only a system message"
    if "system" in roles:
        return "non_alternating", f"system message at position {roles.index('system') + len(messages) - len(turns)}"
    user_only = not complete and all(r == "user" for r in roles)
    if not user_only:
        for i, role in enumerate(roles):
            if role != ("user" if i % 2 == 0 else "assistant"):
                return "non_alternating", f"turn {i} is {role!r}, expected {'user' if i % 2 == 0 else 'assistant'!r}"
    if complete and roles[-1] != "assistant":
        return "non_alternating", "does not end with an assistant turn"
    return None


PROMPT_DIGESTS_KEY = b"specdraft.prompt_digests"  # Parquet schema metadata: {id: digest of the prompt answered}


def write_conversations(
    path: str | Path, rows: Iterable[dict[str, Any]], prompt_digests: dict[str, str] | None = None
) -> Path | str:
    """Write ``rows`` to one Parquet file, serialized in memory and written whole (``location.write_bytes``:
    locally a temporary name in the same directory, then a rename; at a URL one PUT).

    ``prompt_digests`` (regenerate's parts: ``{id: digest of the prompt the row answers}``) goes into
    the file's schema metadata, written with the rows it describes (``read_prompt_digests``)."""
    rows = [
        {"id": r["id"], "source": r["source"],
         "messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]]}
        for r in rows
    ]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    if prompt_digests is not None:
        table = table.replace_schema_metadata({PROMPT_DIGESTS_KEY: json.dumps(prompt_digests, sort_keys=True)})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    return location.write_bytes(path, buffer.getvalue().to_pybytes())


def read_prompt_digests(table: pa.Table) -> dict[str, str]:
    """``{id: prompt digest}`` a part recorded (``write_conversations``); {} for a file without them."""
    raw = (table.schema.metadata or {}).get(PROMPT_DIGESTS_KEY)
    return {} if raw is None else json.loads(raw)


def conversation_files(paths: str | Path | Iterable[str | Path]) -> list[Path | str]:
    """Parquet files named by ``paths``: files as given, directories -> their ``*.parquet`` in any
    case (sorted; hidden names such as in-progress temp files are skipped)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path | str] = []
    for p in map(location.as_location, paths):
        if isinstance(p, str):  # a URL
            if location.is_dir(p):
                files += [location.join(p, n) for n in location.list_dir(p)
                          if n.lower().endswith(".parquet") and not n.startswith(".")]
            elif location.exists(p):
                files.append(p)
            else:
                raise FileNotFoundError(f"no conversation file or directory at {p!r}")
        elif p.is_dir():
            files += sorted(f for f in p.iterdir()
                            if f.is_file() and f.suffix.lower() == ".parquet" and not f.name.startswith("."))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no conversation file or directory at {str(p)!r}")
    return files


def read_conversations(paths: str | Path | Iterable[str | Path]) -> list[dict[str, Any]]:
    """All rows of the conversation Parquet files (or directories of them) in ``paths``."""
    rows: list[dict[str, Any]] = []
    for file in conversation_files(paths):
        table = read_table(file)
        missing = [n for n in SCHEMA.names if n not in table.column_names]
        if missing:
            raise ValueError(f"{file}: not a conversation file, missing column(s) {missing}")
        rows += table.select(SCHEMA.names).cast(SCHEMA).to_pylist()
    return rows


def read_table(file: str | Path, columns: list[str] | None = None) -> pa.Table:
    """One Parquet file (local path or URL) as a table."""
    if location.is_url(file):
        return pq.read_table(pa.BufferReader(location.read_bytes(file)), columns=columns)
    return pq.read_table(file, columns=columns)


def content_hash(messages: list[dict[str, str]]) -> str:
    """sha256 (hex) of normalized ``messages``."""
    blob = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def prompt_digest(messages: list[dict[str, str]]) -> str:
    """What regenerate answers of a conversation: the digest of its system and user turns (its
    dataset answers are dropped), recorded per row in each part (resume by content, not only id)."""
    return content_hash([m for m in messages if m["role"] != "assistant"])


def done_prompts(out_dir: str | Path) -> dict[str, tuple[str, str | Path]]:
    """``{id: (digest of the prompt answered, part file)}`` of the conversations in complete parts of
    ``out_dir``. A part written before digests were recorded gives the digest of its rows' own
    system and user turns."""
    if not location.is_dir(out_dir):
        return {}
    done: dict[str, tuple[str, str | Path]] = {}
    for file in conversation_files(out_dir):
        ids = read_table(file, columns=["id"])
        digests = read_prompt_digests(ids)
        if not digests and ids.num_rows:  # (an older part)
            digests = {r["id"]: prompt_digest(r["messages"]) for r in read_table(file).to_pylist()}
        for conv_id in ids.column("id").to_pylist():
            done[conv_id] = (digests.get(conv_id, ""), file)
    return done


def done_ids(out_dir: str | Path) -> set[str]:
    """Ids of the conversations already in complete parts of ``out_dir``."""
    return set(done_prompts(out_dir))


def drop_answers(done: dict[str, tuple[str, str | Path]], ids: Iterable[str]) -> None:
    """Take the answers of ``ids`` out of their parts (each part rewritten whole without them, its
    other rows and digests kept; a part left empty is removed), so a changed prompt is answered
    once, never twice. A kill between two rewrites leaves those ids missing: the rerun answers them."""
    by_file: dict[str, set[str]] = {}
    for conv_id in ids:
        by_file.setdefault(str(done[conv_id][1]), set()).add(conv_id)
    for file, stale in sorted(by_file.items()):
        table = read_table(file)
        keep = [r for r in table.to_pylist() if r["id"] not in stale]
        if keep:
            digests = read_prompt_digests(table) or {r["id"]: prompt_digest(r["messages"]) for r in keep}
            write_conversations(file, keep, {r["id"]: digests[r["id"]] for r in keep if r["id"] in digests})
        else:
            location.remove(file)


def part_name(ids: Iterable[str]) -> str:
    """Deterministic part file name for a batch of ids (a retried batch overwrites itself)."""
    return f"part-{hashlib.sha256(chr(10).join(ids).encode()).hexdigest()[:16]}.parquet"


def write_part(out_dir: Path | str, prompts: list[dict[str, Any]], answered: list[dict[str, Any]]) -> None:
    """One part of the ``answered`` conversations, with the digest of each one's prompt (``prompts``)."""
    if not answered:
        return
    digests = {r["id"]: prompt_digest(r["messages"]) for r in prompts}
    write_conversations(location.join(out_dir, part_name(r["id"] for r in answered)), answered,
                        {r["id"]: digests[r["id"]] for r in answered})
