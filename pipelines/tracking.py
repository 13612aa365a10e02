"""MLflow tracking: a ``specdraft.loggers.MetricLogger`` backed by an MLflow run, and its null twin.

Uses ``MlflowClient`` with explicit run ids (no global active run), so a driver can
create a run — possibly a child of a flow's parent run — and hand its id to the Ray
Train rank-0 worker, which attaches and logs into it. Params are flattened config
values; keys that look like secrets are never logged. With tracking disabled, ``open_run``
returns a ``NullRun``: the same methods, doing nothing, so callers never branch on
whether tracking is on (a null object instead of a flag). The flow's runs and the registry that
reads them: docs/commands.md (``specdraft run``) and docs/operations.md
"The nightly deployment".
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from pipelines.configs import DEFAULT_EXPERIMENT, TrackingConfig

SECRET_KEY = re.compile(r"(pass(word)?|secret|token|api[_-]?key|credential|access[_-]?key)", re.IGNORECASE)
def safe_params(params: dict[str, Any]) -> dict[str, str]:
    """Stringified params without secret-looking keys (MLflow caps values at 6000 chars)."""
    return {k: str(v)[:6000] for k, v in params.items() if not SECRET_KEY.search(k)}


class MlflowLogger:
    """Logs params/metrics/artifacts into one MLflow run (created here or attached by id)."""

    enabled = True  # a real run: it can hold a registered model

    def __init__(
        self,
        uri: str,
        *,
        experiment: str = DEFAULT_EXPERIMENT,
        run_id: str | None = None,
        run_name: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        artifact_location: str | None = None,
        timeout_s: int | None = None,
    ):
        self.uri = uri
        self.timeout_s = timeout_s
        if timeout_s is not None:  # every request of this process bounded (``bound_requests``)
            bound_requests(timeout_s)
        self.client = MlflowClient(tracking_uri=uri)
        self._owns_run = run_id is None  # a run attached by id is ended by whoever created it
        if run_id is None:
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment, artifact_location)
            all_tags = dict(tags or {})
            if parent_run_id:
                all_tags["mlflow.parentRunId"] = parent_run_id
            run = self.client.create_run(exp_id, run_name=run_name, tags=all_tags)
            run_id = run.info.run_id
            self._logged: dict[str, int] = {}
        else:  # attached (a resumed training worker, say): what the run already holds is not logged again
            run = self.client.get_run(run_id)
            exp_id = run.info.experiment_id
            self._logged = self._last_steps(run_id, run.data.metrics)
        self.run_id = run_id
        self.experiment_id = exp_id
        self._closed = False

    def _last_steps(self, run_id: str, keys) -> dict[str, int]:
        """The last step of every metric (``keys``) ``run_id`` holds: a Ray Train worker attached to it after a
        failure resumes from a checkpoint and re-does the steps after it, which MLflow already has (with the same
        values: the resume is exact) — they are not logged twice, so MLflow's history holds one value per step."""
        return {key: max(m.step for m in self.client.get_metric_history(run_id, key)) for key in keys}

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, v) for k, v in safe_params(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, int(step)) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and int(step) > self._logged.get(k, -1)]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_artifact(self, local_file: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def ref(self) -> dict[str, str]:
        """What another process needs to attach to this run (``MlflowLogger(uri, run_id=..., timeout_s=...)``)."""
        return {"uri": self.uri, "run_id": self.run_id, "timeout_s": self.timeout_s}

    def close(self, status: str = "FINISHED") -> None:
        if not self._closed and self._owns_run:
            self.client.set_terminated(self.run_id, status)
        self._closed = True


class NullRun:
    """Tracking disabled: ``MlflowLogger``'s methods, each doing nothing; no run id, no URI."""

    enabled = False
    run_id = None
    uri = None
    experiment_id = None

    def log_params(self, params: dict[str, Any]) -> None:
        return None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        return None

    def set_tags(self, tags: dict[str, str]) -> None:
        return None

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        return None

    def log_artifact(self, local_file: str | Path, artifact_path: str | None = None) -> None:
        return None

    def ref(self) -> None:
        """Nothing to attach to: workers log to their local files only."""
        return None

    def close(self, status: str = "FINISHED") -> None:
        return None


CHECK_TIMEOUT_S = 5.0  # how long a tracking server has to answer before any work starts


def check_tracking(cfg: TrackingConfig, *, lookup: bool = False, timeout_s: float | None = None) -> None:
    """Refuse, before any work, a tracking URI that cannot serve the command: one ``ConfigError`` line naming it
    (exit 2) instead of MLflow's minutes of retries and a message about something else; and bound every later
    request of the command (``bound_requests``: ``tracking.timeout_s``).

    An ``http(s)`` server must answer (its ``/health``, any HTTP status) within ``timeout_s`` (default: 5 s, or
    ``tracking.timeout_s`` when less); a ``sqlite`` file's directory must exist, and with ``lookup`` (reading what
    is registered: ``export --model-uri``) the file itself — a lookup never creates an empty ``mlflow.db``.
    Disabled tracking is not checked."""
    from specdraft.config import ConfigError

    if not cfg.enabled:
        return
    bound_requests(cfg.timeout_s)
    timeout_s = min(CHECK_TIMEOUT_S, cfg.timeout_s) if timeout_s is None else timeout_s
    uri = cfg.resolved_uri()
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
                pass
        except urllib.error.HTTPError:
            pass  # it answered
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise ConfigError(
                f"tracking.uri={uri}: the tracking server does not answer within {timeout_s:g} s ({reason}) — start "
                "it, point tracking.uri (or MLFLOW_TRACKING_URI) at one that runs, or pass tracking.enabled=false"
            ) from None
    elif scheme == "sqlite":
        path = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        if path is not None and lookup and not path.is_file():
            raise ConfigError(f"tracking.uri={uri}: no tracking store there (nothing is registered to look up) — "
                              "pass --tracking-uri (or MLFLOW_TRACKING_URI) naming the registry the draft is in")
        if path is not None and not path.parent.is_dir():
            raise ConfigError(f"tracking.uri={uri}: the directory {path.parent} does not exist")


def open_run(cfg: TrackingConfig, **kwargs: Any) -> MlflowLogger | NullRun:
    """A new run for ``cfg`` (``kwargs``: run_name, parent_run_id, tags), or a ``NullRun`` when tracking is disabled."""
    if not cfg.enabled:
        return NullRun()
    return MlflowLogger(cfg.resolved_uri(), experiment=cfg.experiment, artifact_location=cfg.artifact_location,
                        timeout_s=cfg.timeout_s, **kwargs)


# MLflow reads these at every request (mlflow/environment_variables.py, mlflow/utils/rest_utils.py http_request)
REQUEST_ENV = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
               "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER")


def bound_requests(timeout_s: int) -> None:
    """Every MLflow HTTP request of this process — and of the processes it starts afterwards (a local Ray
    cluster's workers inherit the environment) — waits at most ``timeout_s`` (``tracking.timeout_s``) in all: two
    tries of half of it each, no backoff. Set in MLflow's environment variables (``REQUEST_ENV``), which the
    setting overrides."""
    os.environ.update(dict(zip(REQUEST_ENV, (str(max(1, timeout_s // 2)), "1", "0", "0"))))
    _BOUND["timeout_s"] = timeout_s


_BOUND: dict[str, int] = {}  # the bound this process applied last (``tracking_failure`` names it)


def tracking_failure(err: BaseException) -> str | None:
    """One line for an MLflow request that failed on a silent or unreachable server (``err`` or an exception it
    was raised from): the server's URL as MLflow named it, and the bound; None for any other error."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if type(err).__name__ == "MlflowException" and text.startswith("API request to "):
            url = text.removeprefix("API request to ").split(" ", 1)[0]
            timed_out = "timeout" in text.lower() or "timed out" in text.lower()
            bound = f"tracking.timeout_s={_BOUND['timeout_s']} s" if _BOUND else "MLflow's own timeout"
            why = f"did not answer within {bound}" if timed_out else "could not be reached"
            server = "/".join(url.split("/")[:3])
            return (f"the tracking server {server} {why} ({url}) — check it, raise tracking.timeout_s, or pass "
                    "tracking.enabled=false")
        err = err.__cause__ or err.__context__
    return None
