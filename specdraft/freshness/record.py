"""What a night keeps of its traffic window (``pipelines.stages.prepare_traffic``): the prepare stage's
``Prepared.traffic``, read by the drift check, the retrain decision, the gate and the summary.

Plain values only (paths as strings): it crosses Prefect task boundaries and is written into the run's summary;
``from_dict`` reads that dict back (unknown keys refused).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft import config


@dataclass(frozen=True, kw_only=True, slots=True)
class TrafficFiles:
    """The window's files under ``<workdir>/traffic/<key>/`` (``traffic.write_window``); "" where none was
    written (a file with no rows is not written)."""

    window: str = ""  # window.json: days, counts, warnings
    prompts: str = ""  # prompts.jsonl: to regenerate
    reused: str = ""  # reused.jsonl: the served model's logged answers, not regenerated
    held_out: str = ""  # held_out.jsonl: the window's held-out slice (questions), never trained on
    rejects: str = ""  # rejects.jsonl: {file, line, reason, detail}
    trained_rows: str = ""  # trained_rows.json: the prompt hashes of the rows trained on
    regression: str = ""  # regression.jsonl: the earlier windows' held-out questions (gate.enabled)


@dataclass(frozen=True, kw_only=True, slots=True)
class RegressionCounts:
    """The gate's regression set (``traffic.regression_questions``): the earlier windows' held-out questions
    taken, the windows they came from (newest first), those over ``max_questions``, the kept slices' lines that
    are no question (``rejected``, each in ``rejects``), and the eval sets beside them."""

    questions: int = 0
    windows: list[str] = field(default_factory=list)
    over_cap: int = 0
    rejected: int = 0
    eval_sets: int = 0
    max_questions: int = 0
    rejects: list[dict[str, Any]] = field(default_factory=list)  # {file, line, reason, detail}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrafficRecord:
    """One night's window: its key (settings and content), last day, days read (newest first), the replay's
    days, the counts (``traffic.read_window``: ``read``, ``rejected``, ``rejected.<reason>`` …), the warnings
    and the files; ``regression`` with ``gate.enabled``."""

    key: str = ""
    end: str = ""  # the window's last day, YYYY-MM-DD
    days: list[str] = field(default_factory=list)
    replay_days: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    files: TrafficFiles = field(default_factory=TrafficFiles)
    regression: RegressionCounts | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrafficRecord:
        return config.from_dict(cls, data, "traffic")
