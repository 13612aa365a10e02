"""A worker node lost during the dump, on a Ray cluster of three nodes on this machine (``tests/ray_nodes.py``;
issue 43 item 3). A replacement node joins (as an autoscaler would add one); the dump then either goes on (Ray
retries the lost node's tasks, and the pool works on with the actors it has) or fails (a lost actor is never
restarted: ``pipelines.cluster.ACTOR_POOL``) and its rerun — the flow's retry of the stage — resumes; both were seen
here, depending on what the node held when it went. Either way it ends with the store an uninterrupted dump
writes — complete shards kept, not rewritten; every sample once; the same arrays — checked as
``tests/pipelines/test_dump.py`` checks a dump killed on one node (``tests/dump_checks.py``)."""

from __future__ import annotations

import threading
import time

import pytest

from pipelines.configs import DumpConfig
from pipelines.dump import dump_features
from specdraft import store
from tests.conftest import connect_local_ray, worker_pythonpath
from tests.dump_checks import assert_resumed_like, complete_shards
from tests.pipelines.test_dump import SHARDS, conversations
from tests.ray_nodes import ray_nodes

pytestmark = pytest.mark.slow

CFG = DumpConfig(samples_per_shard=4, max_length=96, batch_tokens=400, max_batch_size=6, num_actors=2)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, request):
    import ray

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    with ray_nodes(tmp_path_factory.mktemp("nodes"), workers=2, cpus=2, head_cpus=0,
                   env_vars={"PYTHONPATH": worker_pythonpath()}) as up:
        yield up
    if was_up:
        connect_local_ray(request)


def test_a_worker_node_lost_during_the_dump_resumes_with_nothing_lost_or_twice(nodes, tiny_toy_target, tmp_path):
    rows = conversations()
    reference_dir, out = tmp_path / "reference", tmp_path / "resumed"
    reference = dump_features(tiny_toy_target, rows, reference_dir, CFG, progress=False)
    results: list[dict | BaseException] = []

    def dump() -> None:
        try:
            results.append(dump_features(tiny_toy_target, rows, out, CFG, progress=False))
        except BaseException as err:  # noqa: BLE001 (the failure is one of the outcomes checked)
            results.append(err)

    worker = threading.Thread(target=dump, daemon=True)
    worker.start()
    deadline = time.monotonic() + 300
    while not store.list_shard_dirs(out)[0] if out.exists() else True:
        assert worker.is_alive() and time.monotonic() < deadline, "the dump ended before a node could be lost"
        time.sleep(0.2)
    kept = complete_shards(out)  # complete before the loss
    assert len(kept) < SHARDS
    nodes["kill"](next(iter(nodes["nodes"])))
    nodes["add"]()  # the replacement node, as an autoscaler adds one
    worker.join(600)
    assert not worker.is_alive(), "the dump hangs after losing a node, with a replacement there"
    summary = results[0]
    if isinstance(summary, BaseException):  # the stage failed: the flow's retry (here: the rerun) resumes it
        print(f"the dump failed on the lost node ({type(summary).__name__}); rerun")
        summary = dump_features(tiny_toy_target, rows, out, CFG, progress=False)
    else:  # Ray retried the lost node's tasks; the pool went on with the actors it had
        print("the dump went on without the lost node")
    assert_resumed_like(out, summary, reference_dir, reference, kept)
