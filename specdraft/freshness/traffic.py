"""Traffic as the training input: a window of dated request logs, with replay.

Layout: a directory (or ``s3://`` prefix, read through ``specdraft.store.location``) holding one folder per
day named ``YYYY-MM-DD``, each with any number of ``*.jsonl`` (or gzipped ``*.jsonl.gz``; suffixes in any case)
files as a gateway writes them. One JSON object per line (lines end at ``\\n`` only: ``specdraft.jsonl``), in
the OpenAI chat format::

    {"messages": [{"role": "user", "content": "..."}], "created": 1764201600,
     "response": {"model": "my-target", "choices": [{"message": {"role": "assistant", "content": "..."}}]}}

``created`` and ``response`` are optional; ``model`` may also sit at the top level. A night reads a
**window** (the newest ``days`` days up to ``end``, newest day first, at most ``max_conversations``
conversations, deduplicated by their prompt — system and user turns — across days) plus a **replay** share
of the ``replay_days`` days before it, sampled with ``seed``, so a draft keeps last month's traffic. A row
whose logged response names ``served_model`` is the target's own answer already: it is reused as is and not
regenerated. A ``held_out`` share of the window (by prompt hash, stable from night to night) is kept out of
training — replay never draws it either: the slice the drift check and the promotion gate measure tau on. Each
window's slice is kept (``keep_held_out``) and the earlier windows' slices are the gate's regression set
(``regression_questions``).

Nothing is lost without a count, and dirty traffic does not stop a night: every line read
ends up kept (to regenerate or reused), held out, rejected, deduplicated, or over the window's cap. A reject
names the file, the line (None: the whole file or folder was not read) and a ``reason``: ``not_utf8``,
``bad_json``, ``not_object``, ``no_messages``, ``bad_message``, ``no_user_turn``, ``bad_response`` (a line);
``unsupported_file``, ``unreadable`` (a dangling symlink), ``bad_gzip`` (a file); ``not_a_day``, ``bad_day``,
``future_day``, ``not_a_folder`` (an entry of the traffic directory). A day of the window with no folder, or
with no usable row, is a warning. A directory that is missing, holds no day folder, or whose window has no
usable row is one ``ConfigError`` (exit 2) naming the rejects by reason.
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdraft import files, jsonl
from specdraft.config import ConfigError
from specdraft.configs.fresh import DAY, TrafficSettings
from specdraft.store import location

ROLES = ("system", "user", "assistant")
SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(kw_only=True, slots=True)
class Window:
    """One night's traffic: rows to regenerate, rows reused as logged, the held-out slice, and the counts."""

    days: list[str]  # the window's days present, newest first
    end: str = ""  # the window's last day (YYYY-MM-DD): the name its held-out slice is kept under
    replay_days: list[str]  # the earlier days replay drew from
    prompts: list[dict[str, Any]] = field(default_factory=list)  # {"id", "messages"}: prompts to regenerate
    reused: list[dict[str, Any]] = field(default_factory=list)  # {"id", "messages"} ending in the logged answer
    held_out: list[dict[str, Any]] = field(default_factory=list)  # {"id", "messages"}: prompts, never trained on
    rejects: list[dict[str, Any]] = field(default_factory=list)  # {"file", "line", "reason"}
    warnings: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


class Malformed(ValueError):
    """A log line that is no conversation: ``reason`` a short code, the message the detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def prompt_hash(messages: list[dict[str, str]]) -> str:
    """The identity a window deduplicates by: the system and user turns, in order."""
    text = json.dumps([(m["role"], m["content"]) for m in messages if m["role"] != "assistant"])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def parse_line(text: str | Any) -> tuple[list[dict[str, str]], str | None, str]:
    """(prompt messages, logged answer or None, the model that answered or "") of one log line (its text, or the
    JSON value ``specdraft.jsonl.read_rows`` read from it)."""
    if isinstance(text, str):
        try:
            text = json.loads(text)
        except json.JSONDecodeError as err:
            raise Malformed("bad_json", f"not JSON: {err.msg} at column {err.colno}") from None
    row = text
    if not isinstance(row, dict):
        raise Malformed("not_object", f"not a JSON object: {type(row).__name__}")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Malformed("no_messages", "no `messages` list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise Malformed("bad_message", f"messages[{i}]: expected {{role: system|user|assistant, content: str}}")
        if SURROGATE.search(m["content"]):  # an escaped lone surrogate ("\\ud800"): no UTF-8 text, no tokens
            raise Malformed("not_utf8", f"messages[{i}]: a lone surrogate escape is no Unicode text")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    while messages and messages[-1]["role"] == "assistant":  # the prompt is what the target answered
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise Malformed("no_user_turn", "no user turn")
    answer, model = None, str(row.get("model") or "")
    response = row.get("response")
    if isinstance(response, dict):
        model = str(response.get("model") or model)
        choices = response.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            message = choices[0].get("message") or {}
            if isinstance(message, dict) and isinstance(message.get("content"), str) and message["content"] \
                    and not SURROGATE.search(message["content"]):
                answer = message["content"]
    elif response is not None:
        raise Malformed("bad_response", "`response` is not an object")
    return messages, answer, model


def _reject(rejects: list[dict[str, Any]], where: Any, line: int | None, reason: str, detail: str) -> None:
    rejects.append({"file": str(where), "line": line, "reason": reason, "detail": detail})


def dated_days(root: str, rejects: list[dict[str, Any]] | None = None, today: dt.date | None = None) -> list[str]:
    """The day folders under ``root``, sorted: ``YYYY-MM-DD`` names of real dates no later than tomorrow (UTC;
    a day of slack for a gateway east of UTC). Every other name is a reject in ``rejects`` (the whole entry, not
    read): ``bad_day`` (no real date: 2026-13-01), ``future_day`` (a clock ahead), ``not_a_day`` (any other name);
    hidden names (temporaries) are not entries."""
    rejects = [] if rejects is None else rejects
    latest = (today or dt.datetime.now(dt.timezone.utc).date()) + dt.timedelta(days=1)
    days = []
    for name in location.list_dir(root):
        where = location.join(root, name)
        if name.startswith("."):
            continue
        if not DAY.match(name):
            _reject(rejects, where, None, "not_a_day", "not a YYYY-MM-DD day folder: not read")
            continue
        try:
            day = dt.date.fromisoformat(name)
        except ValueError as err:
            _reject(rejects, where, None, "bad_day", f"not a real date ({err}): not read")
            continue
        if day > latest:
            _reject(rejects, where, None, "future_day", f"after tomorrow ({latest - dt.timedelta(days=1)} UTC, "
                                                         "the clock that wrote it is ahead?): not read")
            continue
        days.append(name)
    return sorted(days)


LOG_SUFFIXES = (".jsonl", ".jsonl.gz")  # in any case


def _read_log(path: Any, rejects: list[dict[str, Any]]) -> bytes | None:
    """The bytes of one log file (a ``.jsonl.gz`` one decompressed); None, with a reject, when unreadable."""
    try:
        data = location.read_bytes(path)
    except OSError as err:  # a dangling symlink, a folder named like a log, no permission
        _reject(rejects, path, None, "unreadable", f"{type(err).__name__}: {err.strerror or err}")
        return None
    if str(path).lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            _reject(rejects, path, None, "bad_gzip", f"not a whole gzip file: {err}")
            return None
    return data


def _read_day(root: str, day: str, rejects: list[dict[str, Any]]) -> list[tuple[list, str | None, str]]:
    """The rows of one day's log files (``LOG_SUFFIXES``), in file and line order; each line that is no
    conversation, each file that is not read, goes to ``rejects`` with its reason."""
    rows = []
    folder = location.join(root, day)
    if not location.is_dir(folder):
        _reject(rejects, folder, None, "not_a_folder", "a day's name, but not a folder: not read")
        return rows
    for name in location.list_dir(folder):
        path = location.join(folder, name)
        if name.startswith("."):  # a writer's temporary
            continue
        if not name.lower().endswith(LOG_SUFFIXES):
            _reject(rejects, path, None, "unsupported_file", f"not one of {'/'.join(LOG_SUFFIXES)}: not read")
            continue
        data = _read_log(path, rejects)
        for number, value in jsonl.read_rows(data or b""):
            try:
                if isinstance(value, jsonl.BadLine):
                    raise Malformed(value.reason, value.detail)
                rows.append(parse_line(value))
            except Malformed as err:
                _reject(rejects, path, number, err.reason, str(err))
    return rows


def _held_out(key: str, share: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def _plan_window(settings: TrafficSettings) -> Window:
    """The window's days and replay days present under ``settings.path`` (the rejected entries and the missing
    days said); a path that is no directory, or holds no day folder, is a ``ConfigError`` (one line, exit 2)."""
    root = location.as_location(settings.path)
    if not location.is_dir(root):
        raise ConfigError(f"data.traffic.path={settings.path!r}: no such directory or prefix")
    rejects: list[dict[str, Any]] = []
    present = dated_days(root, rejects)
    if not present:
        raise ConfigError(f"data.traffic.path={settings.path!r}: no YYYY-MM-DD day folders"
                          + (f" ({_said(rejects)}{_first(rejects)})" if rejects else ""))
    end = dt.date.fromisoformat(settings.end or present[-1])
    wanted = [(end - dt.timedelta(days=i)).isoformat() for i in range(settings.days)]  # newest first
    earlier = [(end - dt.timedelta(days=settings.days + i)).isoformat() for i in range(settings.replay_days)]
    window = Window(days=[d for d in wanted if d in present], replay_days=[d for d in earlier if d in present],
                    end=end.isoformat(), rejects=rejects)
    window.warnings = [f"traffic: day {d} has no folder under {settings.path}" for d in wanted if d not in present]
    return window


def _said(rejects: list[dict[str, Any]]) -> str:
    """``rejects`` counted by reason, in words: ``3 rejected (bad_json 2, not_utf8 1)``."""
    reasons = Counter(r["reason"] for r in rejects)
    return f"{len(rejects)} rejected ({', '.join(f'{k} {n}' for k, n in sorted(reasons.items()))})"


def _first(rejects: list[dict[str, Any]]) -> str:
    if not rejects:
        return ""
    r = rejects[0]
    return f"; the first: {r['file']}{'' if r['line'] is None else ':' + str(r['line'])}: {r['detail']}"


def read_window(settings: TrafficSettings, keep_answers: bool = False) -> Window:
    """The window and replay of ``settings.path`` (the module docstring says how). A window with no usable row
    is a ``ConfigError`` naming the path and the rejects by reason (one line, exit 2). ``keep_answers``
    (``regenerate.mode`` shipped or mixed): a row to regenerate keeps its logged answer of another model as its
    last turn (counted: ``other_model_answers``), for the regenerate stage to keep as shipped."""
    root = location.as_location(settings.path)
    window = _plan_window(settings)
    # read: every row read, the window's days' and the replay days' (read_replay_days: the latter)
    counts = dict.fromkeys(("read", "read_replay_days", "rejected", "deduplicated", "over_cap", "held_out",
                            "to_regenerate", "reused", "replay_pool", "replayed", "replay_reused", "replay_held_out"), 0)
    seen: set[str] = set()
    kept: list[tuple[str, list, str | None, str, str]] = []  # (hash, messages, answer, model, day)
    for day in window.days:
        rows = _read_day(root, day, window.rejects)
        if not rows:
            window.warnings.append(f"traffic: day {day} has no usable row under {settings.path}")
        for messages, answer, model in rows:
            counts["read"] += 1
            key = prompt_hash(messages)
            if key in seen:
                counts["deduplicated"] += 1
            elif len(kept) >= settings.max_conversations:
                counts["over_cap"] += 1
            else:
                seen.add(key)
                kept.append((key, messages, answer, model, day))
    pool = []
    for day in window.replay_days if settings.replay > 0 else []:  # no replay: earlier days are not read
        for messages, answer, model in _read_day(root, day, window.rejects):
            counts["read"] += 1
            counts["read_replay_days"] += 1
            key = prompt_hash(messages)
            if key in seen:
                counts["deduplicated"] += 1
            elif _held_out(key, settings.held_out, settings.seed):  # held out in its own window: in the
                counts["replay_held_out"] += 1  # regression set (keep_held_out), never trained on
            else:
                seen.add(key)
                pool.append((key, messages, answer, model, day))
    if not kept:
        raise ConfigError(f"data.traffic.path={settings.path!r}: no usable row in the window "
                          f"{window.end} back {settings.days} days ({len(window.days)} day folders; "
                          f"{_said(window.rejects)}{_first(window.rejects)})")
    counts["rejected"] = len(window.rejects)
    counts.update({f"rejected.{k}": n for k, n in sorted(Counter(r["reason"] for r in window.rejects).items())})
    counts["replay_pool"] = len(pool)
    n_replay = min(len(pool), int(round(settings.replay * len(kept))))
    chosen = sorted(np.random.default_rng(settings.seed).choice(len(pool), n_replay, replace=False).tolist()
                    ) if n_replay else []
    counts["replayed"] = n_replay
    counts["dropped_replay"] = len(pool) - n_replay
    for replayed, (key, messages, answer, model, day) in [(False, k) for k in kept] + [(True, pool[i]) for i in chosen]:
        row_id = f"{day}-{key}"
        if not replayed and _held_out(key, settings.held_out, settings.seed):
            window.held_out.append({"id": row_id, "messages": messages})
            counts["held_out"] += 1
        elif answer is not None and settings.served_model and model == settings.served_model:
            window.reused.append({"id": row_id, "messages": messages + [{"role": "assistant", "content": answer}]})
            counts["replay_reused" if replayed else "reused"] += 1
        else:
            shipped = keep_answers and answer is not None
            window.prompts.append({"id": row_id, "messages": messages
                                   + ([{"role": "assistant", "content": answer}] if shipped else [])})
            counts["to_regenerate"] += 1
            if keep_answers:
                counts["other_model_answers"] = counts.get("other_model_answers", 0) + shipped
    window.counts = counts
    return window


def write_window(window: Window, out: str) -> dict[str, str]:
    """Write the window's files under ``out`` (each whole): ``prompts.jsonl`` (to regenerate), ``reused.jsonl``
    (conversations with the logged answer), ``held_out.jsonl`` (MT-Bench-style ``question_id``/``turns``, what
    the evaluation reads), ``rejects.jsonl`` and ``window.json`` (days, counts, warnings). Returns name -> path;
    a file with no rows is not written and not named."""
    questions = [{"question_id": r["id"], "category": "traffic",
                  "turns": [m["content"] for m in r["messages"] if m["role"] == "user"]} for r in window.held_out]
    written = {}
    for name, rows in (("prompts", window.prompts), ("reused", window.reused), ("held_out", questions),
                       ("rejects", window.rejects)):
        if rows:
            written[name] = str(files.write_text(f"{out}/{name}.jsonl", jsonl.dumps_rows(rows)))
    written["window"] = str(files.write_text(f"{out}/window.json", json.dumps(
        {"days": window.days, "replay_days": window.replay_days, "counts": window.counts,
         "warnings": window.warnings}, indent=2)))
    return written


def _question_key(question: dict[str, Any]) -> str:
    return json.dumps(question["turns"])


def read_slice(path: str | Path, rejects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The questions of a held-out slice (``held_out.jsonl`` or a kept one); a line that is not one
    (``specdraft.jsonl.read_rows``: ``not_utf8``, ``bad_json``; ``not_a_question``: no list of text ``turns``)
    goes to ``rejects``; a file that cannot be read is one reject (``unreadable``)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        _reject(rejects, path, None, "unreadable", f"{type(err).__name__}: {err.strerror or err}")
        return []
    questions = []
    for number, row in jsonl.read_rows(data):
        turns = row.get("turns") if isinstance(row, dict) else None
        if isinstance(row, jsonl.BadLine):
            _reject(rejects, path, number, row.reason, row.detail)
        elif not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            _reject(rejects, path, number, "not_a_question", "no non-empty list of strings under 'turns'")
        else:
            questions.append(row)
    return questions


def keep_held_out(held_out: str | None, root: str | Path, end: str) -> tuple[Path | None, str]:
    """The window's held-out slice (``held_out``: its ``held_out.jsonl``; None: an empty slice) kept as
    ``<root>/<end>.jsonl`` (written whole). A slice kept before for the same window end stays as it is — the
    regression set an earlier night measured is never rewritten — and a different one is said in the warning
    returned ("" when none). Returns (the kept file or None, warning)."""
    path = Path(root) / f"{end}.jsonl"
    if held_out is None:
        return (path if path.is_file() else None), ""
    data = Path(held_out).read_bytes()
    if not path.is_file():
        return files.write_bytes(path, data), ""
    if path.read_bytes() == data:
        return path, ""
    return path, (f"traffic: the held-out slice of the window ending {end} differs from the one kept in {path} "
                  "(other data.traffic settings or logs?): the kept one stays in the regression set")


def regression_questions(root: str | Path, before: str, exclude: str | None, cap: int) -> tuple[list[dict[str, Any]],
                                                                                               dict[str, Any]]:
    """The regression set's traffic part: the held-out slices kept under ``root`` (``keep_held_out``) of the
    windows ending before ``before``, deduplicated by their turns, less the questions of ``exclude`` (this window's
    held-out file: measured as the window slice), at most ``cap``: taken from the windows in turn, newest first, so
    every earlier window is represented. A line of a slice that is no question is counted (``read_slice``), not
    read. Returns (questions, counts: ``questions``, ``windows`` used, ``over_cap``, ``rejected`` and, when
    some, ``rejects``: {file, line, reason, detail})."""
    root = Path(root)
    ends = sorted((p.stem for p in root.glob("*.jsonl") if DAY.match(p.stem) and p.stem < before), reverse=True)
    rejects: list[dict[str, Any]] = []
    seen = {_question_key(q) for q in read_slice(exclude, rejects)} if exclude else set()
    slices = []
    for end in ends:
        kept = []
        for question in read_slice(root / f"{end}.jsonl", rejects):
            if (key := _question_key(question)) not in seen:
                seen.add(key)
                kept.append(question)
        slices.append((end, kept))
    taken: list[dict[str, Any]] = []
    used: set[str] = set()
    for i in range(max((len(k) for _, k in slices), default=0)):  # one from each window in turn
        for end, kept in slices:
            if i < len(kept) and len(taken) < cap:
                taken.append(kept[i])
                used.add(end)
    total = sum(len(k) for _, k in slices)
    return taken, {"questions": len(taken), "windows": sorted(used, reverse=True), "over_cap": total - len(taken),
                   "rejected": len(rejects), **({"rejects": rejects} if rejects else {})}
