"""docs/guarantees.md states exit statuses the commands really return (issue 31, deliver 2).

The page's "Exit codes" table is read: every case it lists is run here through the command line
(``flows.cli.main``, in this process) where that takes seconds, and its status compared with the table's;
a case that needs a training run is checked by the test the table names (which must exist). Every bullet
of the page that states an exit status names its cases (``<!-- case NAME -->``) and states their statuses.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from flows.cli import main
from specdraft.toy.build import PREBUILT_DIR

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guarantees.md"
ROW = re.compile(r"^\| `([a-z0-9-]+)` \| (.+?) \| (\d+) \| `([^`]+)` \|$")


def table() -> dict[str, tuple[int, str]]:
    """case -> (exit status, the test that checks it), from the page's table."""
    rows = {}
    for line in PAGE.read_text().split("## Exit codes", 1)[1].splitlines():
        match = ROW.match(line)
        if match:
            case, _, code, test = match.groups()
            assert case not in rows, f"case {case} listed twice"
            rows[case] = (int(code), test)
    assert rows, f"no rows in the Exit codes table of {PAGE}"
    return rows


def bullets() -> list[str]:
    """The page's bullets (continuation lines joined), before the table."""
    out: list[str] = []
    for line in PAGE.read_text().split("## Exit codes", 1)[0].splitlines():
        if line.startswith("* "):
            out.append(line)
        elif line.startswith("  ") and out:
            out[-1] += " " + line.strip()
    return out


def test_every_stated_exit_status_is_a_case_of_the_table():
    rows = table()
    named = set()
    for bullet in bullets():
        codes = {int(c) for c in re.findall(r"\bexits? (\d+)", bullet)}
        cases = re.findall(r"<!-- case ([a-z0-9-]+) -->", bullet)
        named.update(cases)
        assert all(case in rows for case in cases), (cases, bullet)
        assert codes == {rows[case][0] for case in cases}, (codes, cases, bullet[:300])
    assert named == set(rows), f"cases of the table no bullet names: {set(rows) - named}"


@pytest.mark.parametrize("case", sorted(table()))
def test_the_named_test_exists(case):
    path, name = table()[case][1].split("::")
    assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), (case, path, name)


# --------------------------------------------------------------------------- the cases run here


def out_not_empty(tmp: Path) -> list[str]:
    (tmp / "data").mkdir()
    (tmp / "data" / "results.csv").write_text("mine\n")
    return ["toy-data", "--out", str(tmp / "data")]


def out_is_an_input(tmp: Path) -> list[str]:
    (tmp / "store").mkdir()
    return ["train", "--store", str(tmp / "store"), "--target", str(PREBUILT_DIR), "--out", str(tmp / "store"),
            "--overwrite"]


def out_locked(tmp: Path) -> list[str]:
    (tmp / "data").mkdir()  # held by a live process of this host: this test's own
    (tmp / "data" / ".specdraft-lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                               "command": "toy-data"}))
    return ["toy-data", "--out", str(tmp / "data")]


def config_error(tmp: Path) -> list[str]:
    (tmp / "store").mkdir()
    return ["train", "--store", str(tmp / "store"), "--target", str(PREBUILT_DIR), "--out", str(tmp / "run"),
            "--recipe", "hass", "epochs=[4,1]"]


def unloadable_target(tmp: Path) -> list[str]:
    (tmp / "target").mkdir()
    (tmp / "prompts.jsonl").write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    return ["dump", "--target", str(tmp / "target"), "--prompts", str(tmp / "prompts.jsonl"), "--out", str(tmp / "out")]


def tracking_unreachable(tmp: Path) -> list[str]:
    sock = socket.socket()  # accepts connections, never answers
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    LISTENERS.append(sock)
    return ["export", "--model-uri", "models:/specdraft@champion", "--tracking-uri",
            f"http://127.0.0.1:{sock.getsockname()[1]}", "--out", str(tmp / "exp")]


def handoff_not_ours(tmp: Path) -> list[str]:
    for name in ("current", "previous"):  # a user's directory, not a hand-off's
        (tmp / "served" / name).mkdir(parents=True)
    return ["rollback", "--exports", str(tmp / "served")]


def model_uri_without_registry(tmp: Path) -> list[str]:
    return ["export", "--model-uri", "models:/specdraft@champion", "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}",
            "--out", str(tmp / "exp")]


def zero_size(tmp: Path) -> list[str]:
    (tmp / "prompts.jsonl").write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    return ["dump", "--target", str(PREBUILT_DIR), "--prompts", str(tmp / "prompts.jsonl"), "--out", str(tmp / "out"),
            "samples_per_shard=0"]


LISTENERS: list[socket.socket] = []
RUN: dict[str, Callable[[Path], list[str]]] = {
    "out-not-empty": out_not_empty, "out-is-an-input": out_is_an_input, "out-locked": out_locked,
    "config-error": config_error, "unloadable-target": unloadable_target,
    "zero-size": zero_size,
    "tracking-unreachable": tracking_unreachable, "model-uri-without-registry": model_uri_without_registry,
    "handoff-not-ours": handoff_not_ours,
}
BY_ITS_TEST = {"wrong-target", "corrupt-chunk", "ctrl-c", "ray-worker-failure", "head-lost",  # a training run or Ray
               "tracking-silent",  # seconds of waiting on a silent server: its own test waits them once
               "config-disagrees-with-weights", "corrupt-parquet", "pickle-target", "empty-input",
               "questions-in-no-format"}  # a model or draft built first


@pytest.mark.parametrize("case", sorted(table()))
def test_each_case_exits_as_the_page_says(case, tmp_path, capsys):
    code, _ = table()[case]
    if case in BY_ITS_TEST:
        pytest.skip(f"{case}: needs a model or Ray run, checked by the test the page names")
    assert case in RUN, f"case {case}: add how to run it here, or to BY_ITS_TEST"
    argv = RUN[case](tmp_path)
    try:
        got = main(argv)
    finally:
        while LISTENERS:
            LISTENERS.pop().close()
    err = capsys.readouterr().err
    assert got == code, (case, got, err[-2000:])
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err[-2000:]
