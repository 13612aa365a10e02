"""The Ray head lost mid-run: one line naming its address and how to resume, a non-zero exit — not Ray's.

A driver connected to a cluster by address talks to the head's GCS; when the head dies, Ray's core worker retries
for ``gcs_rpc_server_reconnect_timeout_s`` (60 s by default; longer where the GCS is fault tolerant and a restarted
head is waited for) and then ends the process from C++, with log lines about ``gcs_server.out`` and no word of
what the run should do next. ``watch_head`` (started by ``pipelines.cluster.connect_ray`` for a cluster given by
a GCS address) checks the head's port every ``POLL_S``; once nothing has answered there for as long as Ray would have
waited, it prints ``head_lost_line`` (the address, that the run stopped, and the command that resumes it: finished
stages are kept and skipped, unfinished ones resume) and ends the process with ``EXIT_HEAD_LOST`` — a second
before Ray would (Ray's own wait is moved ``RAY_MARGIN_S`` later, in this process only). A run that disconnects
first (``ray.shutdown``) stops the watch.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import threading
import time
from pathlib import Path

from pipelines.nodes import host_port

RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"  # Ray's wait for a lost GCS, in the driver's process
RAY_DEFAULT_S = 60.0  # Ray's default of it
RAY_MARGIN_S = 30.0  # Ray's wait moved this much past ours, so our line ends the process, not Ray's
POLL_S = 1.0
EXIT_HEAD_LOST = 1  # a failed run (docs/guarantees.md): not bad input (2), not an interrupt (130)
USER_WAIT = os.environ.get(RECONNECT_ENV)  # the user's setting, before ``ray_wait`` moves Ray's


def rerun_command(argv: list[str] | None = None) -> str:
    """The command that resumes this run: this ``specdraft`` command line, else "the same command"."""
    argv = sys.argv if argv is None else argv
    name = Path(argv[0]).name if argv else ""
    if name == "specdraft" or (name == "cli.py" and Path(argv[0]).parent.name == "flows"):
        return shlex.join(["specdraft", *argv[1:]])
    return "the same command"


def head_lost_line(address: str, waited_s: float, command: str) -> str:
    return (f"specdraft: lost the Ray head at {address} (nothing has answered there for {waited_s:.0f} s): the run "
            f"stopped — start the cluster's head again (or point ray.address / RAY_ADDRESS at a running one), then "
            f"resume with: {command}")


def _answers(where: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(where, timeout=POLL_S):
            return True
    except OSError:
        return False


def ray_wait() -> float:
    """Before ``ray.init``: how long Ray would wait for a lost head (``RECONNECT_ENV`` or Ray's default), and Ray's
    own wait moved ``RAY_MARGIN_S`` past it in this process (Ray reads it when its core worker starts)."""
    wait_s = float(USER_WAIT or RAY_DEFAULT_S)
    os.environ[RECONNECT_ENV] = str(int(wait_s + RAY_MARGIN_S))
    return wait_s


def watch_head(address: str, wait_s: float) -> threading.Thread | None:
    """Watch the head at ``address`` (after ``ray.init`` connected to it; ``wait_s``: ``ray_wait()``'s) on a
    daemon thread; None when there is no port to watch (``auto`` with no cluster found) or it is a Ray Client's
    (``ray://``: a lost head is a ``ConnectionError`` in this process, said as any failure is)."""
    import ray

    where = None if address.startswith("ray://") else host_port(address)
    if where is None:
        return None
    gcs = ray.get_runtime_context().gcs_address

    def watch() -> None:
        silent_since = None
        while ray.is_initialized() and ray.get_runtime_context().gcs_address == gcs:
            if _answers(where):
                silent_since = None
            elif silent_since is None:
                silent_since = time.monotonic()
            elif time.monotonic() - silent_since >= wait_s and ray.is_initialized():
                print(head_lost_line(address, wait_s, rerun_command()), file=sys.stderr, flush=True)
                os._exit(EXIT_HEAD_LOST)  # the driver's core worker cannot leave otherwise: Ray would end it
            time.sleep(POLL_S)

    thread = threading.Thread(target=watch, name="ray-head-watch", daemon=True)
    thread.start()
    return thread
