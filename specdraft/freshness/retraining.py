"""Retrain only when it pays: a night trains when the served draft drifted or enough of
the traffic window is new since the last night that trained; otherwise it skips training and says why.

verl-SpeCo budgets drafter retraining from an EMA of vLLM's mean acceptance length; here the signals are the
served drift monitor's alarm (``specdraft.freshness.monitor``) and the share of new rows in the window
(``specdraft.freshness.traffic``: rows are identified by their prompt hash). A pure function over those numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from specdraft.configs.fresh import RetrainSettings


@dataclass(frozen=True, kw_only=True, slots=True)
class RetrainDecision:
    train: bool
    reason: str
    new_rows: int | None = None  # None: unknown (no traffic window)
    rows: int | None = None
    drift: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_retraining(settings: RetrainSettings, *, new_rows: int | None, rows: int | None, drift: bool,
                      drift_reason: str = "", trained_before: bool = True) -> RetrainDecision:
    """``new_rows`` of the window's ``rows`` training rows were not in the last trained night's window (None:
    no traffic window, new data unknown); ``drift``: the served acceptance alarm; ``trained_before``: a night
    has trained on this workdir's traffic before."""
    known = dict(new_rows=new_rows, rows=rows, drift=drift)
    if settings.policy == "always":
        return RetrainDecision(train=True, reason="retrain.policy=always", **known)
    if drift:
        return RetrainDecision(train=True, reason=f"drift: {drift_reason or 'the served acceptance dropped'}", **known)
    if new_rows is None or rows is None:
        return RetrainDecision(train=True, reason="no traffic window (data.traffic.path): new data unknown, training",
                               **known)
    if not trained_before:
        return RetrainDecision(train=True, reason=f"first night on this traffic: {rows} rows", **known)
    share = new_rows / rows if rows else 0.0
    enough = rows > 0 and share >= settings.min_new_share
    verdict = ">=" if enough else "<"
    text = (f"{new_rows} of {rows} rows new since the last trained night ({share:.1%} {verdict} "
            f"retrain.min_new_share {settings.min_new_share:.0%})")
    return RetrainDecision(train=enough, reason=(f"new data: {text}" if enough else
                                                 f"no drift and {text}: training skipped"), **known)
