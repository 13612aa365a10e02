"""Servers and workers started by the end-to-end tests (the README's commands, the served monitor, the cluster test's
deployment) and the benchmarks that run the deployment (``benchmarks.nightly_days``): a free port on 127.0.0.1, a
process in its own process group, waiting for an HTTP answer, and stopping it for sure; the nightly deployment as
docs/operations.md runs it (``prefect_deployment``: a Prefect server, the repository's ``prefect.yaml`` deployed, a
process worker) and a flow run followed to its end (``flow_run_end``) and its run summary (``flow_run_summary``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

PREFECT = [sys.executable, "-m", "prefect"]
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")  # a flow run's final state types


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, log: Path, cwd: Path) -> subprocess.Popen:
    """``cmd`` in its own process group (``stop`` ends it and its children), its output in ``log``."""
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL (a worker whose server has gone may ignore SIGTERM)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=15)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until ``url`` answers 200; fails with the end of ``log`` if ``proc`` exits or ``timeout`` passes."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"{proc.args} exited:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"{url} did not answer in {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(1)


def prefect(args: list[str], env: dict[str, str], cwd: Path, timeout: int = 300) -> str:
    """``prefect ARGS`` run to its end in ``cwd``; its stdout, or a ``RuntimeError`` with its output's end."""
    out = subprocess.run(PREFECT + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


@contextmanager
def prefect_deployment(home: Path, env: dict[str, str], cwd: Path, worker_poll_s: int = 10
                       ) -> Iterator[tuple[str, dict[str, str]]]:
    """The nightly deployment as docs/operations.md runs it: ``prefect server start`` on 127.0.0.1 (a free port, its
    database in ``home``: ``PREFECT_HOME``; no telemetry; the flow runs' logs streamed out for ``--watch``), the work
    pool, ``prefect --no-prompt deploy --all`` from ``cwd`` (a checkout holding ``prefect.yaml``; the deployment
    runs its flows there) and ``prefect worker start`` (polling every ``worker_poll_s``). Yields the API's URL and the
    environment ``prefect`` commands need; stops the worker (its flow runs are in its process group) and the server
    on the way out. Their output: ``home/server.log``, ``home/worker.log``."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**env, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1", "PWD": str(cwd), "PYTHONUNBUFFERED": "1",
           "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true", "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
           "PREFECT_WORKER_QUERY_SECONDS": str(worker_poll_s)}
    server = start(PREFECT + ["server", "start", "--host", "127.0.0.1", "--port", str(port)], env,
                   home / "server.log", cwd)
    worker = None
    try:
        wait_http(f"{api}/health", server, home / "server.log", timeout=600)
        prefect(["work-pool", "create", "specdraft-process", "--type", "process", "--overwrite"], env, cwd)
        prefect(["--no-prompt", "deploy", "--all"], env, cwd)
        worker = start(PREFECT + ["worker", "start", "--pool", "specdraft-process"], env, home / "worker.log", cwd)
        yield api, env
    finally:
        if worker is not None:
            stop(worker)
        stop(server)


def flow_run_end(api: str, flow_run_id: str, timeout: float) -> dict[str, Any]:
    """The flow run's state once final (``FINAL``), or its state when ``timeout`` seconds have passed."""
    deadline = time.time() + timeout
    while True:
        state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=30).json()["state"]
        if state["type"] in FINAL or time.time() > deadline:
            return state
        time.sleep(3)


def flow_run_summary(api: str, flow_run_id: str, wait_s: float = 120) -> str:
    """The run summary the flow logged last (``run summary``), "" if none reached the API within ``wait_s`` (the
    flow run's process ships its logs in batches and flushes the last ones as it exits, after its final state)."""
    deadline = time.time() + wait_s
    while True:
        logs = httpx.post(f"{api}/logs/filter", timeout=30, json={
            "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_DESC", "limit": 200}).json()
        summary = next((log["message"].split("\n", 1)[1] for log in logs
                        if log["message"].startswith("run summary\n")), "")
        if summary or time.time() > deadline:
            return summary
        time.sleep(3)
