"""The data-scaling curve of ``benchmarks/data_scaling.py`` (issue 40, Deliver 4): a line in log tokens, fitted by
least squares, and the training tokens it predicts for a speedup or an acceptance length.

A draft's acceptance and speedup rise with its training data, each doubling buying less ("EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test" reports its speedup growing with the
training data's scale); the simplest curve of that shape, and the one a handful of points can pin down, is a line in
the logarithm of the tokens: ``y ≈ a + b·log10(tokens)``. ``fit_log`` fits it; ``tokens_for`` inverts
it, saying whether the answer lies inside the measured sizes or is ``extrapolated`` beyond them (a prediction, not a
measurement); ``series_fits`` does both for each (data mode, recipe) series of a run, against vLLM's ``ngram``
speedup measured in the same run and 1.3× (``engine_sweep.TARGET_SPEEDUP``), and against the acceptance the cost
model says the draft needs for them. ``scaling_figure`` draws it (matplotlib, through ``pipelines.plots``).
Pure functions over numbers but the figure; importing it imports no torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median
from typing import Any

from specdraft.evaluation.engine_sweep import TARGET_SPEEDUP


def fit_log(points: list[tuple[float, float]]) -> dict[str, Any] | None:
    """``y = a + b·log10(tokens)`` by least squares over ``(tokens, y)`` points (``y`` None or ``tokens`` <= 0 left
    out); its coefficients, R², the points and the measured range; None with fewer than two distinct sizes."""
    rows = [(math.log10(t), y) for t, y in points if y is not None and t and t > 0]
    if len({x for x, _ in rows}) < 2:
        return None
    n = len(rows)
    mx, my = sum(x for x, _ in rows) / n, sum(y for _, y in rows) / n
    sxx = sum((x - mx) ** 2 for x, _ in rows)
    b = sum((x - mx) * (y - my) for x, y in rows) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in rows)
    ss_tot = sum((y - my) ** 2 for _, y in rows)
    return {"a": a, "b": b, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0, "points": n,
            "tokens_min": 10 ** min(x for x, _ in rows), "tokens_max": 10 ** max(x for x, _ in rows),
            "form": "y = a + b * log10(tokens)"}


def predict(fit: dict[str, Any], tokens: float) -> float:
    """The fitted ``y`` at ``tokens``."""
    return fit["a"] + fit["b"] * math.log10(tokens)


def tokens_for(fit: dict[str, Any] | None, y: float | None) -> dict[str, Any] | None:
    """The training tokens at which the fitted line reaches ``y``, and whether that lies outside the measured sizes
    (``extrapolated``); None without a fit or a ``y``; ``tokens`` None (and why) when the line does not rise with
    data (more data never reaches ``y`` on it)."""
    if fit is None or y is None:
        return None
    if fit["b"] <= 0:
        return {"y": y, "tokens": None, "extrapolated": None,
                "why": f"the fitted curve does not rise with data (slope {fit['b']:.4f} per decade)"}
    tokens = 10 ** ((y - fit["a"]) / fit["b"])
    inside = fit["tokens_min"] <= tokens <= fit["tokens_max"]
    return {"y": y, "tokens": round(tokens), "extrapolated": not inside}


def ngram_reference(engines: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """vLLM's ngram as the run measured it beside every size (one measurement per engine process): its best
    speedup and acceptance per size and their medians (the line the drafts are asked to beat)."""
    rows = {size: e["ngram"] for size, e in engines.items() if (e.get("ngram") or {}).get("speedup") is not None}
    if not rows:
        return None
    return {"per_size": rows, "speedup": median(r["speedup"] for r in rows.values()),
            "acceptance_length": median(r["acceptance_length"] for r in rows.values() if r["acceptance_length"])}


def series_fits(points: list[dict[str, Any]], ngram: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per ``mode/recipe`` series of served points (``tokens``, ``speedup``, ``acceptance_length``, ``cost``: the
    cost model at its best K): the speedup and acceptance fits and the tokens each predicts for ngram's speedup and
    for ``TARGET_SPEEDUP`` — by the speedup line directly, and by the acceptance line reaching the acceptance the
    cost model of the series' largest point says it needs for them."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(f"{p['mode']}/{p['recipe']}" for p in points):
        series = sorted((p for p in points if f"{p['mode']}/{p['recipe']}" == key), key=lambda p: p["tokens"])
        speed = fit_log([(p["tokens"], p["speedup"]) for p in series])
        accept = fit_log([(p["tokens"], p["acceptance_length"]) for p in series])
        cost = series[-1].get("cost") or {}
        need = {"target": (cost.get("for_target") or {}).get("tau"), "ngram": (cost.get("for_ngram") or {}).get("tau")}
        ngram_speedup = ngram["speedup"] if ngram else None
        out[key] = {
            "mode": series[0]["mode"], "recipe": series[0]["recipe"], "sizes": [p["tokens"] for p in series],
            "speedup_fit": speed, "acceptance_fit": accept,
            "tokens_for_speedup": {f"{TARGET_SPEEDUP}x": tokens_for(speed, TARGET_SPEEDUP),
                                   "ngram": tokens_for(speed, ngram_speedup)},
            "acceptance_needed": {**need, "at_k": cost.get("k"), "from_tokens": series[-1]["tokens"]},
            "tokens_for_acceptance": {f"{TARGET_SPEEDUP}x": tokens_for(accept, need["target"]),
                                      "ngram": tokens_for(accept, need["ngram"])},
        }
    return out


def describe(key: str, fits: dict[str, Any]) -> str:
    """One line: the tokens a series' speedup line reaches ngram's speedup and 1.3× at, extrapolated or not."""
    def say(r: dict[str, Any] | None, label: str) -> str:
        if r is None:
            return f"{label}: not fitted"
        if r["tokens"] is None:
            return f"{label}: never ({r['why']})"
        return f"{label} ({r['y']:.2f}x) at ~{r['tokens']:,} tokens" + (" (extrapolated)" if r["extrapolated"] else "")

    t = fits["tokens_for_speedup"]
    fit = fits["speedup_fit"]
    slope = (f"speedup {fit['a']:.3f} {'-' if fit['b'] < 0 else '+'} {abs(fit['b']):.3f}·log10(tokens), R² "
             f"{fit['r2']:.2f}" if fit
             else "speedup not fitted")
    return f"{key}: {slope}; {say(t['ngram'], 'ngram')}; {say(t[f'{TARGET_SPEEDUP}x'], str(TARGET_SPEEDUP) + 'x')}"


def scaling_figure(points: list[dict[str, Any]], fits: dict[str, dict[str, Any]], ngram: dict[str, Any] | None):
    """Acceptance and speedup against training tokens (log axis): each series' points and fitted line, vLLM's
    ngram per size and its median, and the 1.3× line."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, value, fit_key, title in ((axes[0], "acceptance_length", "acceptance_fit", "vLLM acceptance length"),
                                      (axes[1], "speedup", "speedup_fit", "vLLM speedup over no draft")):
        for key, f in fits.items():
            series = sorted((p for p in points if f"{p['mode']}/{p['recipe']}" == key), key=lambda p: p["tokens"])
            (line,) = ax.plot([p["tokens"] for p in series], [p[value] for p in series], "o", label=key)
            fit = f[fit_key]
            if fit is not None:
                xs = [fit["tokens_min"] * (fit["tokens_max"] / fit["tokens_min"]) ** (i / 20) for i in range(21)]
                ax.plot(xs, [predict(fit, x) for x in xs], "-", color=line.get_color(), linewidth=0.8)
        if ngram:
            per = sorted((float(s), r[value]) for s, r in ngram["per_size"].items() if r.get(value) is not None)
            ax.plot([s for s, _ in per], [v for _, v in per], "kx", label="vLLM ngram (same process)")
            ax.axhline(ngram[value], color="k", linestyle="--", linewidth=0.8)
        if value == "speedup":
            ax.axhline(TARGET_SPEEDUP, color="grey", linestyle=":", linewidth=0.8, label=f"{TARGET_SPEEDUP}x")
            ax.axhline(1.0, color="grey", linewidth=0.5)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decades only: the minor labels overlap
        ax.set_xlabel("training tokens")
        ax.set_title(title)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_plot(path: Path, points: list[dict[str, Any]], fits: dict[str, dict[str, Any]],
               ngram: dict[str, Any] | None) -> str:
    """The figure written to ``path``; what was done, as one line (matplotlib missing: said, nothing written)."""
    try:
        from pipelines.plots import save
    except ImportError as err:
        return f"no plot: matplotlib is not installed ({err}); the JSON holds every number"
    if not points:
        return "no plot: no point was served"
    path.parent.mkdir(parents=True, exist_ok=True)
    save(scaling_figure(points, fits, ngram), path)
    return f"plot: {path}"
