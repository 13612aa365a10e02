"""The promotion decision (docs/evaluation.md "The champion"): whether a newly trained draft becomes the champion.

A pure function over numbers (no MLflow: ``pipelines/registry.py`` reads the champion's values from the registry,
calls the gate and moves the alias). A draft is promoted only when

* its mean tau beats the training-free floor, prompt-lookup decoding's tau on the same eval sets and settings
  (none measured: not checked, and the reasons say so); and
* it beats the champion: by the promotion gate's verdict when the gate ran (``gate.decide``: the window's held-out
  slice and the regression set), else on the eval sets. No champion yet, or one that cannot be loaded (its draft
  gone or incomplete: it cannot be served either), leaves the floor alone to judge.

With a serving engine configured, the engine rule (``engine_gate.engine_verdict``: faster than no draft and than
the engine's own ``ngram``, each at its fastest K) must pass too: a draft it refuses is not promoted whatever the
rest says, and its reason ends the decision's.

Which measure compares drafts is decided here once (``choose_measure``): the serving engine's acceptance length
when the evaluation measured one — the engine is what serves the draft — else our decoder's tau. The register
stage, the gate and the offline drift check all ask it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.freshness.engine_gate import EngineVerdict
from specdraft.freshness.gate import GateDecision


@dataclass(frozen=True, slots=True)
class Measure:
    """What compares two drafts: the engine's acceptance length (``by_engine``) or our decoder's tau."""

    by_engine: bool

    @property
    def name(self) -> str:
        return "engine acceptance length" if self.by_engine else "tau"

    def of(self, tau: float | None, engine_tau: float | None) -> float | None:
        """A draft's value of this measure, from its tau and its engine acceptance (None: not measured)."""
        return engine_tau if self.by_engine else tau


def choose_measure(engine_tau: float | None) -> Measure:
    """The engine's acceptance length when the evaluation measured one (not None), else tau."""
    return Measure(by_engine=engine_tau is not None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Measures:
    """A candidate's numbers from one evaluation: its mean tau, the prompt-lookup floor's (``floor``; None: not
    measured) and the serving engine's mean acceptance length (None: no engine measured it)."""

    tau: float
    floor: float | None = None
    engine_tau: float | None = None

    @property
    def measure(self) -> Measure:
        return choose_measure(self.engine_tau)

    @property
    def value(self) -> float | None:
        """The candidate's value of ``measure``."""
        return self.measure.of(self.tau, self.engine_tau)

    @property
    def above_floor(self) -> bool | None:
        """Whether tau beats the prompt-lookup floor; None when no floor was measured."""
        return None if self.floor is None else self.tau > self.floor


@dataclass(frozen=True, kw_only=True, slots=True)
class Champion:
    """The alias's holder as the decision sees it: its value of the candidate's measure on the same eval sets
    (None: unknown) and why it cannot be loaded ("" when it can)."""

    value: float | None = None
    unusable: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Promotion:
    """The decision: ``promote``, the floor's verdict, what compared the drafts, and the reasons in order (the
    floor's first, then the champion's or the gate's)."""

    promote: bool
    above_floor: bool | None
    compared_by: str
    reasons: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        """The reasons as one line (the registry's ``gate.reason`` tag and the summary)."""
        return "; ".join(self.reasons)


def decide_promotion(measures: Measures, champion: Champion | None, gate: GateDecision | None = None,
                     engine: EngineVerdict | None = None) -> Promotion:
    """Promote the candidate with ``measures`` over ``champion`` (None: there is none yet)? ``gate``: the
    promotion gate's verdict, when it ran (it replaces the comparison on the eval sets); it is not asked below
    the floor or with an unusable champion, and is ignored there. ``engine``: the engine rule's verdict (None: no
    engine measured the draft), which must pass as well."""
    decided = _decide(measures, champion, gate)
    if engine is None:
        return decided
    return Promotion(promote=decided.promote and engine.passed, above_floor=decided.above_floor,
                     compared_by=decided.compared_by,
                     reasons=[*decided.reasons, f"engine gate {'passed' if engine.passed else 'refused'}: "
                                                f"{engine.reason}"])


def _decide(measures: Measures, champion: Champion | None, gate: GateDecision | None) -> Promotion:
    """The floor, the champion and the gate's decision (``decide_promotion`` without the engine rule)."""
    measure, above = measures.measure, measures.above_floor
    decided = dict(above_floor=above, compared_by=measure.name)
    if above is False:
        return Promotion(promote=False, reasons=[
            f"tau {measures.tau:.4f} <= prompt-lookup floor tau_pld {measures.floor:.4f}: the draft does not beat "
            "training-free prompt lookup, not promoted"], **decided)
    floor = ("no prompt-lookup floor measured" if above is None
             else f"tau {measures.tau:.4f} > prompt-lookup floor {measures.floor:.4f}")
    if champion is not None and champion.unusable:
        return Promotion(promote=True, reasons=[floor, "the champion could not be loaded, not compared (judged "
                                                       f"against the floor alone): {champion.unusable}"], **decided)
    if gate is not None:
        return Promotion(promote=gate.promote, reasons=[floor, gate.reason], **decided)
    if champion is None:
        return Promotion(promote=True, reasons=[floor, "no champion yet"], **decided)
    short = "engine acceptance" if measure.by_engine else "tau"
    if champion.value is None:
        return Promotion(promote=False, reasons=[floor, f"champion {short} unknown on these eval sets"], **decided)
    beats = measures.value > champion.value
    return Promotion(promote=beats, reasons=[
        floor, f"{short} {measures.value:.4f} {'>' if beats else '<='} champion {champion.value:.4f}"], **decided)
