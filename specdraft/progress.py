"""Progress lines of long stages: how far, how fast, how long still — one format for every loop.

Training prints one every ``log_every`` steps (``pipelines/train.py``); evaluation — ours
(``specdraft.evaluation.run`` / ``replicas``, ``pipelines/evaluate.py``) and the engine's
(``specdraft.evaluation.engine_process``, ``engine_comparison``) — through ``ProgressLines``, at the first
item, the last, and at most every ``every_s`` seconds between, so no stage is silent for more than a minute
while it still moves:

    [specdraft] step 20/300 stage 0 loss 4.1234 tok/s 5321 eta 412s
    [specdraft] eval 12/80 questions tok/s 31 eta 1530s

The ETA is the elapsed time scaled by what is left (``eta_s``): a stage's own average rate, no smoothing.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def eta_s(done: float, total: float, elapsed_s: float) -> float:
    """Seconds left at the average rate so far (``done`` of ``total`` in ``elapsed_s``)."""
    fraction = done / max(1, total)
    return elapsed_s / max(fraction, 1e-9) * (1 - fraction)


def progress_line(label: str, done: int, total: int, elapsed_s: float, tokens_per_s: float, detail: str = "") -> str:
    """``[specdraft] {label} {done}/{total} {detail} tok/s N eta Ns``."""
    middle = f" {detail}" if detail else ""
    return (f"[specdraft] {label} {done}/{total}{middle} tok/s {tokens_per_s:.0f} "
            f"eta {eta_s(done, total, elapsed_s):.0f}s")


class ProgressLines:
    """Counts items (and the tokens they made) and prints ``progress_line`` at the first item, the last, and
    whenever ``every_s`` seconds passed since the line before; nothing when ``enabled`` is false."""

    def __init__(self, label: str, total: int, unit: str, every_s: float = 30.0, enabled: bool = True,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.perf_counter):
        self.label, self.total, self.unit, self.every_s, self.enabled = label, total, unit, every_s, enabled
        self.stream, self.clock = stream, clock
        self.started = clock()
        self.printed: float | None = None  # when the last line was printed
        self.done = 0
        self.tokens = 0

    def update(self, items: int = 1, tokens: int = 0) -> None:
        self.done += items
        self.tokens += tokens
        now = self.clock()
        due = self.printed is None or now - self.printed >= self.every_s or self.done >= self.total
        if self.enabled and due:
            self.printed = now
            elapsed = now - self.started
            line = progress_line(self.label, self.done, self.total, elapsed, self.tokens / max(elapsed, 1e-9),
                                 self.unit)
            print(line, file=self.stream or sys.stdout, flush=True)
