"""Issue 31 item 9: a training run stopped by ctrl-C, or by a corrupt chunk in a Ray Train worker, says so in one
line — the conventional exit status 130 and "rerun to resume" for ctrl-C; the store error with the path of the
full log for a worker's failure — instead of a traceback or ~65 lines of tracebacks forwarded from the workers
(``flows/cli.py`` ``main``, ``pipelines/cluster.py`` ``SAID_BY_THE_DRIVER``).

Real ``specdraft train`` runs in a subprocess, as a user runs them (Ray's forwarded worker output reaches the
process's own stderr, which only a subprocess shows), on a tiny toy target and a store of random features.

The ctrl-C run (two Ray Train workers) is also issue 31 deliver 3's: while it trains, nothing of ours listens
outside the loopback interface. Every listening TCP socket of that process and its descendants (the driver, Ray's
GCS, raylet and agents, the train controller and workers with torch.distributed's rendezvous store and gloo pairs)
is read with ``ss -ltnp`` from its start until the workers have been seen training; each must be bound to a
loopback address (``pipelines/rendezvous.py``, ``pipelines/cluster.py``). One run for both: a training run's
start-up (its own Ray, the workers) is most of either test's time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.test_integrity import toy_store

ROOT = Path(__file__).resolve().parents[2]


def train_argv(store: Path, target: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", "--store", str(store), "--target", str(target), "--out",
            str(out), "recipe=eagle", "min_steps=1", "reader.max_tokens=256", "reader.val_fraction=0.0",
            "reader.shuffle=false", "scaling.num_workers=1", "tracking.enabled=false", *extra]


@pytest.mark.slow  # a real training run on one Ray Train worker
def test_a_corrupt_chunk_in_a_ray_train_worker_is_one_line_with_the_path_of_the_full_log(tiny_toy_target, tmp_path):
    """A truncated chunk read in the Ray Train worker (the error crosses the worker boundary): exit 1 and one line
    naming store, shard, array and chunk (``docs/guarantees.md``'s ``corrupt-chunk`` and ``ray-worker-failure``
    cases: one run, as the user's terminal shows it), not the worker's traceback."""
    root = toy_store(tmp_path / "store", tiny_toy_target)
    chunk = root / "shard-00000.zarr/hidden/c/0/0"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    result = subprocess.run(train_argv(root, tiny_toy_target, tmp_path / "run", "epochs=[1]", "checkpoint_every=0"),
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]  # today: ~65 lines of them
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("specdraft train: store error: corrupt feature store "), result.stderr[-3000:]
    for part in (str(root), "shard-00000.zarr", "array hidden", "chunk c/0/0"):
        assert part in line, (part, line)
    log = Path(line.rsplit("(full log: ", 1)[1].rstrip(")"))
    assert log.is_file() and "Traceback" in log.read_text() and "shard-00000.zarr" in log.read_text()


LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|\[::1\]|\[::ffff:127\.\d+\.\d+\.\d+\]):\d+$")
USERS = re.compile(r'\("([^"]*)",pid=(\d+),')


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo += children.get(p, [])
    return found


def listening(pids: set[int]) -> list[tuple[str, int, str]]:
    """(local address, pid, process name) of every listening TCP socket (IPv4 and IPv6) of ``pids``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        for name, pid in USERS.findall(line):
            if int(pid) in pids:
                try:  # the process's title (Ray's workers name themselves ``ray::RayTrainWorker...``)
                    name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() or name
                except OSError:
                    pass
                found.append((parts[3], int(pid), name))
    return found


@pytest.mark.slow  # a real training run on two Ray Train workers, watched, then interrupted
def test_ctrl_c_exits_130_with_one_line_saying_rerun_to_resume(tiny_toy_target, tmp_path):
    watch = shutil.which("ss") is not None  # without ss (iproute2): ctrl-C checked, the sockets not (a skip says so)
    root = toy_store(tmp_path / "store", tiny_toy_target)
    out = tmp_path / "run"
    proc = subprocess.Popen(train_argv(root, tiny_toy_target, out, "epochs=[200]", "checkpoint_every=5",
                                       "scaling.num_workers=2"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stepping = threading.Event()  # training has started: the workers' first progress lines
    printed: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def read(name: str) -> None:  # both pipes drained while the run is watched (a full pipe would stall it)
        for line in getattr(proc, name):
            printed[name].append(line)
            if name == "stdout" and "optimizer steps" in line:
                stepping.set()

    readers = [threading.Thread(target=read, args=(name,), daemon=True) for name in printed]
    for reader in readers:
        reader.start()
    seen: dict[str, tuple[int, str]] = {}
    titles: dict[int, set[str]] = {}  # every title each listening process had (a Ray worker's changes with its task)

    def train_workers() -> tuple[set[int], set[str]]:
        """The train workers (told by pid: a title is whatever task the worker ran at that poll) and their sockets:
        besides the one gRPC port each Ray worker opens when it starts (while still ``ray::IDLE``), a training
        worker listens on more (rank 0's rendezvous store, gloo's pairs)."""
        workers = {pid for pid, names in titles.items() if any("RayTrainWorker" in name for name in names)}
        return workers, {addr for addr, (pid, _) in seen.items() if pid in workers}

    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            for addr, pid, name in listening(descendants(proc.pid)) if watch else []:
                seen.setdefault(addr, (pid, name))
                titles.setdefault(pid, set()).add(name)
            workers, theirs = train_workers()
            if stepping.is_set() and (not watch or (len(workers) == 2 and len(theirs) > len(workers))):
                break
            time.sleep(0.1)
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before it was seen training"
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGINT)  # what ctrl-C in a terminal sends: the whole foreground group
        proc.wait(timeout=180)
        for reader in readers:
            reader.join(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = "".join(printed["stderr"])
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])  # before: 1, with a traceback
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1] == "specdraft train: interrupted — rerun the same command to resume", stderr[-3000:]
    assert "Traceback" not in stderr + "".join(printed["stdout"]), stderr[-3000:]
    assert not (out / ".specdraft-lock").exists()  # released: the rerun is not refused
    if not watch:
        pytest.skip("ctrl-C checked; ss (iproute2) is not installed here: the run's sockets were not watched")
    workers, theirs = train_workers()  # the run was seen training, both workers with their own sockets
    assert len(workers) == 2 and len(theirs) > len(workers), (titles, seen)
    exposed = {addr: who for addr, who in seen.items() if not LOOPBACK.match(addr)}
    assert not exposed, exposed  # before: the rank-0 worker's TCPStore on *:PORT
