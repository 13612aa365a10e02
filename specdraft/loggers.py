"""Metric loggers: the protocol every stage logs through, and the plain implementations.

Code receives a logger and never branches on whether tracking is on (the null object
``NullLogger`` stands in). The MLflow implementation lives in ``pipelines/`` because
``specdraft`` never imports mlflow.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO


class MetricLogger(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    def log_params(self, params: dict[str, Any]) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        return None

    def close(self) -> None:
        return None


class JsonlLogger:
    """One JSON object per call: ``{"kind": "params"|"metrics", "step": .., "time": .., ...}``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = self.path.open("a")

    def _write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, default=str) + "\n")
        self._fh.flush()

    def log_params(self, params: dict[str, Any]) -> None:
        self._write({"kind": "params", "time": time.time(), **params})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"kind": "metrics", "step": step, "time": time.time(), **metrics})

    def close(self) -> None:
        self._fh.close()


class StdoutLogger:
    """Compact human-readable lines, every ``every`` steps."""

    def __init__(self, every: int = 50, stream: TextIO = sys.stdout):
        self.every, self.stream = every, stream

    def log_params(self, params: dict[str, Any]) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step % self.every:
            return
        shown = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))
        print(f"step {step}: {shown}", file=self.stream, flush=True)

    def close(self) -> None:
        return None


class MultiLogger:
    def __init__(self, *loggers: MetricLogger):
        self.loggers = loggers

    def log_params(self, params: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()
