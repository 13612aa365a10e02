"""Pre-flight on a Ray cluster of two nodes on this machine, a head and a worker node (``tests/ray_nodes.py``): a
path a worker node does not see as the driver does, or cannot use, is refused before any work, naming the key and
the node; an address nobody answers at is one line within seconds (issue 43 item 2)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from flows.cli import main
from pipelines.nodes import READ, WRITE, WRITE_FILE, by_node, check_paths_on_nodes, check_reachable
from specdraft.config import ConfigError
from tests.conftest import connect_local_ray, worker_pythonpath
from tests.ray_nodes import ray_nodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, request):
    import ray

    was_up = ray.is_initialized()  # the session's local Ray (``local_ray``): this module's cluster replaces it
    if was_up:
        ray.shutdown()
    with ray_nodes(tmp_path_factory.mktemp("nodes"), workers=1, env_vars={"PYTHONPATH": worker_pythonpath()}) as up:
        yield up
    if was_up:
        connect_local_ray(request)


def test_by_node_sums_counts_and_joins_parts_per_node():
    parts = [{"node": "b", "ip": "10.0.0.2", "shards": [4], "rows": 2}, {"node": "a", "ip": "10.0.0.1", "shards": [3]},
             {"node": "b", "ip": "10.0.0.2", "shards": [1], "rows": 5}, {"node": "a", "ip": "10.0.0.1", "shards": [0]}]
    assert by_node(parts) == [{"node": "a", "ip": "10.0.0.1", "shards": [0, 3]},
                              {"node": "b", "ip": "10.0.0.2", "shards": [1, 4], "rows": 7}]
    assert by_node([]) == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_paths_every_node_sees_pass_and_urls_are_not_node_paths(nodes, tmp_path):
    (tmp_path / "target").mkdir()
    check_paths_on_nodes({"target.path": (str(tmp_path / "target"), READ),
                          "workdir": (str(tmp_path / "runs" / "night"), WRITE),  # created by the run: creatable
                          "tracking.artifact_location": ("s3://bucket/mlflow", WRITE),
                          "train.init_from": ("", READ)})


def test_a_relative_path_is_refused_naming_a_worker_node_and_its_directory(nodes):
    """The head runs in the driver's working directory (a relative path is the same there); each worker node in
    its own."""
    check_paths_on_nodes({"data": ("configs", READ)}, nodes=[nodes["head"]])
    with pytest.raises(ConfigError) as err:
        check_paths_on_nodes({"data": ("configs", READ)})
    line = str(err.value)
    assert line.startswith("data=configs: a relative path")
    named = [node for node in nodes["nodes"] if node[:12] in line]
    assert len(named) == 1 and f"working directory {nodes['nodes'][named[0]]})" in line
    assert nodes["head"][:12] not in line and "\n" not in line


def test_a_path_missing_or_unusable_on_the_nodes_is_refused_with_its_key(nodes, tmp_path):
    with pytest.raises(ConfigError, match=r"^target.path=.*/no-target: does not exist there on Ray node \w{12} "):
        check_paths_on_nodes({"target.path": (str(tmp_path / "no-target"), READ)})
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"^workdir=.*/a-file: is not a directory there on Ray node"):
        check_paths_on_nodes({"workdir": (str(tmp_path / "a-file"), WRITE)})
    with pytest.raises(ConfigError, match=r"^workdir=.*/a-file/runs: cannot be created there"):
        check_paths_on_nodes({"workdir": (str(tmp_path / "a-file" / "runs"), WRITE)})
    with pytest.raises(ConfigError, match=r"^tracking.uri=.*: is a directory there"):
        check_paths_on_nodes({"tracking.uri": (str(tmp_path), WRITE_FILE)})
    check_paths_on_nodes({"tracking.uri": (str(tmp_path / "a-file"), WRITE_FILE)})  # a file to write: fine


def test_an_address_nobody_answers_at_is_one_line_in_seconds(nodes):
    check_reachable(nodes["address"])
    check_reachable(f"ray://{nodes['address']}")  # the same host and port, as Ray Client names it
    port = free_port()
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^ray.address=127.0.0.1:{port}: no Ray cluster answers at "):
        check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 5
    with pytest.raises(ConfigError, match=r"^ray.address=somewhere: not host:port"):
        check_reachable("somewhere")


def test_specdraft_run_refuses_them_before_any_work(nodes, tmp_path, capsys):
    """The run's pre-flight, through the command line: exit 2, one line, nothing written."""
    port = free_port()
    assert main(["run", f"ray.address=127.0.0.1:{port}", "workdir=" + str(tmp_path / "w1")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"ray.address=127.0.0.1:{port}: no Ray cluster answers" in err
    workdir = f"runs-{port}"  # relative: the driver's (this checkout's) and each worker node's own
    assert main(["run", f"ray.address={nodes['address']}", f"workdir={workdir}",
                 "tracking.uri=sqlite:///" + str(tmp_path / "mlflow.db")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"workdir={workdir}: a relative path" in err
    assert not Path(workdir).exists() and not (tmp_path / "w1").exists()
    # a relative tracking file: the training workers log into it on their nodes
    assert main(["run", f"ray.address={nodes['address']}", "workdir=" + str(tmp_path / "w2"),
                 "tracking.uri=sqlite:///mlflow.db"]) == 2
    assert "tracking.uri=mlflow.db: a relative path" in capsys.readouterr().err
    # a relative store_root: each node would write the run's feature stores in a directory of its own
    assert main(["run", f"ray.address={nodes['address']}", "workdir=" + str(tmp_path / "w3"), f"store_root=st-{port}",
                 "tracking.uri=sqlite:///" + str(tmp_path / "mlflow.db")]) == 2
    assert f"store_root=st-{port}: a relative path" in capsys.readouterr().err and not Path(f"st-{port}").exists()
