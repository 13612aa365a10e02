"""Pre-flight of a command line and of a run config: every input checked before any work starts.

The config's values were checked when it was loaded (``specdraft.config.from_dict``); this adds the
paths each command names — through ``specdraft.preflight`` — so that a wrong target, draft or input
file exits 2 with one line naming the option (``flows/cli.py``) before Ray, Prefect or a model starts,
and a flow fails once on it instead of retrying (``flows/regenerate_and_train.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from specdraft.targets.checkpoint import check_target_weights
from specdraft.config import ConfigError
from specdraft.plan import draft_arch
from specdraft.preflight import (
    check_aux_layers,
    check_draft,
    check_engine,
    check_files,
    check_init_from,
    check_target,
    target_positions,
)

GLOB = "*?["
# ``pipelines.stages``, the store and ``specdraft.outputs`` import torch / Ray: the checks below import them
# inside the function that needs them, so a command line refused early (and ``--help``) stays light


def _inputs(paths: list[str], key: str) -> None:
    """Files, directories, glob patterns (a pattern may match nothing yet: its reader says so) or prompt-set
    names (``sharegpt``: its package must be installed, ``specdraft.packaged``)."""
    from specdraft.packaged import PackageFileError, resolve_prompt_inputs

    try:
        paths = resolve_prompt_inputs(list(paths))
    except PackageFileError as err:
        raise ConfigError(f"{key}: {err}") from None
    check_files([p for p in paths if not any(ch in p for ch in GLOB)] or (["*"] if paths else []), key)


def check_command(args: argparse.Namespace, cfg: Any) -> None:
    """The paths of a parsed ``specdraft`` command line (``cfg``: its loaded config); raises ``ConfigError``."""
    command = args.command
    if command in ("dump", "regenerate"):
        check_target(args.target)
        _inputs(args.prompts, "--prompts")
        if command == "dump":
            check_aux_layers(args.target, cfg)
        if command == "dump" or cfg.backend == "hf":  # what a worker loads strictly, checked on the driver first
            check_target_weights(args.target)
    elif command == "eval":
        check_target(args.target)
        check_target_weights(args.target)
        check_draft(args.draft)
        check_files(args.questions, "--questions")
        check_engine(cfg.engine, positions=target_positions(args.target))
    elif command == "train":
        check_target(args.target, tokenizer=cfg.features == "online")  # offline: the heads and config only
        check_init_from(cfg.init_from, draft_arch(cfg), "init_from")
        from specdraft.outputs import repeated_paths
        from specdraft.store import location

        local = [s for s in args.store if not location.is_url(s)]
        if local:
            check_files(local, "--store")
        if twice := repeated_paths(args.store):  # a typo for another store, most likely
            first, again = twice[0]
            raise ConfigError(f"--store {again}: the same store as {first}, given twice; name each store once "
                              "(was another store meant?)")
        if cfg.features == "online":
            check_target_weights(args.target)
            _inputs(list(cfg.conversations), "conversations")
    elif command == "run":
        check_run(cfg, overwrite=args.overwrite)


def check_run(cfg: Any, overwrite: bool = False) -> None:
    """The paths of a ``pipelines.configs.RunConfig``: the target (unless the toy one is built), the prompts,
    the eval questions (at least one file: every run evaluates) and ``train.init_from`` (``check_init_from``), each
    a ``ConfigError`` naming the key; then the workdir (``check_workdir``), the tracking server
    (``pipelines.tracking.check_tracking``) and the hand-off directory (``specdraft.freshness.handoff.check_exports``)."""
    if cfg.target.path:
        check_target(cfg.target.path, "target.path")
        check_target_weights(cfg.target.path)
        from pipelines.stages import run_features

        check_aux_layers(cfg.target.path, run_features(cfg), "features.aux_layers")
    traffic = cfg.data.traffic.path
    if not cfg.data.prompts and not traffic:
        raise ConfigError("data.prompts: no prompt file given (files, directories or glob patterns; or "
                          "data.traffic.path: dated request logs)")
    from pipelines.stages import expand_prompts

    try:
        if cfg.data.prompts:
            expand_prompts(cfg.data.prompts)
    except FileNotFoundError as err:
        raise ConfigError(f"data.prompts: {err}") from None
    if traffic:
        from specdraft.store import location

        if not location.is_dir(traffic):
            raise ConfigError(f"data.traffic.path={traffic}: no such directory or prefix (YYYY-MM-DD/*.jsonl)")
    if not cfg.eval.questions:  # the eval stage would find nothing to measure, after regenerate, dump and train
        raise ConfigError("eval.questions: no question file given; the eval stage measures the trained draft on "
                          "them (MT-Bench-format files) and the champion gate compares those numbers")
    check_files(cfg.eval.questions, "eval.questions")
    check_init_from(cfg.train.init_from, draft_arch(cfg.train), champion=True)
    positions = target_positions(cfg.target.path) if cfg.target.path else cfg.target.toy.max_position_embeddings
    check_engine(cfg.eval.settings.engine, "eval.settings.engine", positions=positions)
    check_cluster_cpus(cfg)
    workdir = Path(cfg.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"workdir={cfg.workdir}: exists and is not a directory")
    check_workdir(cfg, overwrite)
    from pipelines.tracking import check_tracking

    check_tracking(cfg.tracking)  # a silent server: one line now, and every later request bounded
    check_cluster(cfg)
    if cfg.handoff.enabled:  # the hand-off's directory: refused now, not after a night of training
        from pipelines.freshness import exports_root
        from specdraft.freshness.handoff import check_exports

        check_exports(exports_root(cfg))


def check_cluster_cpus(cfg: Any) -> None:
    """On a local Ray cluster (no ``ray.address``, no ``RAY_ADDRESS``) of ``ray.num_cpus`` CPUs (default: all):
    the dump's actor pool must leave a CPU to the tokenize and write tasks it runs beside (actors holding every CPU
    leave those tasks waiting forever: the stage hangs without a word). Regenerate's replicas (hf and vllm) run
    without tasks beside them. ``features.torch_threads`` sets an actor's threads apart from the CPUs it asks
    Ray for."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    cpus = cfg.ray.num_cpus or os.cpu_count() or 1
    f = cfg.features
    if f.num_actors * f.cpus_per_actor >= cpus:
        raise ConfigError(f"features.cpus_per_actor={f.cpus_per_actor:g} x features.num_actors={f.num_actors}: "
                          f"the dump's actors would hold all {cpus} CPUs of the local cluster (ray.num_cpus) and its "
                          f"tokenize and write tasks would never run; ask for fewer (features.torch_threads sets "
                          f"the threads)")


def check_cluster(cfg: Any) -> None:
    """On a Ray cluster given by address (``ray.address`` or ``RAY_ADDRESS``; a local one shares this disk): the
    cluster answers (``pipelines.nodes.check_reachable``: one line, not minutes of reconnecting), the run connects
    to it as its stages do, and every path its workers read or write — the workdir (stores, checkpoints, exports),
    the target, a warm start's draft, a ``sqlite`` tracking file, a local artifact root — is the same usable path
    on every alive node (``pipelines.nodes.check_paths_on_nodes``); each a ``ConfigError`` naming key and node."""
    from pipelines.nodes import READ, WRITE, WRITE_FILE, check_paths_on_nodes, check_reachable, cluster_address

    address = cluster_address(cfg.ray.address)
    if address is None:
        return
    check_reachable(address)
    from pipelines.stages import ensure_ray

    try:
        ensure_ray(cfg)
    except ConnectionError as err:  # it answered, but is not a Ray cluster this driver may join
        raise ConfigError(f"ray.address={address}: cannot join the Ray cluster there ({err})") from None
    uri = cfg.tracking.resolved_uri() if cfg.tracking.enabled else ""
    artifacts = cfg.tracking.artifact_location or ""
    init_from = cfg.train.init_from if cfg.train.init_from != "champion" else ""
    check_paths_on_nodes({
        "workdir": (cfg.workdir, WRITE),
        "store_root": (cfg.store_root, WRITE),  # an object-store URL: not a node path, not checked there
        "target.path": (cfg.target.path, READ),
        "train.init_from": (init_from, READ),
        "tracking.uri": (uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else "", WRITE_FILE),
        "tracking.artifact_location": (artifacts.removeprefix("file://"), WRITE),
    })


# what a run writes in its workdir: a workdir of a run from before the ownership marker holds some of them
RUN_ENTRIES = ("targets", "regenerate", "features", "prefect.db")


def check_workdir(cfg: Any, overwrite: bool = False) -> None:
    """The run's workdir checked as every command's ``--out`` (``specdraft.outputs.check_output``): never one
    of its inputs, nor inside or holding one (the target, a prompt file or the directory a prompt pattern
    reads, a question file), not even with ``overwrite``; a non-empty directory that is not a run's own is
    refused unless ``overwrite`` (``specdraft run --overwrite``: the run writes its stage directories
    beside the files there). Raises ``specdraft.outputs.OutputError``; writes nothing."""
    from pipelines.stages import expand_prompts
    from specdraft.outputs import check_output
    from specdraft.store.location import is_url

    from specdraft.packaged import resolve_prompt_inputs

    patterns = resolve_prompt_inputs(list(cfg.data.prompts)) if cfg.data.prompts else []
    prompts = [root for root in map(_read_root, patterns) if root] + expand_prompts(patterns) if patterns else []
    if cfg.data.traffic.path and not is_url(cfg.data.traffic.path):
        prompts.append(cfg.data.traffic.path)  # a workdir inside the logs would read itself back
    check_output(cfg.workdir, "run", inputs={"target.path": cfg.target.path or None, "data.prompts": prompts,
                                             "eval.questions": list(cfg.eval.questions)},
                 overwrite=overwrite, own=RUN_ENTRIES, option="workdir=")


def _read_root(pattern: str) -> str | None:
    """What a prompt pattern reads beyond its files: a directory as given (read recursively); a recursive
    glob (``**``), the directory above its first wildcard — a workdir there would feed the run's own
    outputs back as prompts; None for a file or another glob (its files are checked)."""
    if "**" in pattern:
        first = min(pattern.index(ch) for ch in GLOB if ch in pattern)
        return str(Path(pattern[:first] + "x").parent)
    return None if any(ch in pattern for ch in GLOB) else pattern
