"""Acceptance metrics of speculative decoding (docs/evaluation.md; "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §5).

Definitions (``speculative.Generation`` counts; sums run over all turns of a group):
* τ (average acceptance length) = Σ round_tokens / Σ rounds: tokens produced per target
  verification forward, the bonus token counted (as EAGLE/HASS report it); the token the
  prefill forward produces is not part of any round and is left out of both sums.
* α_i = Σ depth_accepted[i] / Σ depth_tried[i]: the rate at which the target accepts a depth-i
  draft token given that depth i-1 was accepted and depth i was drafted (None when never tried).
* tokens/s = Σ new tokens / Σ wall time (prefill included) for speculative and vanilla
  decoding of the same prompts with the same target and settings; speedup = their ratio.
* load_1m: the mean of the records' ``load_1m`` (the machine's 1-minute load average when each turn ended;
  its three decoders ran one right after the other), ``load_1m_max`` the highest: the load a speedup was
  measured under (None when the records carry none).
* lossless: in greedy mode the speculative tokens must equal the vanilla tokens; mismatching
  turns are counted and the first differing position is recorded.
* the prompt-lookup floor (``prompt_lookup``): records may carry a second decoder's counts
  under the same names with the suffix ``_pld``; the summary then has ``tau_pld``,
  ``alpha_pld``, ``rounds_pld``, ``new_tokens_pld``, ``wall_s_pld``, ``tokens_per_s_pld``,
  ``speedup_pld`` (vs vanilla), ``lossless_checked_pld``, ``lossless_mismatches_pld``,
  ``first_mismatches_pld``, ``pld_lossless`` (every checked turn equal to vanilla; None when
  none was checked) and ``tau_over_pld`` = τ / τ_pld (> 1: the draft beats copying). They are
  None when the records have no PLD counts (the floor was switched off).
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


DECODER_KEYS = ("tau", "alpha", "rounds", "new_tokens", "wall_s", "tokens_per_s", "lossless_checked",
                "lossless_mismatches", "first_mismatches")


def _decoder_summary(records: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    """The ``DECODER_KEYS`` of one decoder whose record fields end with ``suffix``."""
    rounds = round_tokens = new_tokens = checked = 0
    wall = 0.0
    tried: list[int] = []
    accepted: list[int] = []
    first_diffs = []
    for r in records:
        rounds += r[f"rounds{suffix}"]
        round_tokens += r[f"round_tokens{suffix}"]
        new_tokens += r[f"new_tokens{suffix}"]
        wall += r[f"wall_s{suffix}"]
        tried = _add(tried, r[f"depth_tried{suffix}"])
        accepted = _add(accepted, r[f"depth_accepted{suffix}"])
        if r[f"lossless{suffix}"] is not None:
            checked += 1
            if not r[f"lossless{suffix}"]:
                first_diffs.append(
                    {"question_id": r["question_id"], "turn": r["turn"], "position": r[f"first_mismatch{suffix}"]}
                )
    return {
        "tau": tau(round_tokens, rounds),
        "alpha": alpha(tried, accepted),
        "rounds": rounds,
        "new_tokens": new_tokens,
        "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else None,
        "lossless_checked": checked,
        "lossless_mismatches": len(first_diffs),
        "first_mismatches": first_diffs,
    }


def summarize(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate per-turn records (``eval.evaluate_question``) into one metrics block."""
    records = list(records)
    spec = _decoder_summary(records, "")
    base_tokens = sum(r["baseline_new_tokens"] for r in records)
    base_wall = sum(r["baseline_wall_s"] for r in records)
    base_speed = base_tokens / base_wall if base_wall > 0 else None
    with_pld = [("rounds_pld" in r) for r in records]
    assert all(with_pld) or not any(with_pld), "some records have prompt-lookup counts and some do not"
    pld = _decoder_summary(records, "_pld") if records and all(with_pld) else dict.fromkeys(DECODER_KEYS)
    speed, pld_speed = spec["tokens_per_s"], pld["tokens_per_s"]
    loads = [r["load_1m"] for r in records if r.get("load_1m") is not None]
    return {
        "tau": spec["tau"],
        "alpha": spec["alpha"],
        "rounds": spec["rounds"],
        "new_tokens": spec["new_tokens"],
        "num_turns": len(records),
        "wall_s": spec["wall_s"],
        "tokens_per_s": speed,
        "baseline_new_tokens": base_tokens,
        "baseline_wall_s": base_wall,
        "baseline_tokens_per_s": base_speed,
        "speedup": speed / base_speed if speed and base_speed else None,
        "load_1m": sum(loads) / len(loads) if loads else None,  # the load the speedups were measured under
        "load_1m_max": max(loads) if loads else None,
        "lossless_checked": spec["lossless_checked"],
        "lossless_mismatches": spec["lossless_mismatches"],
        "first_mismatches": spec["first_mismatches"],
        **{f"{key}_pld": pld[key] for key in DECODER_KEYS},
        "speedup_pld": pld_speed / base_speed if pld_speed and base_speed else None,
        "pld_lossless": pld["lossless_mismatches"] == 0 if pld["lossless_checked"] else None,
        "tau_over_pld": spec["tau"] / pld["tau"] if spec["tau"] is not None and pld["tau"] else None,
    }
