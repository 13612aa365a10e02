"""Acceptance metrics of speculative decoding (DESIGN.md "Evaluation"; papers/eagle2-… §5 "Metrics").

Definitions (``speculative.Generation`` counts; sums run over all turns of a group):
* τ (average acceptance length) = Σ round_tokens / Σ rounds: tokens produced per target
  verification forward, the bonus token counted (as EAGLE/HASS report it); the token the
  prefill forward produces is not part of any round and is left out of both sums.
* α_i = Σ depth_accepted[i] / Σ depth_tried[i]: the rate at which the target accepts a depth-i
  draft token given that depth i-1 was accepted and depth i was drafted (None when never tried).
* tokens/s = Σ new tokens / Σ wall time (prefill included) for speculative and vanilla
  decoding of the same prompts with the same target and settings; speedup = their ratio.
* lossless: in greedy mode the speculative tokens must equal the vanilla tokens; mismatching
  turns are counted and the first differing position is recorded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def tau(round_tokens: int, rounds: int) -> float | None:
    return round_tokens / rounds if rounds else None


def alpha(tried: Sequence[int], accepted: Sequence[int]) -> list[float | None]:
    assert len(tried) == len(accepted), f"{len(tried)} tried vs {len(accepted)} accepted depths"
    return [a / t if t else None for t, a in zip(tried, accepted)]


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First position where the token lists differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _add(total: list[int], values: Sequence[int]) -> list[int]:
    if len(values) > len(total):
        total = total + [0] * (len(values) - len(total))
    return [t + (values[i] if i < len(values) else 0) for i, t in enumerate(total)]


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate per-turn records (see ``eval.turn_record``) into one metrics block."""
    rounds = round_tokens = new_tokens = base_tokens = num_turns = 0
    wall = base_wall = 0.0
    tried: list[int] = []
    accepted: list[int] = []
    checked = mismatches = 0
    first_diffs = []
    for r in records:
        num_turns += 1
        rounds += r["rounds"]
        round_tokens += r["round_tokens"]
        new_tokens += r["new_tokens"]
        wall += r["wall_s"]
        base_tokens += r["baseline_new_tokens"]
        base_wall += r["baseline_wall_s"]
        tried = _add(tried, r["depth_tried"])
        accepted = _add(accepted, r["depth_accepted"])
        if r["lossless"] is not None:
            checked += 1
            if not r["lossless"]:
                mismatches += 1
                first_diffs.append(
                    {"question_id": r["question_id"], "turn": r["turn"], "position": r["first_mismatch"]}
                )
    speed = new_tokens / wall if wall > 0 else None
    base_speed = base_tokens / base_wall if base_wall > 0 else None
    return {
        "tau": tau(round_tokens, rounds),
        "alpha": alpha(tried, accepted),
        "rounds": rounds,
        "new_tokens": new_tokens,
        "num_turns": num_turns,
        "wall_s": wall,
        "tokens_per_s": speed,
        "baseline_new_tokens": base_tokens,
        "baseline_wall_s": base_wall,
        "baseline_tokens_per_s": base_speed,
        "speedup": speed / base_speed if speed and base_speed else None,
        "lossless_checked": checked,
        "lossless_mismatches": mismatches,
        "first_mismatches": first_diffs,
    }
