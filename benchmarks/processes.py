"""Servers and workers started by the end-to-end tests (the README's commands, the served monitor) and the
benchmarks that run the deployment (``benchmarks.nightly_days``): a free port on 127.0.0.1, a process in its own
process group, waiting for an HTTP answer, and stopping it for sure."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


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
