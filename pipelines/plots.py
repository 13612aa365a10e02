"""Plots of a run, for the MLflow UI and the run report (``pipelines.report``): training curves per stage with
the stage boundaries marked (Beagle §4.2's two-stage schedule: the loss changes meaning where a stage starts),
acceptance per draft depth α_i and τ against the prompt-lookup floor (EAGLE §4 metrics), the champion gate
over the registered versions, and the offline drift series (the champion's τ on each
night's traffic window beside its value at promotion).

Each ``*_figure`` builds a matplotlib figure from plain data; ``save`` writes it (a path or a binary file
object) and closes it.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import IO, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from specdraft import jsonl  # noqa: E402


def save(fig: Figure, out: str | Path | IO[bytes], fmt: str = "png") -> str | Path | IO[bytes]:
    fig.savefig(out, dpi=100, format=fmt)
    plt.close(fig)
    return out


def read_training_metrics(metrics_jsonl: str | Path) -> list[dict[str, Any]]:
    """The rows of a training run's ``metrics.jsonl`` (params first, then every logged step), read by
    ``specdraft.jsonl.read_rows``; a line that is no JSON object (the last one of a run killed mid-write) is no
    point of a curve and is left out."""
    return [row for _, row in jsonl.read_rows(Path(metrics_jsonl).read_bytes()) if isinstance(row, dict)]


def stage_starts(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(stage, first step) of every stage after the first, from the metric rows' ``stage`` field."""
    starts: dict[int, int] = {}
    for r in rows:
        if r.get("kind") == "metrics" and "stage" in r:
            stage = int(r["stage"])
            starts[stage] = min(starts.get(stage, r["step"]), r["step"])
    return sorted((s, step) for s, step in starts.items() if s > 0)


def training_figure(rows: list[dict[str, Any]]) -> Figure:
    """Loss per optimizer step coloured by stage and held-out sim_tau per validation pass, a dashed line where
    each stage after the first starts (labelled with its kind when the params name it)."""
    steps = [r for r in rows if r.get("kind") == "metrics" and "loss" in r]
    vals = [r for r in rows if r.get("kind") == "metrics" and "sim_tau" in r]
    params = next((r for r in rows if r.get("kind") == "params"), {})
    kinds = str(params.get("train.stage_kinds", "")).split(",") if params.get("train.stage_kinds") else []
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for stage in sorted({int(r.get("stage", 0)) for r in steps}):
        pts = [(r["step"], r["loss"]) for r in steps if int(r.get("stage", 0)) == stage]
        label = f"stage {stage}" + (f" ({kinds[stage]})" if stage < len(kinds) else "")
        (line,) = a.plot([p[0] for p in pts], [p[1] for p in pts], linewidth=0.6, alpha=0.35)
        smooth = _moving_average([p[1] for p in pts], max(1, len(steps) // 40))  # the trend through the noise
        a.plot([p[0] for p in pts], smooth, color=line.get_color(), linewidth=1.6, label=label)
    b.plot([r["step"] for r in vals], [r["sim_tau"] for r in vals], marker="o", color="tab:green")
    for stage, step in stage_starts(rows):  # a new objective from here: its loss is not the previous stage's
        for ax in (a, b):
            ax.axvline(step, color="0.4", linestyle="--", linewidth=1)
            ax.annotate(f"stage {stage}", (step, 1), xycoords=("data", "axes fraction"), xytext=(3, -3),
                        textcoords="offset points", va="top", fontsize=7, color="0.3")
    a.set(xlabel="optimizer step", ylabel="training loss", title="training loss per stage")
    if steps and min(r["loss"] for r in steps) > 0:
        a.set_yscale("log")
    if steps:
        a.legend(fontsize=8, loc="lower left")
    b.set(xlabel="optimizer step", ylabel="sim_tau (held-out)", title="held-out simulated tau")
    fig.tight_layout()
    return fig


def alpha_figure(report: dict[str, Any]) -> Figure:
    """Bars of alpha_i (acceptance rate per draft depth) for each dataset of an eval report."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    names = list(report["datasets"])
    width = 0.8 / max(1, len(names))
    depths = 0
    for j, name in enumerate(names):
        alpha = [a if a is not None else 0.0 for a in report["datasets"][name]["alpha"]]  # None: never tried
        depths = max(depths, len(alpha))
        ax.bar([i + 1 + (j - (len(names) - 1) / 2) * width for i in range(len(alpha))], alpha, width=width,
               label=f"{name} (tau {report['datasets'][name]['tau'] or 0:.2f})")
    ax.set_xticks(range(1, depths + 1))
    ax.set(xlabel="draft depth i", ylabel="alpha_i", ylim=(0, 1), title="acceptance rate per draft depth")
    if names:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def floor_figure(names: list[str], taus: list[float | None], floors: list[float | None],
                 engines: list[float | None]) -> Figure:
    """Per dataset: the draft's tau beside the prompt-lookup floor (and the engine's acceptance when measured)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    series = [("draft tau", taus, "tab:blue"), ("prompt-lookup floor", floors, "0.6")]
    series += [("engine acceptance", engines, "tab:orange")] if any(e is not None for e in engines) else []
    width = 0.8 / len(series)
    for j, (label, values, color) in enumerate(series):
        xs = [i + j * width for i in range(len(names))]
        heights = [v or 0.0 for v in values]
        bars = ax.bar(xs, heights, width=width, label=label, color=color)
        ax.bar_label(bars, labels=["-" if v is None else f"{v:.2f}" for v in values], fontsize=8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(names))], names)
    top = max([v for _, values, _ in series for v in values if v is not None], default=1.0)
    ax.set(ylabel="accepted length (tokens per round)", title="tau against the floor", ylim=(0, 1.3 * top))
    ax.legend(fontsize=7, loc="upper center", ncols=len(series))
    fig.tight_layout()
    return fig


def history_figure(history: list[dict[str, Any]]) -> Figure:
    """The champion gate over the registered versions: each version's (the challenger's) mean tau — filled when
    it was promoted —, the champion's tau it met (none for the first) and the prompt-lookup floor of its
    evaluation."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    xs = list(range(len(history)))
    labels = [f"v{h['version']}\n{datetime.fromtimestamp(h['created'] / 1000):%m-%d %H:%M}" for h in history]
    ax.plot(xs, [_nan(h["mean_tau_pld"]) for h in history], linestyle=":", marker=".", color="0.5",
            label="prompt-lookup floor")
    for x, h in zip(xs, history):  # the challenger against the champion it met
        if h["champion_mean_tau"] is not None and h["mean_tau"] is not None:
            ax.plot([x, x], [h["champion_mean_tau"], h["mean_tau"]], color="tab:green" if h["promoted"] else "tab:red",
                    linewidth=1, alpha=0.6)
    ax.scatter(xs, [_nan(h["champion_mean_tau"]) for h in history], marker="_", s=400, color="0.2", zorder=3,
               label="the champion it met")
    promoted = [i for i, h in enumerate(history) if h["promoted"]]
    refused = [i for i, h in enumerate(history) if not h["promoted"]]
    ax.scatter(promoted, [_nan(history[i]["mean_tau"]) for i in promoted], color="tab:green", zorder=3,
               label="challenger, promoted")
    ax.scatter(refused, [_nan(history[i]["mean_tau"]) for i in refused], facecolors="none", edgecolors="tab:red",
               zorder=3, label="challenger, not promoted")
    for x, h in zip(xs, history):
        if h.get("champion") and h["mean_tau"] is not None:
            ax.annotate("champion now", (x, h["mean_tau"]), xytext=(0, 7), textcoords="offset points", ha="center",
                        fontsize=7, color="tab:green")
    ax.set_xlim(-0.5, len(history) - 0.5)
    ax.margins(y=0.15)  # room for the label
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set(ylabel="mean tau", title="champion against challenger, last registered versions")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def drift_figure(series: list[dict[str, Any]]) -> Figure:
    """The offline drift check night by night (``pipelines.freshness.drift_series``): the champion's tau on each
    night's window held-out slice — the serving engine's acceptance length too when measured —, its value at
    promotion as a dashed step, a red ring on a night that raised the alarm, the champion version on each point."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    xs = list(range(len(series)))
    labels = [(s["window_end"] or f"{datetime.fromtimestamp(s['start'] / 1000):%m-%d %H:%M}") for s in series]
    for key, base, colour, name in (("tau", "tau_at_promotion", "tab:blue", "tau"),
                                    ("engine", "engine_at_promotion", "tab:purple", "engine acceptance length")):
        if all(s.get(key) is None for s in series):
            continue
        ax.plot(xs, [_nan(s.get(key)) for s in series], marker="o", color=colour, label=f"champion {name} on the window")
        ax.step(xs, [_nan(s.get(base)) for s in series], where="mid", linestyle="--", color=colour, alpha=0.6,
                label=f"its {name} at promotion")
    alarms = [i for i, s in enumerate(series) if s["alarm"]]
    ax.scatter(alarms, [_nan(series[i]["engine"] if series[i].get("engine") is not None else series[i]["tau"])
                        for i in alarms], s=160, facecolors="none", edgecolors="tab:red", zorder=3,
               label="alarm (drop > monitor.max_drop)")
    for x, s in zip(xs, series):
        ax.annotate(f"v{s['champion_version']}", (x, s["tau"]), xytext=(0, 7), textcoords="offset points",
                    ha="center", fontsize=7)
    ax.set_xlim(-0.5, len(series) - 0.5)
    ax.margins(y=0.15)
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set(ylabel="tau on the night's window", title="offline drift: the champion on each night's traffic window")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def _moving_average(values: list[float], window: int) -> list[float]:
    """The mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def plot_alpha(report: dict, out: str | Path) -> Path:
    """``alpha_figure`` of an eval report, written to ``out``."""
    return Path(save(alpha_figure(report), out))


def plot_training(metrics_jsonl: str | Path, out: str | Path) -> Path:
    """``training_figure`` of a ``metrics.jsonl``, written to ``out``."""
    return Path(save(training_figure(read_training_metrics(metrics_jsonl)), out))
