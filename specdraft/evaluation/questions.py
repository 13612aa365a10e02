"""MT-Bench-format question sets and their chat prompts ("Judging LLM-as-a-Judge with MT-Bench and Chatbot
Arena": the question format; docs/evaluation.md).

A question file is JSON Lines (or a JSON list) of ``{"question_id", "category", "turns"}``; its dataset
name is the file stem (the parent folder's name for a file called ``question.jsonl``, as in FastChat's
``data/mt_bench/question.jsonl``). Questions are numbered globally over the files, so a question's number
(and with it its sampling seeds) does not depend on which worker evaluates it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdraft.config import ConfigError


def dataset_name(path: str | Path) -> str:
    path = Path(path)
    return path.parent.name if path.stem == "question" and path.parent.name else path.stem


def read_questions(path: str | Path) -> list[dict[str, Any]]:
    """The questions of one MT-Bench-format file (JSON Lines or a JSON list)."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    rows = json.loads(text) if stripped.startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    for i, row in enumerate(rows):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}: question {i} needs a non-empty list of strings under 'turns'")
    return rows


def load_question_sets(files: list[str | Path], max_questions: int | None = None, *, allow_empty: bool = False,
                       skipped: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """All questions of ``files`` (the first ``max_questions`` of each), numbered globally.

    A question with an empty (or blank) turn is not decoded: it is appended to ``skipped`` (``dataset``,
    ``question_id``, ``reason``). No question at all is a ``ConfigError`` naming the files (an evaluation
    of nothing has no tau) unless ``allow_empty``."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    skipped = [] if skipped is None else skipped
    for path in files:
        name = dataset_name(path)
        if name in names:
            raise ConfigError(f"--questions: two files map to dataset {name!r}: {names[name]} and {path} (rename one)")
        names[name] = str(path)
        rows = read_questions(path)
        for row in rows[:max_questions] if max_questions is not None else rows:
            qid = row.get("question_id", len(out) + len(skipped))
            blank = [i for i, turn in enumerate(row["turns"]) if not turn.strip()]
            if blank:
                skipped.append({"dataset": name, "question_id": qid, "reason": "empty_turn",
                                "detail": f"turn {blank[0]} is empty"})
                continue
            out.append({
                "dataset": name,
                "index": len(out),
                "question_id": qid,
                "category": row.get("category", ""),
                "turns": list(row["turns"]),
            })
    if not out and not allow_empty:
        raise ConfigError(f"--questions {', '.join(map(str, files))}: no question to evaluate ({len(skipped)} skipped: "
                          f"{sorted({s['reason'] for s in skipped}) or 'none'}); set allow_empty=true to write a report "
                          "without one")
    return out


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
