"""The served drift monitor: acceptance of the served draft read from vLLM's Prometheus
``/metrics``, since the last reading, against its value at promotion.

vLLM's OpenAI server publishes the speculative-decoding counters ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens`` and ``vllm:spec_decode_num_accepted_tokens`` (exposed with Prometheus'
``_total`` suffix, one sample per engine: summed here). They are cumulative from the server's start, so the
served acceptance over a period is the difference of two readings; a restart resets them, recognised by the
server's ``process_start_time_seconds`` changing or by a counter going down — then the new reading alone is
the period's. The served acceptance length is ``1 + accepted / drafts`` (vLLM's ``mean_acceptance_length``,
our tau's definition at the engine's K), the acceptance rate ``accepted / draft tokens``.

The last reading and the promotion-time value live in a small JSON state file (written whole). An alarm
is raised when the period's acceptance length falls more than ``max_drop`` (a share) below the promotion
value; with no promotion value yet, the first period with drafts becomes it. stdlib only: ``urllib``.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdraft import files
from specdraft.configs.fresh import MonitorSettings

PREFIX = "vllm:spec_decode_"
COUNTERS = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens", "num_accepted_tokens": "accepted"}
START = "process_start_time_seconds"


@dataclass(frozen=True, kw_only=True, slots=True)
class Reading:
    """vLLM's counters at one moment (summed over engines)."""

    drafts: float
    draft_tokens: float
    accepted: float
    started: float | None  # the server process's start time (None: not published)
    time: float  # when read (unix seconds)


def parse_metrics(text: str, read_at: float | None = None) -> Reading:
    """A ``Reading`` of a Prometheus text exposition; ``ValueError`` when it has no spec-decode counter (a
    server without a draft, or not vLLM)."""
    sums = dict.fromkeys(COUNTERS.values(), 0.0)
    found, started = False, None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        if name == START:
            started = float(value)
            continue
        if not name.startswith(PREFIX):
            continue
        key = name[len(PREFIX):].removesuffix("_total")
        if key in COUNTERS:  # (not the per-position vector, nor _created samples)
            sums[COUNTERS[key]] += float(value)
            found = True
    if not found:
        raise ValueError(f"no {PREFIX}{{num_drafts,num_draft_tokens,num_accepted_tokens}} counter: is it a vLLM "
                         "server with a draft (--speculative-config)?")
    return Reading(**sums, started=started, time=time.time() if read_at is None else read_at)


def read_metrics(url: str, timeout_s: float = 10.0) -> Reading:
    """Fetch and parse ``url`` (a vLLM server's ``/metrics``)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (a configured http(s) URL)
        return parse_metrics(response.read().decode())


def since(previous: Reading | None, current: Reading) -> tuple[dict[str, float], bool]:
    """(the counters' increase over the period, whether the server restarted in it). With no previous reading,
    or after a restart, the period is the current reading alone (everything since the server started)."""
    restarted = previous is not None and (
        (previous.started is not None and current.started is not None and current.started != previous.started)
        or any(getattr(current, k) < getattr(previous, k) for k in COUNTERS.values()))
    base = None if previous is None or restarted else previous
    return {k: getattr(current, k) - (getattr(base, k) if base else 0.0) for k in COUNTERS.values()}, restarted


def acceptance(period: dict[str, float]) -> tuple[float | None, float | None]:
    """(acceptance length 1 + accepted / drafts, acceptance rate accepted / draft tokens); None without drafts."""
    length = 1.0 + period["accepted"] / period["drafts"] if period["drafts"] > 0 else None
    rate = period["accepted"] / period["draft_tokens"] if period["draft_tokens"] > 0 else None
    return length, rate


def _load_state(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def record_promotion(state_path: str | Path, acceptance_length: float | None, version: int | None) -> None:
    """A draft was promoted: its promotion-time acceptance length (None: unknown, the next served period sets
    it). The last reading is kept: the server serves the old draft until it restarts."""
    path = Path(state_path)
    state = _load_state(path)
    state["promotion"] = {"acceptance_length": acceptance_length, "version": version, "time": time.time()}
    files.write_text(path, json.dumps(state, indent=2))


def observe(settings: MonitorSettings, state_path: str | Path, reading: Reading | None = None) -> dict[str, Any]:
    """Read the server (or take ``reading``), compare the period since the last reading with the promotion
    value, save the reading; returns the period's counters, acceptance, restart, baseline, drop, alarm and a
    one-line message."""
    path = Path(state_path)
    state = _load_state(path)
    current = reading or read_metrics(settings.metrics_url, settings.timeout_s)
    previous = Reading(**state["last"]) if state.get("last") else None
    period, restarted = since(previous, current)
    length, rate = acceptance(period)
    promotion = state.get("promotion") or {}
    baseline = promotion.get("acceptance_length")
    if baseline is None and length is not None:  # the first served period after a promotion sets the baseline
        baseline = length
        state["promotion"] = {**promotion, "acceptance_length": length, "time": current.time, "from": "served"}
    drop = (baseline - length) / baseline if baseline and length is not None else None
    alarm = drop is not None and drop > settings.max_drop
    if length is None:
        message = "served: no drafts since the last reading" + (" (the server restarted)" if restarted else "")
    else:
        message = (f"served acceptance length {length:.3f} (rate {rate:.3f}) over {period['drafts']:.0f} drafts"
                   f"{' since a restart' if restarted else ''}; at promotion {baseline:.3f}"
                   + (f": DROP {drop:.1%} > monitor.max_drop {settings.max_drop:.0%}" if alarm else
                      f" (drop {drop:.1%}, alarm above {settings.max_drop:.0%})"))
    state["last"] = asdict(current)
    files.write_text(path, json.dumps(state, indent=2))
    return {"period": period, "restarted": restarted, "acceptance_length": length, "acceptance_rate": rate,
            "baseline": baseline, "drop": drop, "alarm": alarm, "message": message}


def judge_drift(value: float, baseline: float, max_drop: float, *, measure: str, who: str) -> tuple[float, bool, str]:
    """The offline drift check's verdict (``monitor.offline``): ``who``'s ``measure`` on this window's held-out
    slice (``value``) against its value at promotion (``baseline``). Returns (the drop, a share of the baseline;
    whether it exceeds ``max_drop``; the message)."""
    drop = (baseline - value) / baseline if baseline else 0.0
    alarm = drop > max_drop
    message = (f"{who} on this window's held-out slice: {measure} {value:.3f}, at promotion {baseline:.3f} "
               f"({-drop:+.1%}" + (f": DROP > monitor.max_drop {max_drop:.0%})" if alarm else ")"))
    return drop, alarm, message
