"""Issue 31 item 8 and issue 44 item 7: a tracking server that does not answer is one line naming its URI (exit 2) before any work,
not minutes of MLflow's retries and a message about something else; a failed ``--model-uri`` lookup creates no
``mlflow.db`` (``pipelines/tracking.py``: ``check_tracking``).

The unanswering server is a real socket that accepts connections and never replies (a hung or firewalled
server looks so); the CLI runs in this process (``flows.cli.main``).
"""

from __future__ import annotations

import os
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


class HalfSilentServer:
    """An HTTP server on 127.0.0.1 that answers ``/health`` (so the pre-flight check passes) and leaves every other
    request unanswered for ``hold_s`` seconds (a server gone silent mid-run); ``close()`` stops it."""

    def __init__(self, hold_s: float = 10.0):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the handler's name
                if self.path.startswith("/health"):
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b"OK")
                else:
                    time.sleep(hold_s)  # bounded: the server stops itself answering nothing

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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


def test_run_with_an_unanswering_tracking_server_exits_2_naming_it_before_any_work(silent_server, tmp_path, capsys):
    """`specdraft run` checks its tracking server in its pre-flight (issue 44 item 7): it waited over 10 minutes."""
    from tests.faults.test_outputs import run_argv

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    argv = run_argv(tmp_path / "runs", {"convs": prompts, "questions": prompts}, "tracking.enabled=true",
                    f"tracking.uri={silent_server}")
    capsys.readouterr()
    started = time.monotonic()
    code = main([*argv, "tracking.timeout_s=2"])  # the check waits 5 s, or tracking.timeout_s when less
    line = refused(capsys, silent_server, started)
    assert code == 2 and "does not answer within 2 s" in line, line
    assert not (tmp_path / "runs").exists()
    assert main([*argv, "tracking.timeout_s=1"]) == 2  # neighbours: the setting's own bad values, named
    assert "tracking.timeout_s=1: whole seconds, at least 2" in capsys.readouterr().err


def test_every_request_to_a_silent_server_is_bounded_and_names_it(silent_server, monkeypatch, tmp_path):
    """Past the pre-flight (a server that goes silent mid-run): every MLflow request of the process waits at most
    ``tracking.timeout_s`` in all, and the failure is one line naming the server and the setting. Neighbours: the
    default bound is <= 60 s in all; a server that answers passes the check; another error is not called a silent
    server; bad values of the setting are refused naming it."""
    from pipelines.configs import TrackingConfig
    from pipelines.tracking import REQUEST_ENV, bound_requests, open_run, tracking_failure
    from specdraft.config import ConfigError

    for name in REQUEST_ENV:  # restored after the test: the bound is process-wide
        monkeypatch.delenv(name, raising=False)
    bound_requests(TrackingConfig().timeout_s)
    per_try, retries = int(os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]), int(os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"])
    assert per_try * (retries + 1) <= TrackingConfig().timeout_s <= 60 and os.environ[REQUEST_ENV[2]] == "0"
    started = time.monotonic()
    with pytest.raises(Exception) as caught:  # MLflow's own default: 120 s a try, 8 tries with backoff
        open_run(TrackingConfig(uri=silent_server, timeout_s=2))
    took = time.monotonic() - started
    assert 1.5 < took < 10, took
    line = tracking_failure(caught.value)
    assert line is not None and line.startswith(f"the tracking server {silent_server} did not answer within "
                                                "tracking.timeout_s=2 s"), line
    assert tracking_failure(ValueError("API request to http://x/ failed")) is None
    from pipelines.tracking import MlflowLogger

    run = open_run(TrackingConfig(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", timeout_s=8))  # a worker's client too:
    os.environ[REQUEST_ENV[0]] = "120"
    attached = MlflowLogger(**run.ref())  # the training worker attaches from the ref, bounded the same way
    assert attached.run_id == run.run_id and os.environ[REQUEST_ENV[0]] == "4"
    for bad in (0, 1, 2.5, True, "30"):
        with pytest.raises(ConfigError, match="tracking.timeout_s="):
            TrackingConfig(timeout_s=bad)


def test_a_server_that_answers_passes_the_check():
    import http.server
    import threading

    from pipelines.configs import TrackingConfig
    from pipelines.tracking import check_tracking

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's name
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        check_tracking(TrackingConfig(uri=f"http://127.0.0.1:{server.server_address[1]}"))  # any HTTP status: it answered
    finally:
        server.shutdown()
        server.server_close()


def test_train_with_a_tracking_server_silent_after_the_check_exits_1_naming_it(tmp_path, capsys):
    """A server that passes the check and then never answers: `train` stops after ``tracking.timeout_s`` with one
    line naming the server and the setting (exit 1), not after MLflow's 120 s a try, retried."""
    conversations = tmp_path / "c.jsonl"
    conversations.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}, '
                             '{"role": "assistant", "content": "hello"}]}\n')
    server = HalfSilentServer()
    capsys.readouterr()
    started = time.monotonic()
    try:
        code = main(["train", "--conversations", str(conversations), "--target", str(PREBUILT_DIR),
                     "--out", str(tmp_path / "run"), "--mlflow", server.url, "tracking.timeout_s=2"])
    finally:
        server.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"specdraft train: the tracking server {server.url} did not answer within "
                               "tracking.timeout_s=2 s"), lines
    assert time.monotonic() - started < 30
