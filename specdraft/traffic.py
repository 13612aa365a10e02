"""Traffic as the training input (issue 33, Deliver 1): a window of dated request logs, with replay.

Layout: a directory (or ``s3://`` prefix, read through ``specdraft.store.location``) holding one folder per
day named ``YYYY-MM-DD``, each with any number of ``*.jsonl`` files as a gateway writes them. One JSON object
per line, in the OpenAI chat format::

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

Nothing is lost without a count: every line read ends up kept (to regenerate or reused), held out,
rejected (malformed: file and line named), deduplicated, or over the window's cap; a day of the window with
no folder is a warning.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdraft import files
from specdraft.configs.fresh import DAY, TrafficSettings
from specdraft.store import location

ROLES = ("system", "user", "assistant")


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
    """A log line that is no conversation: the message is the reason."""


def prompt_hash(messages: list[dict[str, str]]) -> str:
    """The identity a window deduplicates by: the system and user turns, in order."""
    text = json.dumps([(m["role"], m["content"]) for m in messages if m["role"] != "assistant"])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def parse_line(text: str) -> tuple[list[dict[str, str]], str | None, str]:
    """(prompt messages, logged answer or None, the model that answered or "") of one log line."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise Malformed(f"not JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(row, dict):
        raise Malformed(f"not a JSON object: {type(row).__name__}")
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Malformed("no `messages` list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise Malformed(f"messages[{i}]: expected {{role: system|user|assistant, content: str}}")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    while messages and messages[-1]["role"] == "assistant":  # the prompt is what the target answered
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise Malformed("no user turn")
    answer, model = None, str(row.get("model") or "")
    response = row.get("response")
    if isinstance(response, dict):
        model = str(response.get("model") or model)
        choices = response.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            message = choices[0].get("message") or {}
            if isinstance(message, dict) and isinstance(message.get("content"), str) and message["content"]:
                answer = message["content"]
    elif response is not None:
        raise Malformed("`response` is not an object")
    return messages, answer, model


def dated_days(root: str) -> list[str]:
    """The ``YYYY-MM-DD`` folders under ``root``, sorted."""
    return sorted(name for name in location.list_dir(root) if DAY.match(name))


def _read_day(root: str, day: str, rejects: list[dict[str, Any]]) -> list[tuple[list, str | None, str]]:
    """The rows of one day's ``*.jsonl`` files, in file and line order; malformed lines go to ``rejects``."""
    rows = []
    folder = location.join(root, day)
    for name in location.list_dir(folder):
        if not name.endswith(".jsonl") or name.startswith("."):
            continue
        path = location.join(folder, name)
        for number, text in enumerate(location.read_text(path).splitlines(), 1):
            if not text.strip():
                continue
            try:
                rows.append(parse_line(text))
            except Malformed as err:
                rejects.append({"file": str(path), "line": number, "reason": str(err)})
    return rows


def _held_out(key: str, share: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def read_window(settings: TrafficSettings) -> Window:
    """The window and replay of ``settings.path`` (the module docstring says how)."""
    root = location.as_location(settings.path)
    if not location.is_dir(root):
        raise FileNotFoundError(f"data.traffic.path={settings.path!r}: no such directory or prefix")
    present = dated_days(root)
    if not present:
        raise FileNotFoundError(f"data.traffic.path={settings.path!r}: no YYYY-MM-DD day folders")
    end = dt.date.fromisoformat(settings.end or present[-1])
    wanted = [(end - dt.timedelta(days=i)).isoformat() for i in range(settings.days)]  # newest first
    earlier = [(end - dt.timedelta(days=settings.days + i)).isoformat() for i in range(settings.replay_days)]
    window = Window(days=[d for d in wanted if d in present], replay_days=[d for d in earlier if d in present],
                    end=end.isoformat())
    window.warnings = [f"traffic: day {d} has no folder under {settings.path}" for d in wanted if d not in present]
    # read: every row read, the window's days' and the replay days' (read_replay_days: the latter)
    counts = dict.fromkeys(("read", "read_replay_days", "rejected", "deduplicated", "over_cap", "held_out",
                            "to_regenerate", "reused", "replay_pool", "replayed", "replay_reused", "replay_held_out"), 0)
    seen: set[str] = set()
    kept: list[tuple[str, list, str | None, str, str]] = []  # (hash, messages, answer, model, day)
    for day in window.days:
        for messages, answer, model in _read_day(root, day, window.rejects):
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
    counts["rejected"] = len(window.rejects)
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
            window.prompts.append({"id": row_id, "messages": messages})
            counts["to_regenerate"] += 1
    window.counts = counts
    return window


def write_window(window: Window, out: str) -> dict[str, str]:
    """Write the window's files under ``out`` (each whole): ``prompts.jsonl`` (to regenerate), ``reused.jsonl``
    (conversations with the logged answer), ``held_out.jsonl`` (MT-Bench-style ``question_id``/``turns``, what
    the evaluation reads), ``rejects.jsonl`` and ``window.json`` (days, counts, warnings). Returns name -> path;
    a file with no rows is not written and not named."""
    def jsonl(rows: list[dict[str, Any]]) -> str:
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)

    questions = [{"question_id": r["id"], "category": "traffic",
                  "turns": [m["content"] for m in r["messages"] if m["role"] == "user"]} for r in window.held_out]
    written = {}
    for name, rows in (("prompts", window.prompts), ("reused", window.reused), ("held_out", questions),
                       ("rejects", window.rejects)):
        if rows:
            written[name] = str(files.write_text(f"{out}/{name}.jsonl", jsonl(rows)))
    written["window"] = str(files.write_text(f"{out}/window.json", json.dumps(
        {"days": window.days, "replay_days": window.replay_days, "counts": window.counts,
         "warnings": window.warnings}, indent=2)))
    return written


def _question_key(question: dict[str, Any]) -> str:
    return json.dumps(question["turns"], ensure_ascii=False)


def keep_held_out(held_out: str | None, root: str | Path, end: str) -> tuple[Path | None, str]:
    """The window's held-out slice (``held_out``: its ``held_out.jsonl``; None: an empty slice) kept as
    ``<root>/<end>.jsonl`` (written whole). A slice kept before for the same window end stays as it is — the
    regression set an earlier night measured is never rewritten — and a different one is said in the warning
    returned ("" when none). Returns (the kept file or None, warning)."""
    path = Path(root) / f"{end}.jsonl"
    if held_out is None:
        return (path if path.is_file() else None), ""
    text = Path(held_out).read_text()
    if not path.is_file():
        return files.write_text(path, text), ""
    if path.read_text() == text:
        return path, ""
    return path, (f"traffic: the held-out slice of the window ending {end} differs from the one kept in {path} "
                  "(other data.traffic settings or logs?): the kept one stays in the regression set")


def regression_questions(root: str | Path, before: str, exclude: str | None, cap: int) -> tuple[list[dict[str, Any]],
                                                                                               dict[str, Any]]:
    """The regression set's traffic part: the held-out slices kept under ``root`` (``keep_held_out``) of the
    windows ending before ``before``, deduplicated by their turns, less the questions of ``exclude`` (this window's
    held-out file: measured as the window slice), at most ``cap``: taken from the windows in turn, newest first, so
    every earlier window is represented. Returns (questions, counts: ``questions``, ``windows`` used, ``over_cap``)."""
    root = Path(root)
    ends = sorted((p.stem for p in root.glob("*.jsonl") if DAY.match(p.stem) and p.stem < before), reverse=True)
    seen = {_question_key(json.loads(line)) for line in Path(exclude).read_text().splitlines()} if exclude else set()
    slices = []
    for end in ends:
        kept = []
        for line in (root / f"{end}.jsonl").read_text().splitlines():
            question = json.loads(line)
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
    return taken, {"questions": len(taken), "windows": sorted(used, reverse=True), "over_cap": total - len(taken)}
