"""Host measurements for the benchmarks: resident memory of this process and the host's load.

Wall-clock numbers depend on what else the host runs, so the benchmarks sample the load average
while they run and record it; memory is the process's resident set from ``/proc/self/status``
(VmRSS now, VmHWM the high-water mark, resettable through ``/proc/self/clear_refs`` on Linux).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Self


def status_kb(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (VmRSS, VmHWM), None where unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float | None:
    kb = status_kb("VmRSS")
    return None if kb is None else round(kb / 1024, 1)


def peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM; ``getrusage`` maxrss where /proc is missing)."""
    kb = status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    return round(kb / 1024, 1)


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux ``clear_refs`` 5); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class LoadSampler:
    """Samples the host's 1-minute load average every ``every`` seconds in a thread."""

    def __init__(self, every: float = 2.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> Self:
        self.start = os.getloadavg()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = os.getloadavg()

    def summary(self) -> dict[str, Any]:
        s = self.samples or [float("nan")]
        return {
            "cpus": os.cpu_count(),
            "load_1m_min": round(min(s), 2), "load_1m_mean": round(sum(s) / len(s), 2), "load_1m_max": round(max(s), 2),
            "loadavg_start": [round(x, 2) for x in self.start],
            "loadavg_end": [round(x, 2) for x in getattr(self, "end", None) or os.getloadavg()],  # now, while running
            "samples": len(self.samples), "sample_every_s": self.every,
            "note": "includes this benchmark's own process (about 1 with --threads 1)",
        }
