"""The promotion gate: a candidate replaces the champion only when it beats it on the new
traffic window's held-out slice by a margin AND loses no more than ``max_regression`` on a fixed regression set.

Gated on acceptance (tau: mean accepted tokens per round, or the serving engine's acceptance length), never
on loss: loss keeps falling while tau turns down (DeepSpec #84: an EAGLE-3 run peaked at epoch 4.6 and lost
4.9 % of tau by epoch 10). A pure function over numbers; every comparison is returned as a record for the
summary, MLflow tags and the report. The regression set is the eval sets plus the earlier windows' held-out
slices (``specdraft.freshness.traffic.regression_questions``) as one more dataset (``regression_value``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft.configs.fresh import GateSettings
from specdraft.freshness.record import RegressionCounts


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """One slice: candidate against champion, the relative change and the bound it had to meet."""

    slice: str  # "window" (the new traffic's held-out slice) or "regression" (the fixed regression set)
    candidate: float | None
    champion: float | None
    change: float | None  # (candidate - champion) / champion; None when either is unknown
    bound: float  # window: the change must exceed it (margin); regression: must not fall below it
    passed: bool
    note: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class GateDecision:
    promote: bool
    measure: str  # "tau" or "engine acceptance length"
    reason: str
    comparisons: list[Comparison] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _change(candidate: float | None, champion: float | None) -> float | None:
    return (candidate - champion) / champion if candidate is not None and champion else None


def regression_value(eval_sets: float | None, count: int, earlier: float) -> float:
    """A draft's value on the regression set: the mean over its datasets — the ``count`` eval sets (their mean
    ``eval_sets``; None or no set: none) and the earlier windows' held-out slices as one more (``earlier``)."""
    if eval_sets is None or count == 0:
        return earlier
    return (eval_sets * count + earlier) / (count + 1)


def regression_pair(ours: float | None, champion: float | None, eval_sets: int, *, earlier: bool,
                    candidate_earlier: float | None = None, champion_earlier: float | None = None
                    ) -> tuple[tuple[float | None, float | None], str]:
    """The regression comparison's (candidate, champion) values and its note for ``decide``: ``ours`` and
    ``champion`` on the ``eval_sets`` eval sets, ``*_earlier`` on the earlier windows' held-out slices (None: not
    measured; ``earlier``: such slices are kept). Both drafts measured on the slices: the slices are one more
    dataset beside the eval sets (``regression_value``), or alone when the champion's eval-set value is unknown;
    otherwise the eval sets alone, said when slices are kept."""
    if candidate_earlier is None or champion_earlier is None:
        note = "the earlier windows' slices not measured on both drafts: the eval sets alone" if earlier else ""
        return (ours, champion), note
    if champion is None:
        return ((candidate_earlier, champion_earlier),
                "the champion's eval sets unknown: the earlier windows' slices alone")
    return (regression_value(ours, eval_sets, candidate_earlier), regression_value(champion, eval_sets,
                                                                                   champion_earlier)), ""


def describe_regression_set(counts: RegressionCounts | None, eval_sets: int) -> str:
    """What the gate's regression set holds, in words: the eval sets and the earlier windows' questions."""
    sets = f"the {eval_sets} eval set{'s' if eval_sets != 1 else ''} (eval.questions)"
    if counts is None or not counts.questions:
        return f"regression set: {sets} alone (no earlier traffic window's held-out slice kept yet)"
    windows = counts.windows
    span = windows[0] if len(windows) == 1 else f"{windows[-1]}..{windows[0]}"
    capped = (f", {counts.over_cap} more over gate.regression_max_questions {counts.max_questions}"
              if counts.over_cap else "")
    whose = "windows'" if len(windows) != 1 else "window's"
    return (f"regression set: {sets} + {counts.questions} questions from {len(windows)} earlier {whose} held-out "
            f"slices (ending {span}{capped})")


def decide(settings: GateSettings, *, window: tuple[float | None, float | None],
           regression: tuple[float | None, float | None], has_champion: bool, measure: str = "tau",
           regression_set: str = "") -> GateDecision:
    """``window`` and ``regression``: (candidate, champion) values of ``measure`` on each slice (a None
    champion value: not measured there; ``regression_value`` makes the regression set's). No champion: promoted (nothing to
    protect). A window slice that is missing refuses (nothing shows the candidate is better); a regression set
    that is missing passes, saying so (no earlier slice yet). ``regression_set``: the regression comparison's
    note (what its values stand for, when not the whole set)."""
    if not has_champion:
        return GateDecision(promote=True, measure=measure, reason="no champion yet: nothing to protect")
    w_change = _change(*window)
    w_ok = w_change is not None and w_change > settings.margin
    w_note = "" if w_change is not None else "not measured on the window's held-out slice"
    r_change = _change(*regression)
    r_ok = r_change is None or r_change >= -settings.max_regression
    r_note = regression_set if r_change is not None else "no regression set measured: not checked"
    comparisons = [
        Comparison(slice="window", candidate=window[0], champion=window[1], change=w_change, bound=settings.margin,
                   passed=w_ok, note=w_note),
        Comparison(slice="regression", candidate=regression[0], champion=regression[1], change=r_change,
                   bound=-settings.max_regression, passed=r_ok, note=r_note)]
    parts = []
    for c in comparisons:
        if c.change is None:
            parts.append(f"{c.slice}: {c.note}")
        else:
            rel = ">" if c.slice == "window" else ">="
            parts.append(f"{c.slice} {measure} {c.candidate:.4f} vs champion {c.champion:.4f} ({c.change:+.1%}, "
                         f"needs {rel} {c.bound:+.1%}): {'pass' if c.passed else 'FAIL'}"
                         + (f" ({c.note})" if c.note else ""))
    promote = w_ok and r_ok
    return GateDecision(promote=promote, measure=measure, comparisons=comparisons,
                        reason=("gate passed: " if promote else "gate refused: ") + "; ".join(parts))
