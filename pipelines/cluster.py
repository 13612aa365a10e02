"""Connecting to Ray (a local cluster or ``address``), the one way every stage does it.

docs/operations.md "The nightly deployment" (Ray): ``ray.init(address=...)`` — none -> a local cluster,
a cluster address or a ``ray://`` URL -> that cluster. Local runs start without the dashboard UI (two cores
are precious), and some Ray components then log the same harmless lines over and over, tracebacks included:

* Ray Train v2's placement-group cleaner (a detached actor beside every training run) polls the
  controller's state through the state API about once a second and warns "Failed to query Ray
  Train Controller actor state" whenever a query times out — on a loaded machine, most of the run;
* the train controller's autoscaling request times out on a busy CPU ("Failed to send resource
  request ... safe to ignore", with a traceback) — a local cluster has no autoscaler to ask;
* Ray Data announces that the progress bars a stage turned off are off; a local start announces
  that token authentication is on (the warning that it is *off* stays visible); Ray Train reports
  every checkpoint in two lines.

Some lines come from Ray's C++ core or from Ray Train's own set-up and cannot be dropped at a logger;
they are avoided at their source instead:

* every line a Ray Train worker prints appeared twice: Ray Train patches ``print`` to log to the root
  logger (shown on stderr) and, since Ray's workers replace ``sys.stdout``, also to print it (stdout) —
  ``RAY_TRAIN_ENABLE_PRINT_PATCH=0`` (``TRAIN_ENV``) keeps a worker's prints plain, once;
* (not a line: a wait) Ray Train's controller polls its workers every 2 s, and each report of a worker waits for
  the previous one to be collected: ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.2`` (``TRAIN_ENV``);
* "has constructor arguments in the object store and max_restarts > 0" (``core_worker.cc``) is logged
  when an actor that Ray may restart is built from an object reference: Ray Data passes every pool
  actor its map function by reference, and Ray Train's preemption watcher is built so too. Our actor
  pools are not restarted (``ACTOR_POOL``: a replica that dies fails its stage, which is resumable and
  retried by the flow, instead of being retried without end), and a local cluster — one machine, no
  preemption to watch for — runs without the watcher (``TRAIN_ENV_LOCAL``).

Each is set in the Ray job's ``runtime_env`` only where the user's environment does not set it.

One is a bug of Ray's: the cleaner's monitor thread catches only ``RayStateApiException`` around its state
query, but a state-API answer that is JSON without a ``result`` key (an HTTP server other than the
dashboard answering on its port, as happens when local clusters come and go on one machine) raises
``KeyError`` inside Ray's client and kills the thread with a traceback; the run is unharmed, the cleaner
gone. ``guard_cleaner_queries`` (in the setup hook) turns such an answer into the ``RayStateApiException``
the thread expects, so it warns (a known harmless line) and keeps monitoring.

``KNOWN_HARMLESS`` (and ``KNOWN_HARMLESS_LOCAL``, local clusters only) list such messages per
logger; ``quiet_known_warnings`` drops exactly those records at their logger — in the driver and,
as the cluster's ``worker_process_setup_hook``, in every Ray worker process — so nothing else those
loggers say is hidden. The hook also points the workers' state-API client at their own cluster
(``RAY_ADDRESS``): with several Ray instances on one machine (parallel CI jobs, or a cluster's node beside
another cluster) its auto-detection fails and kills the cleaner's monitor thread with a traceback, or joins the
latest instance started — another cluster — and warns about it every second.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from pipelines.head import ray_wait, watch_head

# logger name -> message prefixes known to be harmless (why: see the module docstring)
KNOWN_HARMLESS: dict[str, tuple[str, ...]] = {
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": (
        "Failed to query Ray Train Controller actor state",
    ),
    "ray.data._internal.progress": ("Progress bars disabled",),
    # two lines per checkpoint (specdraft's own progress lines say where training is)
    "ray.train.v2._internal.execution.storage": ("Checkpoint successfully created at",),
    "ray/train/v2/_internal/execution/context.py": ("Reporting training result",),  # named by its file
    "ray._private.authentication.authentication_token_setup": (
        "Token authentication is enabled for this Ray cluster",
    ),
}
# a training run's failure, said by the driver in one line with the path of the full log (``flows/cli.py``): the
# worker's traceback and the controller's echo of it (~65 lines, forwarded to the console) are not repeated
SAID_BY_THE_DRIVER: dict[str, tuple[str, ...]] = {
    "ray.train.v2._internal.util": ("Error in training function",),
    "ray.train.v2._internal.execution.failure_handling.default": ("[FailurePolicy] RAISE",),
}
KNOWN_HARMLESS_LOCAL: dict[str, tuple[str, ...]] = {
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client": (
        "Failed to send resource request",
    ),
}


# Ray Train's settings for every run (see the module docstring), and for a local cluster's runs
TRAIN_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
             # the controller collects a worker's report (a checkpoint, an epoch end) when it polls the workers, and
             # a worker's next report waits until then: at Ray's 2 s, reports under 2 s apart (a small draft,
             # checkpoint_every of tens of steps) stalled training — 21 of the toy recipe's 30 s. A slow poll is only
             # a missed health check (a worker is dead after RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, 10 min).
             "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
TRAIN_ENV_LOCAL = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
                   # torch.distributed's gloo and NCCL pairs on the loopback interface (``rendezvous_config``)
                   **({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"} if sys.platform == "linux" else {})}
# map_batches(..., **ACTOR_POOL) for the Ray Data actor pools (regenerate, dump, eval replicas)
ACTOR_POOL: dict[str, Any] = {"max_restarts": 0}


class DropKnownHarmless(logging.Filter):
    """Drops the records of one logger whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        # the unformatted message: every known line starts with literal text, and a filter must never
        # raise (an exception here would surface in whatever code logged, Ray's C callbacks included)
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def output_to_file(path: str | Path) -> None:
    """This process's stdout and stderr — file descriptors 1 and 2: Python's, a C library's (tcmalloc) and those of
    the processes it starts from now on (vLLM's engine core, multiprocessing's resource tracker) — appended to
    ``path``. For an actor whose third-party output a user cannot act on (a vllm replica's INFO lines and
    warnings): Ray relays what a worker writes there to the driver's console; the actor's results and errors
    still reach the driver as Ray values."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


INTERRUPTED = threading.Event()  # set in the driver when Ray Train's own ctrl-C handler took a SIGINT


class NoteInterrupt(logging.Filter):
    """Ray Train's ``fit`` answers ctrl-C with its own handler (a graceful abort, then ``sys.exit(0)`` that ends the
    process with status 1, or a result without a draft): its announcement is noted here (``INTERRUPTED``) and left
    to the command's one line (``flows/cli.py``: exit 130, "rerun to resume")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Received SIGINT"):
            INTERRUPTED.set()
            return False
        return True


INTERRUPT_LOGGER = "ray.train.v2.api.data_parallel_trainer"


def _logger_name(name: str) -> str:
    """A logger name; ``ray/...py`` stands for a module whose logger is ``getLogger(__file__)``."""
    if not name.endswith(".py"):
        return name
    import importlib.util

    spec = importlib.util.find_spec("ray")  # finds the package without importing it
    return str(Path(spec.origin).parent.parent / name) if spec and spec.origin else name


def quiet_known_warnings(local: bool = False) -> None:
    """Install ``DropKnownHarmless`` on the loggers of ``KNOWN_HARMLESS`` (and ``KNOWN_HARMLESS_LOCAL``
    with ``local``) in this process; idempotent."""
    for name, prefixes in {**KNOWN_HARMLESS, **SAID_BY_THE_DRIVER, **(KNOWN_HARMLESS_LOCAL if local else {})}.items():
        logger = logging.getLogger(_logger_name(name))
        for old in [f for f in logger.filters if isinstance(f, DropKnownHarmless)]:
            logger.removeFilter(old)
        logger.addFilter(DropKnownHarmless(prefixes))
    logger = logging.getLogger(INTERRUPT_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, NoteInterrupt)]:
        logger.removeFilter(old)
    logger.addFilter(NoteInterrupt())


CLEANER_MODULE = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def _guard_cleaner(cleaner: Any) -> None:
    """Wrap the cleaner module's state query (see ``guard_cleaner_queries``); idempotent."""
    from ray.util.state.exception import RayStateApiException

    query = cleaner.is_actor_alive
    if getattr(query, "guarded", False):
        return

    def is_actor_alive(*args: Any, **kwargs: Any) -> bool:
        try:
            return query(*args, **kwargs)
        except (KeyError, TypeError) as error:  # JSON without Ray's "result"/"data" keys
            raise RayStateApiException(f"malformed state API answer ({error!r})") from error

    is_actor_alive.guarded = True  # type: ignore[attr-defined]
    cleaner.is_actor_alive = is_actor_alive


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards the cleaner module when a process imports it: a worker's setup hook imports nothing of Ray Train
    (most workers never load it; the import costs seconds of CPU)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != CLEANER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            _guard_cleaner(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def guard_cleaner_queries() -> None:
    """Ray Train's placement-group cleaner sees a malformed state-API answer as the state API being
    unavailable, which it handles (see the module docstring): now if this process has imported it, else when
    it does; idempotent."""
    if CLEANER_MODULE in sys.modules:
        _guard_cleaner(sys.modules[CLEANER_MODULE])
    elif not any(isinstance(finder, _GuardOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _GuardOnImport())


def setup_local_worker() -> None:
    """``worker_process_setup_hook`` of a local cluster: quiet, and the state API is this cluster's."""
    import ray

    quiet_known_warnings(local=True)
    guard_cleaner_queries()
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


def setup_cluster_worker() -> None:
    """``worker_process_setup_hook`` on a cluster given by address: quiet, and the state API is this cluster's (a
    cluster's node may share its machine with other Ray instances: the cluster test's nodes did, and the cleaner's
    auto-detection joined the latest one started)."""
    import ray

    quiet_known_warnings()
    guard_cleaner_queries()
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)


LOOPBACK = "127.0.0.1"


def bind_local_cluster_to_loopback(local: bool) -> None:
    """A local cluster's node address is 127.0.0.1, so that all its servers (GCS, raylet, workers, the agents)
    listen on the loopback interface only, never on the machine's network address or all interfaces.

    Ray takes a node's address from its routable interface on Linux and turns an explicit
    ``_node_ip_address="127.0.0.1"`` back into it; the loopback is what it uses for local clusters on macOS
    and Windows, where ``ray_constants.ENABLE_RAY_CLUSTER`` is false — set here for a local cluster, and back
    to Ray's default for one given by address (which must be reachable from other nodes)."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = (not local) and ray_constants.env_bool(
        ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, not ray_constants.IS_WINDOWS_OR_OSX)


def connect_ray(address: str | None = None, num_cpus: float | None = None,
                env_vars: dict[str, str] | None = None, **kwargs: Any) -> None:
    """``ray.init`` unless Ray is initialized: ``address`` None (and no ``RAY_ADDRESS``) -> a local
    cluster of ``num_cpus`` CPUs (default: all) without the dashboard UI, listening on 127.0.0.1 only
    (``bind_local_cluster_to_loopback``); else that cluster.
    ``env_vars``: set in every worker (e.g. an object store's endpoint) beside the setup hook and, where the
    environment does not set them, ``TRAIN_ENV`` (and ``TRAIN_ENV_LOCAL`` on a local cluster)."""
    import ray

    local = address is None and not os.environ.get("RAY_ADDRESS")
    quiet_known_warnings(local=local)
    if ray.is_initialized():
        return
    hook = setup_local_worker if local else setup_cluster_worker
    bind_local_cluster_to_loopback(local)
    wait_s = None if local else ray_wait()  # the head's loss: our line, before Ray's own ending (pipelines.head)
    ours = {k: v for k, v in {**TRAIN_ENV, **(TRAIN_ENV_LOCAL if local else {})}.items() if k not in os.environ}
    # a local run starts its own cluster ("local"): with None, Ray joins the last `ray start` cluster on the host
    # (/tmp/ray/ray_current_cluster), someone else's cluster, without a word
    ray.init(address="local" if local else address, num_cpus=num_cpus if local else None, include_dashboard=False,
             ignore_reinit_error=True, **({"dashboard_host": LOOPBACK} if local else {}),
             runtime_env={"worker_process_setup_hook": hook, "env_vars": {**ours, **(env_vars or {})}}, **kwargs)
    if wait_s is not None:
        watch_head(address or os.environ["RAY_ADDRESS"], wait_s)
