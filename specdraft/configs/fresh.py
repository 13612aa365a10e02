"""Settings of keeping the draft fresh: the traffic window, the served drift monitor, the promotion
gate and the hand-off to serving.

Each is a frozen dataclass that checks its own values and raises ``ConfigError`` naming the key (as the run
config spells it: ``data.traffic.days``, ``monitor.max_drop``, ``gate.margin``). Nothing heavy is imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from specdraft.config import ConfigError

DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{key}={value}: must be >= {low}")


def _share(key: str, value: float, high: float = 1.0) -> None:
    if not 0.0 <= value <= high:
        raise ConfigError(f"{key}={value}: must be between 0 and {high}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrafficSettings:
    """``data.traffic``: dated request logs as the run's prompts (``specdraft/freshness/traffic.py``)."""

    path: str = ""  # directory or s3:// prefix holding YYYY-MM-DD/*.jsonl; "" = off (data.prompts is read)
    days: int = 7  # the window: the newest `days` days up to `end`
    end: str = ""  # the window's last day, YYYY-MM-DD; "" = the newest day present
    max_conversations: int = 10_000  # at most this many window conversations (newest days first)
    replay: float = 0.2  # replayed rows from earlier days, as a share of the window's rows
    replay_days: int = 28  # how far back before the window replay draws from
    served_model: str = ""  # a logged response whose model is this one is reused as is; "" = regenerate all
    held_out: float = 0.1  # share of the window kept out of training: the drift and gate slice
    seed: int = 0  # replay sampling and the held-out split

    def __post_init__(self) -> None:
        _at_least("data.traffic.days", self.days, 1)
        _at_least("data.traffic.max_conversations", self.max_conversations, 1)
        _at_least("data.traffic.replay_days", self.replay_days, 0)
        _share("data.traffic.replay", self.replay, 10.0)
        _share("data.traffic.held_out", self.held_out, 0.5)
        if self.end and not DAY.match(self.end):
            raise ConfigError(f"data.traffic.end={self.end!r}: expected YYYY-MM-DD (or empty: the newest day)")


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorSettings:
    """``monitor``: the served acceptance read from a vLLM server's Prometheus ``/metrics``."""

    metrics_url: str = ""  # e.g. http://127.0.0.1:8000/metrics; "" = off
    state: str = ""  # the last reading (JSON); "" = <workdir>/monitor/state.json
    max_drop: float = 0.10  # alarm when served acceptance falls by more than this share of its promotion value
    timeout_s: float = 10.0
    # offline drift: each night, before training, the champion evaluated on the traffic window's held-out slice
    offline: bool = False

    def __post_init__(self) -> None:
        _share("monitor.max_drop", self.max_drop)
        if self.timeout_s <= 0:
            raise ConfigError(f"monitor.timeout_s={self.timeout_s}: must be > 0")
        if self.metrics_url and not self.metrics_url.startswith(("http://", "https://")):
            raise ConfigError(f"monitor.metrics_url={self.metrics_url!r}: expected an http(s):// URL")


@dataclass(frozen=True, kw_only=True, slots=True)
class GateSettings:
    """``gate``: promote a candidate only when it wins on the window and does not regress elsewhere."""

    enabled: bool = False  # False: the registry's plain champion comparison (mean tau on the eval sets)
    margin: float = 0.0  # the candidate's window tau must exceed the champion's by more than this share
    max_regression: float = 0.02  # the most the candidate may lose against the champion on the regression set
    # the regression set: the eval sets plus at most this many questions of earlier traffic windows' held-out
    # slices (kept under <workdir>/traffic/heldout/; 0: the eval sets alone)
    regression_max_questions: int = 200

    def __post_init__(self) -> None:
        _share("gate.margin", self.margin)
        _share("gate.max_regression", self.max_regression)
        _at_least("gate.regression_max_questions", self.regression_max_questions, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoffSettings:
    """``handoff``: the promoted draft copied to a stable place a server reads (``specdraft/freshness/handoff.py``)."""

    enabled: bool = True
    exports: str = ""  # the directory holding current/ and previous/; "" = <workdir>/exports


RETRAIN_POLICIES = ("always", "when_it_pays")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetrainSettings:
    """``retrain``: whether a night trains (``specdraft/freshness/retraining.py``)."""

    policy: str = "always"  # always | when_it_pays: train on drift or enough new traffic, else skip the night
    min_new_share: float = 0.2  # when_it_pays: the share of the window's training rows new since the last trained night

    def __post_init__(self) -> None:
        if self.policy not in RETRAIN_POLICIES:
            raise ConfigError(f"retrain.policy={self.policy!r}: expected one of {list(RETRAIN_POLICIES)}")
        _share("retrain.min_new_share", self.min_new_share)
