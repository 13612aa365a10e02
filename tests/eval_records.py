"""What an evaluation report's per-turn records imply (README "Evaluation and the prompt-lookup floor").

τ is the mean number of tokens a verification round commits: ``sum(round_tokens) / sum(rounds)`` over a
block's records, and — counted a second way — one token per round (the target's own) plus every drafted
token a round accepted (``depth_accepted``, summed over depths), less what a turn's last round accepted past
the turn's end. ``tau >= 1`` holds by construction, so the tests check τ against the records instead: the
report's figure must be the records' figure, and the records' two counts must agree. ``suffix`` ``"_pld"`` reads the prompt-lookup floor's fields of the same records.
"""

from __future__ import annotations

from typing import Any

import pytest


def implied_tau(records: list[dict[str, Any]], suffix: str = "") -> float:
    """τ of ``records``: tokens per round, checked against the accepted drafts per round (a turn's last round
    may accept drafts past its end — ``max_new_tokens`` or eos — which it does not commit)."""
    assert records, "no records: no tau"
    rounds = sum(r[f"rounds{suffix}"] for r in records)
    tokens = sum(r[f"round_tokens{suffix}"] for r in records)
    accepted = sum(sum(r[f"depth_accepted{suffix}"]) for r in records)
    depth = max(len(r[f"depth_accepted{suffix}"]) for r in records)
    assert rounds > 0, f"no round{suffix} in {len(records)} records"
    cut = rounds + accepted - tokens  # accepted drafts past a turn's end
    assert 0 <= cut <= depth * len(records), (
        f"round_tokens{suffix} {tokens}, rounds {rounds}, accepted drafts {accepted}: a round commits its accepted "
        f"drafts and one token of the target's, less at most {depth} past the end of each of {len(records)} turns")
    return tokens / rounds


def check_tau(block: dict[str, Any], records: list[dict[str, Any]], suffix: str = "") -> float:
    """``block``'s τ (``tau`` or ``tau_pld``) is the one its ``records`` imply; returns it."""
    want = implied_tau(records, suffix)
    assert block[f"tau{suffix}"] == pytest.approx(want, rel=1e-12, abs=0), (block[f"tau{suffix}"], want)
    return want


def records_of(report: dict[str, Any], dataset: str | None = None, turn: int | None = None) -> list[dict[str, Any]]:
    """The report's records of one dataset (all: None) and one turn (all: None)."""
    return [r for r in report["records"]
            if (dataset is None or r["dataset"] == dataset) and (turn is None or r["turn"] == turn)]
