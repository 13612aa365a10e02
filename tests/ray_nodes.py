"""A Ray cluster of several nodes on this machine, for the tests of what a cluster changes (issue 43).

``ray.cluster_utils.Cluster`` starts a head and worker nodes as separate raylets in this process's session. Each
worker node is started in a working directory of its own (a raylet's workers run in its working directory), so a
relative path names another file there than here — what a node of a real cluster sees of the driver's disk. Every
node listens on 127.0.0.1 only: Ray's loopback mode (``pipelines.cluster.bind_local_cluster_to_loopback``, also in
the environment the raylets inherit) — ``ray start`` on Linux would take the machine's network address.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch (ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)


@contextmanager
def ray_nodes(root: Path, workers: int = 2, cpus: float = 1, head_cpus: float | None = None,
              env_vars: dict[str, str] | None = None, connect: bool = True) -> Iterator[dict[str, Any]]:
    """A head (in this working directory) and ``workers`` worker nodes, each in ``root/node-<i>``, ``cpus`` CPUs
    each (the head: ``head_cpus``, default ``cpus``; 0: no task of the run there); this driver connected through
    ``connect_ray`` (its workers get ``env_vars``) unless not ``connect`` (a driver of its own). Yields ``address``,
    ``cluster``, ``head`` (its node id), ``nodes``: worker node id -> its working directory (every node added),
    ``add()``: one more worker node, ``kill(node id)``: a worker node lost."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from pipelines.cluster import connect_ray

    before = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    here = os.getcwd()
    head_cpus = cpus if head_cpus is None else head_cpus
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    nodes: dict[str, Path] = {}

    def add_worker() -> str:
        """One more worker node, in a working directory of its own; returns its id."""
        cwd = root / f"node-{len(nodes)}"
        cwd.mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
        try:
            node = cluster.add_node(num_cpus=cpus)
        finally:
            os.chdir(here)
        nodes[node.node_id] = cwd
        cluster.wait_for_nodes()
        return node.node_id

    def kill_worker(node_id: str) -> None:
        """The node's raylet and every process on it killed at once (a machine lost, not a drained node)."""
        node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
        cluster.remove_node(node, allow_graceful=False)

    try:
        head = cluster.head_node.node_id
        for _ in range(workers):
            add_worker()
        if connect:
            connect_ray(cluster.address, env_vars=env_vars, log_to_driver=False)
            ray_constants.ENABLE_RAY_CLUSTER = False  # connect_ray set it for a cluster by address
        yield {"address": cluster.address, "cluster": cluster, "head": head, "nodes": nodes, "add": add_worker,
               "kill": kill_worker}
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before[0] is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = before[0]
        ray_constants.ENABLE_RAY_CLUSTER = before[1]
