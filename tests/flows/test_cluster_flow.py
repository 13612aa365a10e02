"""The nightly deployment on a Ray cluster of three nodes on this machine (issue 43 item 1): a head without CPUs and
two worker nodes of 2 CPUs, each in its own working directory (``tests/ray_nodes.py``); MLflow as an HTTP server on
127.0.0.1 whose artifacts go to the S3 server (moto) on 127.0.0.1; a Prefect server and a process worker on
127.0.0.1 (``benchmarks.processes.prefect_deployment``: the repository's ``prefect.yaml`` deployed as
docs/operations.md does it). ``prefect deployment run regenerate-and-train/nightly`` with parameters pointing at the
cluster (``ray.address``) runs the flow in the worker's flow-run process, a driver of its own on the cluster, with
the feature stores in a bucket of the S3 server (``store_root``: each store valid there, only its ``DONE`` record in
the workdir); it regenerates and dumps with two replicas, trains with two DDP workers (gloo; 2 CPUs each: one per node) and
evaluates with two replicas. The flow run must complete; each stage's actors are found in Ray's actor table with
their node (``placement``), and every stage ran on both worker nodes. Each stage's own output says which node ran
which part (``recorded_placement``: the ``nodes`` of its ``DONE`` record, ``pipelines.nodes``): worker nodes only,
the parts adding up to the stage's counts, one training rank per node — and the run summary in the flow run's
logs prints it. The MLflow parent run is tagged with the flow run; the champion is registered, its exports logged
beside it, on S3. ``specdraft run`` runs the same flow in-process (``tests/flows/test_flow.py``): the cluster's one
run is the deployment's, so one run checks both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from benchmarks.processes import flow_run_end, flow_run_summary, free_port, prefect, prefect_deployment
from specdraft.store import validate
from tests.conftest import connect_local_ray, s3_variables, worker_pythonpath
from tests.flows.test_flow import overrides, run_files  # noqa: F401 (a fixture)
from tests.ray_nodes import ray_nodes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # 5-10 min; at load 40, 10 min were not enough
ROOT = Path(__file__).resolve().parents[2]  # the checkout the deployment runs its flows in (prefect.yaml)

# Ray's actor class name of each stage's actors -> the stage (Ray Data pools name their workers after the callable)
STAGES = {"HFReplica": "regenerate", "PrefillActor": "dump", "RayTrainWorker": "train", "EvalReplica": "eval"}


@pytest.fixture(scope="module")
def mlflow_server(s3_server, tmp_path_factory):
    """``mlflow server`` on 127.0.0.1, its runs in SQLite, its artifacts in a bucket of the S3 server."""
    import fsspec

    env = {**os.environ, **s3_variables(s3_server), "MLFLOW_S3_ENDPOINT_URL": s3_server,
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner and its seven consumers
    os.environ.update(s3_variables(s3_server))
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("mlflow-cluster")
    root, port = tmp_path_factory.mktemp("mlflow"), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                             "--artifacts-destination", "s3://mlflow-cluster/artifacts"],
                            env=env, stdout=open(root / "server.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # its uvicorn and job runners: one process group, ended whole
    uri = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(uri + "/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        yield uri
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGKILL)  # the job runners that outlived the server
        except ProcessLookupError:
            pass


def placement() -> dict[str, set[str]]:
    """Stage -> the nodes its actors ran on (Ray's actor table: the GCS, no dashboard needed)."""
    import ray

    found: dict[str, set[str]] = defaultdict(set)
    for actor in ray._private.state.actors().values():
        for name, stage in STAGES.items():
            if name in actor["ActorClassName"]:
                found[stage].add(actor["Address"]["NodeID"])
    return dict(found)


def recorded_placement(workdir: Path) -> dict[str, dict[str, dict]]:
    """Stage -> node id -> its parts, as the stages' ``DONE`` records say (regenerate and features: their
    summaries' ``nodes``; train and eval: the record's), with the record's counts under ``"record"``."""
    found: dict[str, dict[str, dict]] = {}
    for stage in ("regenerate", "features", "train", "eval"):
        for done in sorted((workdir / stage).glob("*/DONE")):
            record = json.loads(done.read_text())
            nodes = record["summary"]["nodes"] if "summary" in record else record["nodes"]
            found[stage] = {n["node"]: n for n in nodes} | {"record": record}
    return found


def test_the_nightly_deployment_spreads_every_stage_over_both_worker_nodes(
        tiny_toy_target, run_files, mlflow_server, s3_server, tmp_path_factory, monkeypatch, request):
    import fsspec
    import ray
    from mlflow.tracking import MlflowClient

    root, prompts, questions = run_files
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    # what every node's environment holds (the raylets' workers inherit it): the object store's endpoint and
    # credentials (the mlflow_server fixture set them), this tree first on the path, DDP over the loopback
    monkeypatch.setenv("PYTHONPATH", worker_pythonpath())
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("stores-cluster")
    started = time.monotonic()
    try:
        # this test's driver only reads Ray's actor table; the flow run's process is the run's driver
        with ray_nodes(tmp_path_factory.mktemp("nodes"), workers=2, cpus=2, head_cpus=0) as up, \
                prefect_deployment(tmp_path_factory.mktemp("prefect"), dict(os.environ), ROOT, worker_poll_s=2
                                   ) as (api, env):
            # a list of paths quoted (["/a"]): `prefect deployment run` prints the parameters as rich markup, where
            # "[/a]" is a closing tag — Prefect 3.7.7's CLI then fails after creating the run (docs/cluster.md)
            args = [a.replace("=[/", '=["/').replace(".jsonl]", '.jsonl"]') for a in overrides(
                root, tiny_toy_target, prompts, questions) if not a.startswith(("tracking.uri", "ray.num_cpus"))]
            assert sum('=["/' in a for a in args) == 2, args  # data.prompts, eval.questions
            params = {"config": str(ROOT / "configs" / "toy.yaml"), "overrides": [
                *args, f"ray.address={up['address']}", f"tracking.uri={mlflow_server}",
                "tracking.experiment=cluster-test", "regenerate.concurrency=2", "features.num_actors=2",
                "train.scaling.num_workers=2", "train.scaling.cpus_per_worker=2", "eval.use_ray=true",
                "eval.replicas=2", "store_root=s3://stores-cluster/runs"]}  # the feature stores on S3
            out = prefect(["deployment", "run", "regenerate-and-train/nightly", "--params", json.dumps(params)],
                          env, ROOT)
            flow_run = next(line.split()[-1] for line in out.splitlines() if "UUID" in line)
            state = flow_run_end(api, flow_run, timeout=3600)
            worker_log = Path(env["PREFECT_HOME"]) / "worker.log"
            assert state["type"] == "COMPLETED", (state["name"], worker_log.read_text()[-6000:])
            summary = flow_run_summary(api, flow_run)
            assert_placement(up, root / "work")
            for done in (root / "work" / "features").glob("*/DONE"):  # each store on S3, its record in the workdir
                url = json.loads(done.read_text())["store"]
                assert url == f"s3://stores-cluster/runs/{done.parent.name}" and validate(url).ok, url
                assert [p.name for p in done.parent.iterdir()] == ["DONE"]
            assert "placement (the Ray node that ran each part" in summary, summary[-3000:]
    finally:
        if was_up:
            connect_local_ray(request)
    print(f"cluster run through the deployment: {time.monotonic() - started:.0f} s")
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("cluster-test").experiment_id
    parents = client.search_runs([experiment], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run}'")
    assert len(parents) == 1, [r.info.run_id for r in parents]  # the flow run's MLflow run, on the server
    version = client.get_model_version_by_alias("flow-test-draft", "champion")
    assert version.source
    run_artifacts = [a.path for a in client.list_artifacts(version.run_id)]
    assert run_artifacts
    stored = fsspec.filesystem("s3", skip_instance_cache=True).find("mlflow-cluster/artifacts")
    assert any("model.safetensors" in p for p in stored), stored[:20]


def assert_placement(up: dict, workdir: Path) -> None:
    """Every stage's actors on both worker nodes (Ray's actor table); each stage's recorded parts on worker nodes
    only (never the head), at their addresses as Ray lists them, adding up to the stage's counts."""
    import ray

    where = placement()
    workers = set(up["nodes"])
    print(json.dumps({stage: sorted(n[:12] for n in nodes) for stage, nodes in where.items()}))
    for stage in STAGES.values():
        assert where.get(stage) == workers, (stage, where)
    recorded = recorded_placement(workdir)
    print(json.dumps({s: {n[:12]: p for n, p in by.items() if n != "record"} for s, by in recorded.items()}))
    ips = {n: v["NodeManagerAddress"] for n, v in ((n["NodeID"], n) for n in ray.nodes())}
    assert set(recorded) == {"regenerate", "features", "train", "eval"}, sorted(recorded)
    for stage, by in recorded.items():
        record = by.pop("record")
        assert by and set(by) <= workers, (stage, by)  # worker nodes only, never the head
        assert all(part["ip"] == ips[node] for node, part in by.items()), (stage, by)
        parts = {unit: sorted(x for p in by.values() for x in (p[unit] if isinstance(p[unit], list) else [p[unit]]))
                 for unit in {u for p in by.values() for u in p} - {"node", "ip"}}
        if stage == "regenerate":
            assert sum(parts["conversations"]) == record["summary"]["rows_in"] > 0, parts  # each once
        elif stage == "features":
            assert parts["shards"] == list(range(record["summary"]["shards_written"])), parts
        elif stage == "train":  # one rank per node, both nodes
            assert set(by) == workers and parts["ranks"] == [0, 1], by
        else:
            assert sum(parts["questions"]) == 3, parts  # every question once
