"""Evaluation question sets as users have them, and their chat prompts ("Judging LLM-as-a-Judge with MT-Bench and
Chatbot Arena": the MT-Bench format; docs/evaluation.md "Question files").

A question file is JSON Lines (or a JSON list) of rows in one of the formats in ``KINDS``: MT-Bench
``{"question_id", "category", "turns"}``, chat ``messages`` (the user turns are asked), GSM8K ``question``,
Alpaca ``instruction`` (+ ``input``), HumanEval (or any single-prompt set) ``prompt``. A row in none of them is a
``ConfigError`` naming the file, the row and the keys it has (exit 2). A line that is not UTF-8 or not JSON is
skipped with its reason (``specdraft.jsonl``), counted with the other skipped questions. Its dataset name is
the file stem (the parent folder's name for a file called ``question.jsonl``, as in FastChat's
``data/mt_bench/question.jsonl``). Questions are numbered globally over the files, so a question's number
(and with it its sampling seeds) does not depend on which worker evaluates it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from specdraft import jsonl
from specdraft.config import ConfigError

# the key a row's format is known by, in the order they are looked for, and the format it names
KINDS = {"turns": "MT-Bench", "messages": "chat", "question": "GSM8K", "instruction": "Alpaca",
         "prompt": "HumanEval / single prompt"}
ID_KEYS = ("question_id", "task_id", "id")


def dataset_name(path: str | Path) -> str:
    path = Path(path)
    return path.parent.name if path.stem == "question" and path.parent.name else path.stem


def _text(row: dict[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: '{key}' is {type(value).__name__}, expected a string")
    return value


def question_turns(row: Any, where: str) -> tuple[str, list[str]]:
    """(kind: a key of ``KINDS``, the turns to ask) of one row; ``where`` names it (file and row) in the
    ``ConfigError`` of a row in no known format."""
    keys = sorted(row)[:12] if isinstance(row, dict) else None
    kind = next((k for k in KINDS if isinstance(row, dict) and row.get(k) is not None), None)
    if kind is None:
        raise ConfigError(f"{where}: no question: " + (f"keys {keys}" if keys is not None else
                                                        f"a JSON {type(row).__name__}, not an object")
                          + "; expected a row with one of " + ", ".join(f"'{k}' ({v})" for k, v in KINDS.items()))
    if kind == "turns":
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ConfigError(f"{where}: 'turns' needs a non-empty list of strings")
        return kind, list(turns)
    if kind == "messages":
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ConfigError(f"{where}: 'messages' needs a list of {{role, content}} objects")
        turns = [_text(m, "content", f"{where} messages[{i}]")
                 for i, m in enumerate(messages) if m.get("role") == "user"]
        if not turns:
            raise ConfigError(f"{where}: 'messages' has no user turn (roles {[m.get('role') for m in messages]})")
        return kind, turns
    text = _text(row, kind, where)
    if kind == "instruction" and row.get("input"):  # Alpaca: the input follows the instruction
        text = f"{text}\n\n{_text(row, 'input', where)}"
    return kind, [text]


def read_questions(path: str | Path, skipped: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The questions of one file (JSON Lines or a JSON list; the module docstring says which rows):
    ``{"question_id", "category", "turns", "kind", "row"}`` (``row``: the 1-based line, or the list's 0-based
    index). A line that is not UTF-8 or not JSON goes to ``skipped`` (``file``, ``line``, ``reason``,
    ``detail``)."""
    path = Path(path)
    skipped = [] if skipped is None else skipped
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"--questions {path}: cannot be read ({type(err).__name__}: {err.strerror or err})") from None
    rows: list[tuple[int, Any]]
    if data.lstrip(b" \t\r\n\xef\xbb\xbf").startswith(b"["):
        try:
            rows = list(enumerate(json.loads(data.decode("utf-8-sig"))))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"--questions {path}: not a JSON list ({type(err).__name__}: {err})") from None
        label = "row"
    else:
        rows, label = list(jsonl.read_rows(data)), "line"
    out = []
    for number, row in rows:
        if isinstance(row, jsonl.BadLine):
            skipped.append({"dataset": dataset_name(path), "question_id": None, "file": str(path), "line": number,
                            "reason": row.reason, "detail": row.detail})
            continue
        kind, turns = question_turns(row, f"--questions {path} {label} {number}")
        qid = next((row[k] for k in ID_KEYS if isinstance(row.get(k), (str, int))), None)
        out.append({"question_id": qid, "category": str(row.get("category") or ""), "turns": turns, "kind": kind,
                    "row": number})
    return out


def load_question_sets(files: list[str | Path], max_questions: int | None = None, *, allow_empty: bool = False,
                       skipped: list[dict[str, Any]] | None = None,
                       kinds: dict[str, dict[str, int]] | None = None) -> list[dict[str, Any]]:
    """All questions of ``files`` (the first ``max_questions`` of each), numbered globally.

    A question with an empty (or blank) turn is not decoded, nor a line that is no JSON: each is appended to
    ``skipped`` (``dataset``, ``question_id``, ``reason``, ``detail``; a line also ``file`` and ``line``).
    ``kinds`` gets each dataset's questions counted by format (``{"mt_bench": {"turns": 80}}``). No question at
    all is a ``ConfigError`` naming the files (an evaluation of nothing has no tau) unless ``allow_empty``."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    skipped = [] if skipped is None else skipped
    kinds = {} if kinds is None else kinds
    for path in files:
        name = dataset_name(path)
        if name in names:
            raise ConfigError(f"--questions: two files map to dataset {name!r}: {names[name]} and {path} (rename one)")
        names[name] = str(path)
        rows = read_questions(path, skipped)
        rows = rows[:max_questions] if max_questions is not None else rows
        kinds[name] = dict(Counter(row["kind"] for row in rows))
        for row in rows:
            qid = row["question_id"] if row["question_id"] is not None else len(out) + len(skipped)
            blank = [i for i, turn in enumerate(row["turns"]) if not turn.strip()]
            if blank:
                skipped.append({"dataset": name, "question_id": qid, "reason": "empty_turn",
                                "detail": f"turn {blank[0]} is empty"})
                continue
            out.append({
                "dataset": name,
                "index": len(out),
                "question_id": qid,
                "category": row["category"],
                "turns": row["turns"],
            })
    if not out and not allow_empty:
        raise ConfigError(f"--questions {', '.join(map(str, files))}: no question to evaluate ({len(skipped)} skipped: "
                          f"{sorted({s['reason'] for s in skipped}) or 'none'}); set allow_empty=true to write a report "
                          "without one")
    return out


def describe_kinds(kinds: dict[str, dict[str, int]]) -> str:
    """``kinds`` (``load_question_sets``) in words: ``mt_bench: 80 questions (turns 80); gsm8k: ...``."""
    return "; ".join(f"{name}: {sum(c.values())} questions ({', '.join(f'{k} {n}' for k, n in sorted(c.items()))})"
                     for name, c in kinds.items())


def describe_skipped(report: dict[str, Any]) -> str:
    """A report's skipped questions in words: ``2 skipped (bad_json 1, empty_turn 1)``."""
    reasons = Counter(s["reason"] for s in report.get("questions_skipped") or [])
    return f"{sum(reasons.values())} skipped" + (f" ({', '.join(f'{k} {n}' for k, n in sorted(reasons.items()))})"
                                                 if reasons else "")


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the target's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template: "
                         "questions are asked as chat turns")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_text(tokenizer, tokens: list[int], eos_ids: frozenset[int]) -> str:
    """An answer's text (its stop token dropped), as the next turn's assistant message."""
    if tokens and tokens[-1] in eos_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True)
