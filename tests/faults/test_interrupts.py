"""Issue 31 item 9: a training run stopped by ctrl-C, or by a corrupt chunk in a Ray Train worker, says so in one
line — the conventional exit status 130 and "rerun to resume" for ctrl-C; the store error with the path of the
full log for a worker's failure — instead of a traceback or ~65 lines of tracebacks forwarded from the workers
(``flows/cli.py`` ``main``, ``pipelines/cluster.py`` ``SAID_BY_THE_DRIVER``).

Real ``specdraft train`` runs in a subprocess, as a user runs them (Ray's forwarded worker output reaches the
process's own stderr, which only a subprocess shows), on a tiny toy target and a store of random features.
"""

from __future__ import annotations

import os
import signal
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


@pytest.mark.slow  # a real training run on one Ray Train worker, interrupted
def test_ctrl_c_exits_130_with_one_line_saying_rerun_to_resume(tiny_toy_target, tmp_path):
    root = toy_store(tmp_path / "store", tiny_toy_target)
    out = tmp_path / "run"
    proc = subprocess.Popen(train_argv(root, tiny_toy_target, out, "epochs=[200]", "checkpoint_every=5"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # training has started: the workers' first progress lines
            if "optimizer steps" in line:
                break
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGINT)  # what ctrl-C in a terminal sends: the whole foreground group
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, stderr[-3000:])  # today: 1, with a traceback
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1] == "specdraft train: interrupted — rerun the same command to resume", stderr[-3000:]
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    assert not (out / ".specdraft-lock").exists()  # released: the rerun is not refused
