"""A stage's third-party output that a user cannot act on goes to the stage's log file, not to the console.

While the flow runs a stage (``flows/regenerate_and_train.py``), ``stage_log(path)`` sends to ``path``:

* the records under ``WARNING`` of the third-party loggers ``QUIET_LOGGERS`` (Ray Data's "Starting execution of
  Dataset ..." / "Execution plan of ..." / "execution finished" lines, each Ray Data stage's three) that would
  reach the console: a filter on those loggers' console handlers passes them to the file instead;
* the warnings ``KNOWN_WARNINGS`` names (Ray Data's deprecation of ``ray_remote_args``, which is still the only
  way to ask for ``max_restarts=0`` (``cluster.ACTOR_POOL``); torch's ``reduce_op`` FutureWarning; "Triton is not
  installed"): ``warnings.showwarning`` writes them to the file.

The first record or warning sent there prints one line naming the file; warnings and errors of those loggers,
and every other warning, still show. Output of other processes is kept off the console where it is made: a
vllm replica's in ``<out>/vllm.log`` (``cluster.output_to_file``), the engine measurement's in ``engine.log``
beside the eval report (``specdraft.evaluation.engine.measure_engine``). Lines known to be harmless and said
over and over are dropped outright at their loggers instead (``cluster.KNOWN_HARMLESS``).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

QUIET_LOGGERS = ("ray.data",)  # their INFO lines: how Ray Data runs a stage, not what the stage did
KNOWN_WARNINGS = re.compile(r"`ray_remote_args` is deprecated|reduce_op|Triton is not installed")


class _ToFile(logging.Filter):
    """On a console handler: a record under ``WARNING`` goes to ``sink`` instead."""

    def __init__(self, sink: Callable[[str], None]):
        super().__init__()
        self.sink = sink
        self.formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        try:
            self.sink(self.formatter.format(record))
        except Exception:  # a filter must never raise into the code that logged
            return True
        return False


def _console_handlers(name: str) -> list[logging.Handler]:
    return [h for h in logging.getLogger(name).handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


@contextmanager
def stage_log(path: str | Path, say: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Within: ``QUIET_LOGGERS``' records under WARNING and the ``KNOWN_WARNINGS`` go to ``path`` (appended), and
    the first of them makes ``say`` (default: print) tell where, once."""
    path = Path(path)
    said = []

    def sink(text: str) -> None:
        if not said:
            said.append(True)  # before saying it: a line said that comes back here (a captured print) is not news
            path.parent.mkdir(parents=True, exist_ok=True)
            (say or (lambda line: print(line, flush=True)))(
                f"[specdraft] third-party log lines of this stage (Ray Data, known warnings) go to {path}")
        with open(path, "a") as fh:
            fh.write(text.rstrip("\n") + "\n")

    quiet = _ToFile(sink)
    handlers = [h for name in QUIET_LOGGERS for h in _console_handlers(name)]
    for handler in handlers:
        handler.addFilter(quiet)
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if KNOWN_WARNINGS.search(str(message)):
            sink(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield path
    finally:
        warnings.showwarning = show
        for handler in handlers:
            handler.removeFilter(quiet)
