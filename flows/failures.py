"""How a command's failure is said: one line, the conventional exit status, the rest in a log file
(docs/guarantees.md).

ctrl-C is exit 130 and one line saying whether a rerun resumes (``interrupted``) — also when Ray Train's own
ctrl-C handler took the signal (``pipelines.cluster.NoteInterrupt``). A failure inside a Ray worker is one line
(``flows/cli.py``) plus the path of the full log this module writes (``write_full_log``: the driver's traceback,
every failed rank's, and where Ray keeps every process's output); Ray Train's own echoes of it are not shown
(``pipelines.cluster.SAID_BY_THE_DRIVER``).
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path

RESUMES = ("train", "dump", "regenerate", "run")  # commands whose rerun resumes where an interrupted one stopped


def interrupted(command: str) -> int:
    """ctrl-C: one line saying what to do next, and the conventional status (128 + SIGINT)."""
    again = " — rerun the same command to resume" if command in RESUMES else ""
    print(f"specdraft {command}: interrupted{again}", file=sys.stderr)
    return 130


def ray_interrupted() -> bool:
    """Whether Ray Train's driver-side handler took a ctrl-C (``pipelines.cluster.NoteInterrupt``)."""
    cluster = sys.modules.get("pipelines.cluster")
    return cluster is not None and cluster.INTERRUPTED.is_set()


def worker_failure(err: BaseException) -> BaseException | None:
    """The exception a Ray worker raised that ``err`` (a Ray task or Ray Train failure) carries, else None."""
    inner = getattr(err, "cause", None)  # RayTaskError: the worker's exception
    failures = getattr(err, "worker_failures", None)  # Ray Train: rank -> its exception
    if not isinstance(inner, BaseException) and isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = getattr(inner, "_base_exc", inner)  # Ray Train's wrapper of the user's exception and its traceback
    return inner if isinstance(inner, BaseException) else None


def write_full_log(err: BaseException, out: str | Path | None, command: str) -> str:
    """Write what the one line leaves out — the driver's traceback and every failed worker's — beside the command's
    output (``specdraft-error.log`` in a local --out directory, else a temporary file); returns its path."""
    text = "".join(traceback.format_exception(err))
    for rank, failure in (getattr(err, "worker_failures", None) or {}).items():
        text += f"\n--- rank {rank} ---\n{failure}\n"
    node = getattr(sys.modules.get("ray._private.worker"), "_global_node", None)
    if node is not None:  # every worker's own output, Ray Train's logs included
        text += f"\nRay's logs of every process of this run: {node.get_logs_dir_path()}\n"
    out = Path(str(out or ""))
    if str(out) not in ("", ".") and out.is_dir():
        path = out / "specdraft-error.log"
        path.write_text(text)
        return str(path)
    fd, name = tempfile.mkstemp(prefix=f"specdraft-{command}-", suffix=".log")
    with open(fd, "w") as fh:
        fh.write(text)
    return name
