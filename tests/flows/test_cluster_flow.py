"""``specdraft run`` on a Ray cluster of three nodes on this machine (issue 43 item 1): a head without CPUs (the
driver's node) and two worker nodes of 2 CPUs, each in its own working directory (``tests/ray_nodes.py``); MLflow
as an HTTP server on 127.0.0.1 whose artifacts go to the S3 server (moto) on 127.0.0.1. The run regenerates and
dumps with two replicas, trains with two DDP workers (gloo; 2 CPUs each: one per node) and evaluates with two
replicas; each stage's actors are found in Ray's actor table with their node (``placement``), and every stage
ran on both worker nodes. Each stage's own output says which node ran which part (``recorded_placement``: the
``nodes`` of its ``DONE`` record, ``pipelines.nodes``): worker nodes only, the parts adding up to the stage's
counts, one training rank per node — and the run's summary prints it. The champion is registered, its exports
logged beside it, on S3.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from flows.cli import main
from tests.conftest import connect_local_ray, s3_variables, worker_pythonpath
from tests.flows.test_flow import overrides, run_files  # noqa: F401 (a fixture)
from tests.ray_nodes import ray_nodes

pytestmark = pytest.mark.slow

# Ray's actor class name of each stage's actors -> the stage (Ray Data pools name their workers after the callable)
STAGES = {"HFReplica": "regenerate", "PrefillActor": "dump", "RayTrainWorker": "train", "EvalReplica": "eval"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_specdraft_run_spreads_every_stage_over_both_worker_nodes(tiny_toy_target, run_files, mlflow_server,
                                                                   s3_server, tmp_path_factory, capsys, request):
    import ray
    from mlflow.tracking import MlflowClient

    root, prompts, questions = run_files
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    env = {"PYTHONPATH": worker_pythonpath(), **s3_variables(s3_server), "MLFLOW_S3_ENDPOINT_URL": s3_server,
           "GLOO_SOCKET_IFNAME": "lo"}  # DDP between the nodes: on one machine, the loopback
    started = time.monotonic()
    try:
        with ray_nodes(tmp_path_factory.mktemp("nodes"), workers=2, cpus=2, head_cpus=0, env_vars=env) as up:
            config = str(Path(__file__).resolve().parents[2] / "configs" / "toy.yaml")
            args = [a for a in overrides(root, tiny_toy_target, prompts, questions) if not a.startswith(
                ("tracking.uri", "ray.num_cpus"))]
            status = main(["run", "--config", config, *args, f"ray.address={up['address']}",
                           f"tracking.uri={mlflow_server}", "tracking.experiment=cluster-test",
                           "regenerate.concurrency=2", "features.num_actors=2", "train.scaling.num_workers=2",
                           "train.scaling.cpus_per_worker=2", "eval.use_ray=true", "eval.replicas=2"])
            out = capsys.readouterr()
            assert status == 0, out.err[-3000:]
            where = placement()
            workers = set(up["nodes"])
            print(json.dumps({stage: sorted(n[:12] for n in nodes) for stage, nodes in where.items()}))
            for stage in STAGES.values():
                assert where.get(stage) == workers, (stage, where)
            recorded = recorded_placement(root / "work")
            print(json.dumps({s: {n[:12]: p for n, p in by.items() if n != "record"} for s, by in recorded.items()}))
            ips = {n: v["NodeManagerAddress"] for n, v in ((n["NodeID"], n) for n in ray.nodes())}
            for stage, by in recorded.items():
                record = by.pop("record")
                assert by and set(by) <= workers, (stage, by)  # worker nodes only, never the head
                assert all(part["ip"] == ips[node] for node, part in by.items()), (stage, by)
                parts = {unit: sorted(x for p in by.values() for x in (p[unit] if isinstance(p[unit], list)
                                                                       else [p[unit]]))
                         for unit in {u for p in by.values() for u in p} - {"node", "ip"}}
                if stage == "regenerate":
                    assert sum(parts["conversations"]) == record["summary"]["rows_in"] > 0, parts  # each once
                elif stage == "features":
                    assert parts["shards"] == list(range(record["summary"]["shards_written"])), parts
                elif stage == "train":  # one rank per node, both nodes
                    assert set(by) == workers and parts["ranks"] == [0, 1], by
                else:
                    assert sum(parts["questions"]) == 3, parts  # every question once
            assert "placement (the Ray node that ran each part" in out.out, out.out[-3000:]
    finally:
        if was_up:
            connect_local_ray(request)
    print(f"cluster run: {time.monotonic() - started:.0f} s")
    client = MlflowClient(mlflow_server)
    version = client.get_model_version_by_alias("flow-test-draft", "champion")
    assert version.source
    run_artifacts = [a.path for a in client.list_artifacts(version.run_id)]
    assert run_artifacts
    import fsspec

    stored = fsspec.filesystem("s3", skip_instance_cache=True).find("mlflow-cluster/artifacts")
    assert any("model.safetensors" in p for p in stored), stored[:20]

