"""Answers as they ship: the ``shipped`` and ``mixed`` data modes of the regenerate stage (issue 40, Deliver 1).

The draft's label is the target's own distribution whatever text it reads: the dump's prefill runs the target
over each conversation and the loss distils ``teacher_h @ lm_head`` at every answer token. So an answer the
target did not write — ShareGPT's, or a logged response of another model — still teaches the draft the target,
at the cost of a prefill instead of a generation. What it loses is on-policy text: the draft learns to predict
the target on prefixes the target would not have written ("EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", Table 6: fixed ShareGPT answers instead of regenerated ones cost ~3.6 % of τ).

``regenerate.mode`` (``pipelines.configs.RegenerateConfig``):

* ``target`` — the target answers every prompt (the default; ``pipelines/regenerate.py``);
* ``shipped`` — every conversation keeps its own answers; nothing is generated and no target loads. A
  conversation that ends in user turns keeps what precedes them (the dropped turns are counted); one with no
  answer at all is a counted reject, ``no_answer``;
* ``mixed`` — the target regenerates a ``share`` of the conversations and the rest ship as above. A row is
  regenerated when ``share_draw(seed, prompt digest) < share``: a uniform draw fixed by the row's prompt and the seed,
  so a rerun, a grown prompt set or another batch order picks the same rows, and about ``share`` of them.

A shipped row is written in the conversation schema regenerate writes (``pipelines/conversations.py``), with the
digest of its whole text (``shipped_digest``: its answers are its content), so a rerun resumes it like a
regenerated one and a row whose answers changed under the same id is written again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.configs import RegenerateConfig
from pipelines.conversations import content_hash, part_name, prompt_digest, write_conversations
from specdraft.config import to_dict
from specdraft.store import location

PART_ROWS = 4096  # shipped conversations per Parquet part
NO_ANSWER = "no_answer"


def share_draw(seed: int, digest: str) -> float:
    """A uniform number in [0, 1) fixed by ``seed`` and a row's prompt ``digest``."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{digest}".encode()).digest()[:8], "big") / 2**64


def regenerates(messages: list[dict[str, str]], cfg: RegenerateConfig) -> bool:
    """Whether the target answers this conversation (``mode``; in ``mixed``, its draw against ``share``)."""
    if cfg.mode == "target":
        return True
    if cfg.mode == "shipped":
        return False
    return share_draw(cfg.seed, prompt_digest(messages)) < cfg.share


def shipped_messages(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], int] | None:
    """``(messages up to its last answer, user turns dropped after it)``; None when it has no answer."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return None
    return messages[: last + 1], sum(m["role"] == "user" for m in messages[last + 1:])


def shipped_digest(messages: list[dict[str, str]]) -> str:
    """What a shipped row holds: the digest of its whole text (a regenerated row records its prompt's)."""
    return "shipped:" + content_hash(messages)


@dataclass(kw_only=True, slots=True)
class Plan:
    """The rows of one regenerate run split by mode: to regenerate, to ship as they are, rejected."""

    regenerate: list[dict[str, Any]] = field(default_factory=list)
    shipped: list[dict[str, Any]] = field(default_factory=list)  # trimmed to their last answer
    rejects: list[dict[str, Any]] = field(default_factory=list)  # ``no_answer``, in ingest's reject format
    cut_turns: int = 0  # user turns after a shipped row's last answer (no answer to learn from: dropped)

    def expected_digests(self) -> dict[str, str]:
        """``{id: digest}`` each row's part must record (``conversations.done_prompts``) to count as done."""
        return ({r["id"]: prompt_digest(r["messages"]) for r in self.regenerate}
                | {r["id"]: shipped_digest(r["messages"]) for r in self.shipped})


def plan_rows(rows: list[dict[str, Any]], cfg: RegenerateConfig) -> Plan:
    """Split ingested ``rows`` by ``cfg.mode`` (module docstring); every row lands in one list."""
    plan = Plan()
    for row in rows:
        if regenerates(row["messages"], cfg):
            plan.regenerate.append(row)
            continue
        kept = shipped_messages(row["messages"])
        if kept is None:
            user = next((m["content"] for m in row["messages"] if m["role"] == "user"), "")
            plan.rejects.append({"kind": "row", "source": row["source"], "id": row["id"], "reason": NO_ANSWER,
                                 "detail": f"mode={cfg.mode}: no answer to keep (only prompt turns)",
                                 "excerpt": user[: cfg.ingest.excerpt_chars]})
            continue
        plan.shipped.append({**row, "messages": kept[0]})
        plan.cut_turns += kept[1]
    return plan


def write_shipped(out_dir: Path | str, rows: list[dict[str, Any]]) -> int:
    """Write ``rows`` as parts of at most ``PART_ROWS`` (each whole, with its rows' ``shipped_digest``); the
    number of parts."""
    for start in range(0, len(rows), PART_ROWS):
        chunk = rows[start: start + PART_ROWS]
        write_conversations(location.join(out_dir, part_name(r["id"] for r in chunk)), chunk,
                            {r["id"]: shipped_digest(r["messages"]) for r in chunk})
    return -(-len(rows) // PART_ROWS)


def mode_settings(cfg: RegenerateConfig) -> dict[str, Any]:
    """``cfg`` as a stage key hashes it: without ``mode`` and ``share`` in ``target`` mode, so the keys (and
    output directories) written before the modes existed still match, and never ``vllm_env`` (where the engine
    computes, not what it answers; the keys written before it existed match too)."""
    settings = to_dict(cfg)
    settings.pop("vllm_env")
    if cfg.mode == "target":
        settings.pop("mode")
        settings.pop("share")
    return settings
