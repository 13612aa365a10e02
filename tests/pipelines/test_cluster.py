"""connect_ray: the known-harmless Ray lines are dropped at their loggers, in the driver and in the
workers (through the cluster's worker_process_setup_hook); everything else those loggers say stays."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from pipelines.cluster import KNOWN_HARMLESS, KNOWN_HARMLESS_LOCAL, TRAIN_ENV, _logger_name, quiet_known_warnings

CLEANER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
AUTOSCALING = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"


def session_logs(ray) -> Path:
    return Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"


def test_known_harmless_records_are_dropped_and_the_rest_kept(caplog):
    quiet_known_warnings(local=True)
    quiet_known_warnings(local=True)  # idempotent: one filter per logger
    assert all(len(logging.getLogger(_logger_name(n)).filters) == 1 for n in {**KNOWN_HARMLESS, **KNOWN_HARMLESS_LOCAL})
    import ray.train.v2._internal.execution.context as train_context  # its logger is getLogger(__file__)

    assert train_context.logger.filters and not train_context.logger.filter(logging.LogRecord(
        train_context.logger.name, logging.INFO, "", 0, "Reporting training result 3: TrainingReport(...)", None, None))
    for name in (CLEANER, AUTOSCALING):  # Ray's loggers may not propagate to the root (after ray.init)
        logging.getLogger(name).addHandler(caplog.handler)
    with caplog.at_level(logging.WARNING):
        logging.getLogger(CLEANER).warning("Failed to query Ray Train Controller actor state. State API may be "
                                           "temporarily unavailable. Continuing to monitor.")
        logging.getLogger(AUTOSCALING).warning("Failed to send resource request for train-1. If this only happens "
                                               "transiently ... it's safe to ignore this error.", exc_info=True)
        logging.getLogger(CLEANER).warning("Detected that the Ray Train controller actor (x) is dead.")
    for name in (CLEANER, AUTOSCALING):
        logging.getLogger(name).removeHandler(caplog.handler)
    assert {r.getMessage() for r in caplog.records} == {"Detected that the Ray Train controller actor (x) is dead."}


def test_ray_workers_drop_them_too_and_query_their_own_cluster(local_ray):
    ray = local_ray
    marker = uuid.uuid4().hex

    @ray.remote(num_cpus=0)
    def log_both() -> str | None:
        import os

        logger = logging.getLogger(CLEANER)
        logger.warning(f"Failed to query Ray Train Controller actor state. {marker}")
        logger.warning(f"kept {marker}")
        return os.environ.get("RAY_ADDRESS")

    address = ray.get(log_both.remote())
    assert address == ray.get_runtime_context().gcs_address  # the state API client's cluster, not "auto"
    texts = {}
    for _ in range(150):  # worker output reaches its log file asynchronously (up to 30 s on a loaded machine)
        texts = {p: p.read_text(errors="ignore") for p in session_logs(ray).glob("worker-*") if p.is_file()}
        if any(f"kept {marker}" in t for t in texts.values()):
            break
        time.sleep(0.2)
    assert any(f"kept {marker}" in t for t in texts.values())
    assert not any(f"actor state. {marker}" in t for t in texts.values())


def test_the_cleaner_takes_a_state_answer_without_result_as_the_state_api_being_unavailable(monkeypatch):
    """Ray's own client, asked by the cleaner's query, meets an HTTP server that answers JSON without
    ``result`` (as another server on the dashboard's port does): Ray raises KeyError, which kills the cleaner's
    monitor thread; guarded, it is the RayStateApiException the thread handles."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import pytest
    from ray.train.v2._internal.execution.controller import placement_group_cleaner as cleaner
    from ray.util.state.exception import RayStateApiException

    from pipelines.cluster import guard_cleaner_queries

    class NotRay(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"detail": "Not Found"}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotRay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(cleaner, "is_actor_alive", cleaner.is_actor_alive)  # restored after the test
    try:
        with pytest.raises(KeyError):  # Ray's bug, as it is
            cleaner.is_actor_alive("ab" * 14, timeout=5)
        guard_cleaner_queries()
        guard_cleaner_queries()  # idempotent: wrapped once
        with pytest.raises(RayStateApiException, match="malformed state API answer"):
            cleaner.is_actor_alive("ab" * 14, timeout=5)
    finally:
        server.shutdown()


def test_a_worker_guards_the_cleaner_when_it_imports_it_and_imports_nothing_of_ray_train_before():
    """The setup hook's guard costs a worker nothing until it loads Ray Train's cleaner (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys; from pipelines.cluster import guard_cleaner_queries, CLEANER_MODULE; guard_cleaner_queries(); "
            "guard_cleaner_queries(); assert 'ray.train' not in sys.modules, 'imported Ray Train'; "
            "import importlib; m = importlib.import_module(CLEANER_MODULE); "
            "print(getattr(m.is_actor_alive, 'guarded', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_an_actor_with_its_own_environment_gets_the_train_settings(local_ray):
    # Ray Train starts its controller with runtime_env={"env_vars": <the driver's RAY_TRAIN_* variables>}: the job's
    # TRAIN_ENV (the controller's poll interval: each checkpoint report waits for its poll) reaches it all the same
    @local_ray.remote(num_cpus=0, runtime_env={"env_vars": {"SPECDRAFT_TEST_OWN": "1"}})
    class Controller:
        def env(self, names: list[str]) -> dict[str, str | None]:
            import os

            return {name: os.environ.get(name) for name in names}

    names = [name for name in TRAIN_ENV if name not in os.environ]
    seen = local_ray.get(Controller.remote().env.remote([*names, "SPECDRAFT_TEST_OWN"]))
    assert seen == {**{name: TRAIN_ENV[name] for name in names}, "SPECDRAFT_TEST_OWN": "1"}


def test_output_to_file_takes_python_c_and_child_output_off_the_console(tmp_path):
    """A vllm replica's third-party output (``output_to_file``): Python's writes, a C library's writes to the file
    descriptors (tcmalloc) and a child started afterwards (vLLM's engine core, the resource tracker) all land in
    the log; what the process printed before stays where it was."""
    import subprocess
    import sys

    log = tmp_path / "regen" / "vllm.log"
    script = (f"import os, subprocess, sys, warnings\nfrom pipelines.cluster import output_to_file\n"
              f"print('before', flush=True)\noutput_to_file({str(log)!r})\nprint('INFO vllm: started')\n"
              "warnings.warn('reduce_op is deprecated', FutureWarning)\n"
              "os.write(2, b'tcmalloc: large alloc\\n')\n"
              "subprocess.run([sys.executable, '-c', \"raise KeyError('/psm_1')\"])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.stdout == "before\n" and out.stderr == ""
    kept = log.read_text()
    for line in ("INFO vllm: started", "reduce_op is deprecated", "tcmalloc: large alloc", "KeyError: '/psm_1'"):
        assert line in kept, line
    assert "before" not in kept


def test_a_local_run_starts_its_own_cluster_beside_a_ray_start_cluster_on_the_host():
    """With no address, ``connect_ray`` starts a cluster of its own: ``ray.init(address=None)`` would join the
    last cluster ``ray start`` left on the host (``/tmp/ray/ray_current_cluster``), someone else's."""
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from ray._private.services import get_node_ip_address

    ip = get_node_ip_address()  # where `ray start` listens: the host's routable address (a cluster's node)
    head = f"{ip}:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    started = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                                "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={temp}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        code = ("import ray; from pipelines.cluster import connect_ray; connect_ray(num_cpus=1); "
                "print(ray.get_runtime_context().gcs_address)")
        deadline = time.time() + 120
        while time.time() < deadline:  # the head is up once its GCS port answers
            with socket.socket() as s:
                if s.connect_ex((ip, port)) == 0:
                    break
            time.sleep(0.5)
        else:
            raise AssertionError(f"ray start --head did not listen on {head} in 120 s")
        time.sleep(2)  # ... and has written the host's ray_current_cluster
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180,
                             cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] != head
    finally:
        started.terminate()
        started.wait(timeout=90)
        shutil.rmtree(temp, ignore_errors=True)
