"""Issue 31 item 2 and part of 9: one writer per ``--out``, and a refused command leaves no ``--out`` behind.

Through the real CLI (``flows.cli.main``) on real files, with the lock held by another real process: a second
run into a directory being written is refused (exit 2, one line naming the lock file and its holder), for
``train``, ``dump`` and ``regenerate``; a lock left by a dead process of this host is taken over with one line
(``specdraft/outputs.py``: ``held_output``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli import main
from specdraft.outputs import LOCK, MARKER, held_output
from specdraft.toy.build import PREBUILT_DIR

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from specdraft.outputs import held_output
with held_output(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture()
def holder(tmp_path):
    """Another live process holding ``--out``'s lock as ``command`` would (yields its pid)."""
    procs = []

    def hold(out: Path, command: str) -> int:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), command], cwd=ROOT, stdout=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc.pid

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("command", ["train", "dump", "regenerate"])
def test_a_second_run_into_an_out_being_written_is_refused_naming_the_lock_and_its_holder(command, holder, tmp_path,
                                                                                          capsys):
    out = tmp_path / "out"
    (tmp_path / "prompts.jsonl").write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "store").mkdir()
    pid = holder(out, command)
    inputs = {"train": ["--store", str(tmp_path / "store")], "dump": ["--prompts", str(tmp_path / "prompts.jsonl")],
              "regenerate": ["--prompts", str(tmp_path / "prompts.jsonl")]}[command]
    capsys.readouterr()
    # today: no lock — both runs write the same directory and both exit 0
    assert main([command, "--target", str(PREBUILT_DIR), "--out", str(out), *inputs]) == 2
    line = one_line(capsys)
    for part in (str(out / LOCK), f"pid {pid}", socket.gethostname(), f"specdraft {command}"):
        assert part in line, (part, line)
    assert json.loads((out / LOCK).read_text())["pid"] == pid  # the holder's lock is untouched


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_one_line(tmp_path, capsys):
    out = tmp_path / "data"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "command": "toy-data"}))
    capsys.readouterr()
    assert main(["toy-data", "--out", str(out), "--prompts", "3", "--questions", "2"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "stale lock" in lines[0] and f"pid {dead.pid}" in lines[0], err
    assert (out / "toy_prompts.jsonl").is_file() and not (out / LOCK).exists()  # released at the end


def test_a_lock_of_another_host_is_never_taken_over(tmp_path, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": "elsewhere.example", "command": "toy-data"}))
    capsys.readouterr()
    assert main(["toy-data", "--out", str(out)]) == 2
    assert "elsewhere.example" in one_line(capsys)
    assert not (out / "toy_prompts.jsonl").exists()


def test_a_refused_train_leaves_no_out_behind(tmp_path, capsys):
    """Refused after the pre-flight (the store is no store): exit 1 and no ``--out`` holding only the marker."""
    (tmp_path / "store").mkdir()
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--store", str(tmp_path / "store"), "--target", str(PREBUILT_DIR), "--out", str(out)]) == 1
    assert "no manifest.json" in capsys.readouterr().err
    assert not out.exists()  # today: out/ holding .specdraft-output.json alone
    # an empty directory the user made stays, empty
    out.mkdir()
    assert main(["train", "--store", str(tmp_path / "store"), "--target", str(PREBUILT_DIR), "--out", str(out)]) == 1
    assert out.is_dir() and not any(out.iterdir())


def test_a_finished_run_releases_its_lock_and_keeps_its_marker(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["toy-data", "--out", str(out), "--prompts", "2", "--questions", "1"]) == 0
    assert (out / MARKER).is_file() and not (out / LOCK).exists()
    assert main(["toy-data", "--out", str(out), "--prompts", "2", "--questions", "1"]) == 0  # its own: a rerun


def test_a_second_run_on_a_workdir_being_run_is_refused_and_so_is_the_flow(holder, tmp_path, capsys, monkeypatch):
    """Issue 44: two `specdraft run` on one workdir trained the same sequences twice. The CLI refuses before Prefect
    starts (exit 2, one line); the flow itself — a deployment's run — refuses too, before any stage."""
    from flows.regenerate_and_train import regenerate_and_train
    from specdraft.outputs import OutputLocked

    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "runs"
    pid = holder(workdir, "run")
    capsys.readouterr()
    assert main(["run", f"workdir={workdir}", "tracking.enabled=false"]) == 2  # today: a second run starts
    line = one_line(capsys)
    for part in (str(workdir / LOCK), f"pid {pid}", "specdraft run"):
        assert part in line, (part, line)
    with pytest.raises(OutputLocked, match=f"pid {pid}"):
        regenerate_and_train.fn(config=str(ROOT / "configs/toy.yaml"),
                                overrides=[f"workdir={workdir}", "tracking.enabled=false"])
    assert [p.name for p in workdir.iterdir()] == [LOCK]  # nothing written, the holder's lock untouched
    assert json.loads((workdir / LOCK).read_text())["pid"] == pid


def test_a_lock_this_process_holds_is_held_again_and_released_by_the_outer_hold(tmp_path):
    """`specdraft run` holds its workdir around the flow, which holds it again: the inner hold neither refuses its
    own process nor releases the outer's lock."""
    out = tmp_path / "runs"
    with held_output(out, "run"):
        with held_output(out, "run"):
            assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
            (out / "stage").mkdir()
        assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()  # still held
    assert not (out / LOCK).exists() and (out / "stage").is_dir()
