"""Issue 31 item 8: a tracking server that does not answer is one line naming its URI (exit 2) before any work,
not minutes of MLflow's retries and a message about something else; a failed ``--model-uri`` lookup creates no
``mlflow.db`` (``pipelines/tracking.py``: ``check_tracking``).

The unanswering server is a real socket that accepts connections and never replies (a hung or firewalled
server looks so); the CLI runs in this process (``flows.cli.main``).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from flows.cli import main
from specdraft.toy.build import PREBUILT_DIR


@pytest.fixture()
def silent_server():
    """``http://127.0.0.1:PORT`` of a server that takes connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def refused(capsys, uri: str, started: float) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"tracking.uri={uri}" in lines[0], err[-3000:]
    assert time.monotonic() - started < 60, "the check must take seconds, not MLflow's minutes of retries"
    return lines[0]


def test_train_with_an_unanswering_tracking_server_exits_2_naming_it_before_any_work(silent_server, tmp_path, capsys):
    (tmp_path / "store").mkdir()
    out = tmp_path / "run"
    capsys.readouterr()
    started = time.monotonic()
    code = main(["train", "--store", str(tmp_path / "store"), "--target", str(PREBUILT_DIR), "--out", str(out),
                 "--mlflow", silent_server])
    line = refused(capsys, silent_server, started)
    assert code == 2, line
    assert "does not answer" in line
    assert not out.exists()  # before any work: no --out


def test_export_of_a_model_uri_from_an_unanswering_server_exits_2_naming_it(silent_server, tmp_path, capsys):
    capsys.readouterr()
    started = time.monotonic()
    code = main(["export", "--model-uri", "models:/specdraft@champion", "--tracking-uri", silent_server,
                 "--out", str(tmp_path / "exp")])
    line = refused(capsys, silent_server, started)
    assert code == 2, line  # today: about 4.5 minutes, then "no such registered model version" (exit 1)


def test_a_model_uri_lookup_without_a_registry_leaves_no_mlflow_db(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    started = time.monotonic()
    code = main(["export", "--model-uri", "models:/specdraft@champion", "--out", str(tmp_path / "exp")])
    uri = f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    line = refused(capsys, uri, started)
    assert code == 2, line
    assert "no tracking store" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # today: an empty mlflow.db here
