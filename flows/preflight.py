"""Pre-flight of a command line and of a run config: every input checked before any work starts.

The config's values were checked when it was loaded (``specdraft.config.from_dict``); this adds the
paths each command names — through ``specdraft.preflight`` — so that a wrong target, draft or input
file exits 2 with one line naming the option (``flows/cli.py``) before Ray, Prefect or a model starts,
and a flow fails once on it instead of retrying (``flows/regenerate_and_train.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specdraft.config import ConfigError
from specdraft.preflight import check_draft, check_engine, check_files, check_target

GLOB = "*?["


def _inputs(paths: list[str], key: str) -> None:
    """Files, directories or glob patterns (a pattern may match nothing yet: its reader says so)."""
    check_files([p for p in paths if not any(ch in p for ch in GLOB)] or (["*"] if paths else []), key)


def check_command(args: argparse.Namespace, cfg: Any) -> None:
    """The paths of a parsed ``specdraft`` command line (``cfg``: its loaded config); raises ``ConfigError``."""
    command = args.command
    if command in ("dump", "regenerate"):
        check_target(args.target)
        _inputs(args.prompts, "--prompts")
    elif command == "eval":
        check_target(args.target)
        check_draft(args.draft)
        check_files(args.questions, "--questions")
        check_engine(cfg.engine)
    elif command == "train":
        check_target(args.target, tokenizer=cfg.features == "online")  # offline: the heads and config only
        from specdraft.store import location

        local = [s for s in args.store if not location.is_url(s)]
        if local:
            check_files(local, "--store")
        if cfg.features == "online":
            check_files(list(cfg.conversations), "conversations")
    elif command == "run":
        check_run(cfg)


def check_run(cfg: Any) -> None:
    """The paths of a ``pipelines.stages.RunConfig``: the target (unless the toy one is built), the prompts
    and the eval questions; raises ``ConfigError`` naming the key."""
    if cfg.target.path:
        check_target(cfg.target.path, "target.path")
    if not cfg.data.prompts:
        raise ConfigError("data.prompts: no prompt file given (files, directories or glob patterns)")
    from pipelines.stages import expand_prompts

    try:
        expand_prompts(cfg.data.prompts)
    except FileNotFoundError as err:
        raise ConfigError(f"data.prompts: {err}") from None
    if cfg.eval.questions:
        check_files(cfg.eval.questions, "eval.questions")
    check_engine(cfg.eval.settings.engine, "eval.settings.engine.name")
    workdir = Path(cfg.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"workdir={cfg.workdir}: exists and is not a directory")
