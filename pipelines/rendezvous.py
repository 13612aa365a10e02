"""A training run's torch.distributed rendezvous, bound to the address Ray uses (docs/guarantees.md: nothing
listens outside it).

Ray Train's ``TorchConfig`` has rank 0 pick a free port on its node address and every rank call
``init_process_group("env://")`` with that ``MASTER_ADDR``/``MASTER_PORT``; rank 0's ``TCPStore`` server
then listens on every interface (``*:PORT``): torch binds its server to the wildcard address whatever
``MASTER_ADDR`` says, and no variable or option of torch changes that. Here rank 0 first binds a socket to
its node address (Ray's, ``ray.util.get_node_ip_address``: 127.0.0.1 on a local cluster,
``pipelines/cluster.py``), starts the store's server on that socket (``master_listen_fd``, multi-tenant) and
hands its port to every rank: the process group's own store — multi-tenant, same port, same process — is
that server. gloo's and NCCL's pair sockets take their interface from ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` (the loopback on a local cluster: ``cluster.TRAIN_ENV_LOCAL``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
from ray.train.torch import TorchConfig, TorchTrainer
from ray.train.torch.config import _set_torch_distributed_env_vars, _setup_torch_process_group, _TorchBackend

_HELD: dict[str, Any] = {}  # in rank 0's process: the store server, until the process group holds it


def host_store(world_size: int, timeout_s: int) -> tuple[str, int]:
    """Rank 0: the rendezvous store's server on a free port of this node's Ray address only; (address, port)."""
    from torch.distributed import TCPStore

    addr = ray.util.get_node_ip_address()
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    _HELD["store"] = TCPStore(addr, port, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                              multi_tenant=True, master_listen_fd=sock.detach())  # the store owns the socket now
    return addr, port


def release_store() -> None:
    """Rank 0, once the process group is up: it holds the server; this module's reference goes."""
    _HELD.pop("store", None)


def _set_master(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)


class _BoundTorchBackend(_TorchBackend):
    """Ray Train's torch backend with the rendezvous store hosted by ``host_store`` (gloo or nccl, named)."""

    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        if backend_config.backend is None:  # Ray's choice of backend: its own start (not used by specdraft)
            return super().on_start(worker_group, backend_config)
        world = len(worker_group)
        addr, port = worker_group.execute_single(0, host_store, world, backend_config.timeout_s)
        worker_group.execute(_set_master, addr=addr, port=port)
        if not isinstance(worker_group, V1WorkerGroup):  # the variables torch needs, as Ray's own on_start sets them
            worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(rank, _setup_torch_process_group, backend=backend_config.backend,
                                                   world_rank=rank, world_size=world, init_method="env://",
                                                   timeout_s=backend_config.timeout_s) for rank in range(world)])
        worker_group.execute_single(0, release_store)


@dataclass
class BoundTorchConfig(TorchConfig):
    """``TorchConfig`` whose rendezvous listens on Ray's node address only (``host_store``)."""

    @property
    def backend_cls(self):
        return _BoundTorchBackend


def torch_trainer(train_loop_per_worker, *, backend: str, **kwargs: Any) -> TorchTrainer:
    """Ray Train's ``TorchTrainer`` of a training run (``kwargs``: its other arguments) on ``backend`` (gloo on CPU,
    nccl on GPU), its rendezvous bound to Ray's address (``BoundTorchConfig``)."""
    return TorchTrainer(train_loop_per_worker, torch_config=BoundTorchConfig(backend=backend), **kwargs)
