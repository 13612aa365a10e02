"""What a trainer adds to ``specdraft.run.Run.fit`` — every trainer's loop: the Ray Train worker's, the
quickstart's, the benchmarks' — and what it hands back.

``RunHooks``: the caller's own part of the loop (the Ray worker's reports to Ray Train and its checkpoints, a
progress bar, a benchmark's memory peak); metrics reach their trackers through the trainer's logger
(``specdraft.loggers``; ``build_run(logger=...)``), so the core stays free of Ray and MLflow. ``Fitted``: the
held-out acceptance before and after training, an ``EpochEnd`` per epoch and the loop's times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdraft.acceptance import AcceptanceCounts

VALIDATE = ("before", "epoch", "after")  # when ``Run.fit`` measures the held-out acceptance


@dataclass(frozen=True)
class EpochEnd:
    """One epoch as ``Run.fit`` ended it."""

    stage: int
    kind: str  # the stage's kind
    epoch: int  # the stage's epochs done (1: its first)
    step: int  # optimizer steps done
    losses: tuple[float, ...]  # of this epoch's optimizer steps in this process (a resumed epoch: its rest)
    counts: AcceptanceCounts | None  # the held-out acceptance (None: not validated after each epoch)
    metrics: dict[str, float]  # what its end logged: sim_tau, alpha_i when measured; the hooks' epoch_metrics

    @property
    def loss_mean(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


@dataclass
class Fitted:
    """What ``Run.fit`` measured: the held-out acceptance before and after, each epoch's end, and its times."""

    before: AcceptanceCounts | None = None  # None: not asked
    after: AcceptanceCounts | None = None
    epochs: list[EpochEnd] = field(default_factory=list)
    before_s: float = 0.0  # the validation before training
    loop_s: float = 0.0  # the loop's wall time, the validation after each epoch included
    loop_cpu_s: float = 0.0  # this process's CPU time of the loop (all its threads)
    val_s: float = 0.0  # the validation after each epoch: its wall time
    val_cpu_s: float = 0.0  # and its CPU time


def _nothing(*_: Any) -> None:
    return None


def _no_metrics(*_: Any) -> dict[str, float]:
    return {}


@dataclass(frozen=True, kw_only=True)
class RunHooks:
    """A trainer's own part of ``Run.fit``: functions of the run (``specdraft.run.Run``), each doing nothing unless
    given."""

    loop_start: Callable[[Any], None] = _nothing  # once, after the validation before training, before the first step
    step: Callable[[Any, dict[str, float]], None] = _nothing  # after each optimizer step (its metrics logged)
    epoch_metrics: Callable[[Any], dict[str, float]] = _no_metrics  # logged at each epoch's end beside the validation's
    #   (every rank calls it: collectives go here)
    epoch_end: Callable[[Any, EpochEnd], None] = _nothing  # after each epoch's validation and metrics were logged
    loop_end: Callable[[Any], None] = _nothing  # once, after the last step, before the validation after training
