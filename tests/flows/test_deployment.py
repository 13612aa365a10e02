"""The README's deployment path, for real: a Prefect server and a process worker on 127.0.0.1,
``prefect deploy`` of ``prefect.yaml``, ``prefect deployment run regenerate-and-train/nightly``,
then wait for COMPLETED and check MLflow for the parent/child runs and the registered model, and the
flow-run log and the worker's output for the run summary.

Server and worker run in their own process groups and are killed (SIGTERM, then SIGKILL)
at the end: a worker whose server has gone may ignore SIGTERM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from specdraft.toy.conversations import generate_prompts
from tests.flows.processes import free_port, start, stop, wait_http

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]


def run(cmd: list[str], env: dict, timeout: int = 180) -> str:
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.timeout(1200)  # the flow run gets 900 s (--watch-timeout): on a loaded machine more than the default 600
def test_nightly_deployment_runs_to_completion(tiny_toy_target, tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PWD": str(ROOT),
           "MLFLOW_TRACKING_URI": mlflow_uri, "PYTHONUNBUFFERED": "1"}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"d{i}", "messages": c}) + "\n"
                               for i, c in enumerate(generate_prompts(32, seed=31))))
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(
        json.dumps({"question_id": i, "category": "toy", "turns": [m["content"] for m in c if m["role"] == "user"]})
        + "\n" for i, c in enumerate(generate_prompts(2, seed=32))))
    # lists as a,b: Prefect's CLI prints parameters through rich, which reads "[/path]" as markup
    overrides = [
        f"workdir={tmp_path / 'work'}", f"target.path={tiny_toy_target}", f"data.prompts={prompts}",
        "regenerate.max_new_tokens=16", "train.reader.max_tokens=1024",
        # the cheapest training (one epoch of plain EAGLE, in the flow's process): the Ray Train workers
        # and the Beagle recipe are the flow test's and the train tests' job, this one is the deployment's
        "train.recipe=eagle", "train.epochs=1", "train.scaling.num_workers=0",
        "features.aux_layers=null",  # plain EAGLE reads no EAGLE-3 features (the 2-layer target has no eagle3 triple)
        f"eval.questions={questions}", "eval.settings.decode.max_new_tokens=12", "eval.settings.decode.depth=3",
        "eval.settings.decode.topk=3", "eval.settings.decode.total_tokens=6", "tracking.experiment=deploy-test",
        "register.model_name=deploy-test-draft", "ray.num_cpus=2",
    ]
    # as the README starts it: streaming flow-run logs out, so that --watch shows them
    server = start(PREFECT + ["server", "start", "--host", "127.0.0.1", "--port", str(port)],
                   {**env, "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
                    "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true"}, tmp_path / "server.log", ROOT)
    worker = None
    try:
        wait_http(f"{api}/health", server, tmp_path / "server.log")
        run(PREFECT + ["work-pool", "create", "specdraft-process", "--type", "process"], env)
        run(PREFECT + ["--no-prompt", "deploy", "--all"], env)
        worker = start(PREFECT + ["worker", "start", "--pool", "specdraft-process"], env, tmp_path / "worker.log", ROOT)
        # as the README runs it: --watch streams the flow run's logs and waits for its end (wide columns: rich
        # would fold the summary's long lines)
        watch = subprocess.run(PREFECT + ["deployment", "run", "regenerate-and-train/nightly", "--params",
                                          json.dumps({"overrides": overrides}), "--watch", "--watch-timeout", "900"],
                               cwd=ROOT, env={**env, "COLUMNS": "400"}, capture_output=True, text=True, timeout=960)
        worker_log = (tmp_path / "worker.log").read_text().replace("\r", "")
        assert watch.returncode == 0, f"{watch.stdout[-3000:]}\n{watch.stderr[-2000:]}\nworker:\n{worker_log[-6000:]}"
        flow_run_id = next(line.split()[-1] for line in watch.stdout.splitlines() if "UUID" in line)
        state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["type"]
        assert state == "COMPLETED", worker_log[-6000:]

        client = MlflowClient(mlflow_uri)
        exp = client.get_experiment_by_name("deploy-test")
        runs = client.search_runs([exp.experiment_id])
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        assert len(parents) == 1 and parents[0].data.tags["prefect.flow_run_id"] == flow_run_id
        children = {r.data.tags["specdraft.stage"] for r in runs if "mlflow.parentRunId" in r.data.tags}
        assert {"prepare", "regenerate", "features", "train", "eval", "register"} <= children
        assert str(client.get_model_version_by_alias("deploy-test-draft", "champion").version) == "1"

        # the run summary is in the flow-run log, in the worker's output and in what --watch printed: tau beside
        # the floor, the decision, the MLflow run and how to browse it
        logs = httpx.post(f"{api}/logs/filter", timeout=10, json={
            "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_DESC", "limit": 20}).json()
        summary = next(log["message"] for log in logs if log["message"].startswith("run summary"))
        for needle in ("promoted to champion", f"run {parents[0].info.run_id}",
                       f"mlflow ui --backend-store-uri {mlflow_uri}", "tau/floor"):
            assert needle in summary, (needle, summary)
        assert summary in worker_log
        assert " ".join(summary.split()) in " ".join(watch.stdout.split()), watch.stdout[-4000:]
    finally:
        if worker is not None:
            stop(worker)
        stop(server)
