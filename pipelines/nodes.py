"""Pre-flight on a Ray cluster given by address: the cluster answers, and every path its workers read or write is
the same, readable (or writable) path on every alive node — checked before any work (issue 43).

On one machine every Ray worker shares the driver's disk; on a cluster a worker runs on another node, with that
node's disks and its own working directory. A target copied to the driver only, a workdir on the driver's local
disk, a relative path (each node reads it against its own working directory) or a ``sqlite`` tracking file no
other node sees would each fail hours into the night, on the first stage that runs there. ``check_paths_on_nodes``
runs one tiny task on each alive node (``NodeAffinitySchedulingStrategy``, no CPU asked) that resolves and stats
the paths; a path that is not the driver's there, or that the node cannot read (or create and write, for an
output) is a ``ConfigError`` naming the key and the node. Object-store URLs (``s3://``...) are not paths of a node
and are not checked here (the store's own client says what is wrong with one).

``check_reachable``: an ``address`` nobody answers at is one line (``ConfigError``, exit 2) within seconds, not
Ray's minutes of reconnecting.

Placement: each distributed stage records which Ray node ran which part of it (``this_node`` in the actor or
worker, ``by_node`` on the driver) in its summary and ``DONE`` record, under ``nodes`` (docs/cluster.md).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from specdraft.config import ConfigError
from specdraft.store.location import is_url

READ, WRITE, WRITE_FILE = "read", "write", "write a file"  # an input; an output directory; an output file
CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 120.0  # a node's task: a worker process to start (seconds; a minute on a loaded machine)


def cluster_address(address: str | None) -> str | None:
    """The cluster a run connects to: ``ray.address``, else ``RAY_ADDRESS``; None: a local cluster (one disk)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def host_port(address: str) -> tuple[str, int] | None:
    """The GCS (or Ray Client) host and port of ``address``: ``host:port``, ``ray://host:port`` or ``auto`` (the
    cluster this machine last started, as Ray finds it); None for ``auto`` when there is none."""
    if address.startswith("ray://"):
        address = address.removeprefix("ray://")
    elif address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            address = canonicalize_bootstrap_address("auto") or ""
        except (ConnectionError, ValueError):
            return None
        if not address:
            return None
    host, sep, port = address.rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"ray.address={address}: not host:port, ray://host:port or auto")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Something answers at ``address``'s host and port within ``timeout_s``, else one ``ConfigError`` line."""
    where = host_port(address)
    if where is None:
        raise ConfigError(f"ray.address={address}: no running Ray cluster found on this machine — start one "
                          "(ray start --head) or give its address (host:6379, ray://host:10001)")
    try:
        with socket.create_connection(where, timeout=timeout_s):
            pass
    except OSError as err:
        raise ConfigError(f"ray.address={address}: no Ray cluster answers at {where[0]}:{where[1]} within "
                          f"{timeout_s:g} s ({err.strerror or err}) — start it, or fix ray.address "
                          "(or RAY_ADDRESS)") from None


def stat_paths(paths: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """On one node: its id, working directory and, per key, the absolute path there and what is wrong with it
    (None: nothing). ``paths``: key -> (path, READ, WRITE or WRITE_FILE); an output that does not exist yet must be
    creatable (its nearest existing parent a writable directory)."""
    import ray

    found: dict[str, tuple[str, str | None]] = {}
    for key, (path, mode) in paths.items():
        where = os.path.abspath(path)
        found[key] = (where, _problem(Path(where), mode))
    return {"node": ray.get_runtime_context().get_node_id(), "cwd": os.getcwd(), "paths": found}


def _problem(path: Path, mode: str) -> str | None:
    if mode == READ:
        if not path.exists():
            return "does not exist there"
        return None if os.access(path, os.R_OK) else "is not readable there"
    if path.exists():
        if path.is_dir() != (mode == WRITE):
            return "is not a directory there" if mode == WRITE else "is a directory there"
        return None if os.access(path, os.W_OK | (os.X_OK if mode == WRITE else 0)) else "is not writable there"
    parent = next((p for p in path.parents if p.exists()), Path("/"))
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created there ({parent} is not a writable directory)"
    return None


def _paths_to_check(paths: dict[str, tuple[str | None, str]]) -> dict[str, tuple[str, str]]:
    """The node paths among ``paths`` (key -> (path or URL or None, mode)): no URL, nothing unset."""
    return {key: (str(path), mode) for key, (path, mode) in paths.items() if path and not is_url(str(path))}


def check_paths_on_nodes(paths: dict[str, tuple[str | None, str]], timeout_s: float = ANSWER_TIMEOUT_S,
                         nodes: list[str] | None = None) -> None:
    """Every local path of ``paths`` (key -> (path, READ, WRITE or WRITE_FILE)) is, on every alive node of the
    connected Ray cluster, the driver's path (the same absolute path: a relative one resolved in each node's working
    directory differs) and usable there; else a ``ConfigError`` naming the key, the path and the node. A node that
    does not answer within ``timeout_s`` is refused too (its stages would wait the same way). ``nodes``: only these
    node ids."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    local, names = _paths_to_check(paths), nodes
    if not local:
        return
    probe = ray.remote(num_cpus=0, max_retries=0)(stat_paths)
    nodes = [n for n in ray.nodes() if n.get("Alive") and (names is None or n["NodeID"] in names)]
    pending = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(local):
               n for n in nodes}
    ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    if late:
        node = pending[late[0]]
        raise ConfigError(f"Ray node {_name(node)}: did not run a pre-flight task within {timeout_s:g} s (is it "
                          "out of memory, or its workers unable to start?)")
    for answer in ray.get(ready):
        node = next(n for n in nodes if n["NodeID"] == answer["node"])
        for key, (where, problem) in answer["paths"].items():
            path, _ = local[key]
            mine = os.path.abspath(path)
            if where != mine:
                raise ConfigError(f"{key}={path}: a relative path, read against each node's working directory — "
                                  f"{where} on Ray node {_name(node)} (working directory {answer['cwd']}), {mine} "
                                  "here; give an absolute path on a mount every node sees")
            if problem:
                raise ConfigError(f"{key}={path}: {problem} on Ray node {_name(node)} — every node reads and "
                                  "writes the run's files: put them on a mount every node sees, or in the object "
                                  "store")


def _name(node: dict[str, Any]) -> str:
    """A node as a user finds it in ``ray status`` / ``ray list nodes``: its id (short) and address."""
    return f"{node['NodeID'][:12]} ({node.get('NodeManagerAddress', '?')})"


def this_node() -> dict[str, str]:
    """The Ray node this process runs on: ``{"node": its id, "ip": its address}`` (what ``ray list nodes`` shows)."""
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


def by_node(parts: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The parts a stage's actors or workers ran (``{**this_node(), unit: a count or a list}``), one entry per
    node with its units summed (counts) or joined and sorted (lists), nodes sorted by id: the stage's placement."""
    nodes: dict[str, dict[str, Any]] = {}
    for part in parts:
        entry = nodes.setdefault(part["node"], {"node": part["node"], "ip": part["ip"]})
        for unit, value in part.items():
            if unit not in ("node", "ip"):
                entry[unit] = sorted(entry.get(unit, []) + value) if isinstance(value, list) else entry.get(unit, 0) + value
    return [nodes[n] for n in sorted(nodes)]


RANKS_FILE = "nodes.json"  # a training run's: Ray Train's result keeps only the last checkpoint's metrics


def record_ranks(rank: int, out: str | Path) -> None:
    """Which Ray node ran which ranks of a Ray Train worker group (``by_node``; a restarted group's, after a
    failure), written by rank 0 to ``out``/``RANKS_FILE`` (``ranks_on_nodes`` reads it on the driver). Collective
    when ``torch.distributed`` is initialised: every rank calls it."""
    import torch.distributed as dist

    from specdraft import files

    mine = {**this_node(), "ranks": [rank]}
    gathered: list[dict[str, Any] | None] = [mine]
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        files.write_text(Path(out) / RANKS_FILE, json.dumps(by_node(gathered)))


def ranks_on_nodes(out: str | Path) -> list[dict[str, Any]]:
    """``record_ranks``' placement of the run in ``out`` (none written: [])."""
    path = Path(out) / RANKS_FILE
    return json.loads(path.read_text()) if path.is_file() else []
