"""The one-page report of a ``regenerate-and-train`` run (docs/first-run.md, "The run report"): a self-contained HTML
file — the run summary's rows (``pipelines.summary``; the stages' rates beside their limits) and four plots embedded as PNG data — written to the
workdir and logged to the run's MLflow parent run as ``report.html``.

The plots (``pipelines.plots``): the training curves per stage with the stage boundaries marked (Beagle §4.2's
two-stage schedule), α per draft depth and τ against the prompt-lookup floor per eval set (the metrics of EAGLE
§4 beside the training-free floor), and the champion gate's decisions over the last registered versions (the
nightly challengers against the champion they met), and with ``monitor.offline`` the offline drift series (the
champion's tau on each night's traffic window beside its value at promotion, read from MLflow by the flow and
handed over as plain data). A part whose data is missing (a workdir moved away,
tracking off) says so in its place instead of a plot.
"""

from __future__ import annotations

import base64
import io
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

from pipelines import plots
from pipelines.summary import RunSummary
from specdraft import files

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px auto; max-width: 1040px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 22px 0 6px; border-bottom: 1px solid #ddd; }
.headline { font-size: 16px; margin: 0 0 12px; } .grid { display: flex; gap: 24px; flex-wrap: wrap; }
.grid > div { flex: 1 1 460px; } table { border-collapse: collapse; } td, th { padding: 2px 10px 2px 0; }
th { text-align: left; color: #555; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-size: 12px; background: #f4f4f4; padding: 1px 4px; word-break: break-all; }
.note { color: #7a4d00; margin: 6px 0; } .caption { color: #555; font-size: 12px; margin: 2px 0; }
.skipped { color: #888; } .missing { color: #888; font-style: italic; }
img { max-width: 100%; border: 1px solid #eee; } footer { color: #888; margin-top: 24px; font-size: 12px; }
"""


def _png(fig) -> str:
    """A figure as an ``<img>`` holding its PNG (the page needs no other file)."""
    buffer = io.BytesIO()
    plots.save(fig, buffer)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(fig.axes[0].get_title())}">'


def _num(x: float | None) -> str:
    return f'<td class="num">{"-" if x is None else f"{x:.2f}"}</td>'


def _stages(s: RunSummary) -> str:
    rows = "".join(
        f'<tr class="{st.status}"><td>{st.stage}</td><td>{st.status}</td>'
        f'<td class="num">{"-" if st.seconds is None else f"{st.seconds:.1f}"}</td>'
        f"<td>{escape(st.note or ('done by an earlier run' if st.status == 'skipped' else ''))}</td></tr>"
        for st in s.stages)
    return f"<table><tr><th>stage</th><th>status</th><th>seconds</th><th></th></tr>{rows}</table>"


def _rates(s: RunSummary) -> str:
    """Each throughput stage's tokens/s beside the limit the machine's matmul sets (``pipelines.rates``)."""
    if not s.rates:
        return ""
    head = "".join(f"<th>{h}</th>" for h in ["stage", "tokens", "wall s", "tokens/s", "limit tokens/s", "ratio",
                                             "load during it", "how the limit was computed"])
    rows = ""
    for line in s.rates:
        r, note = line.rate, f" ({escape(line.note)})" if line.note else ""
        if r is None:
            rows += f'<tr class="skipped"><td>{line.stage}{note}</td><td colspan="7">{escape(line.why)}</td></tr>'
            continue
        rows += (f"<tr><td>{line.stage}{note}</td><td class=\"num\">{r.tokens}</td>"
                 f"<td class=\"num\">{r.wall_s:.1f}</td><td class=\"num\">{r.tokens_per_s:.1f}</td>"
                 f"<td class=\"num\">{r.limit_tokens_per_s:.1f}</td>"
                 f"<td class=\"num\">{r.ratio:.3f}</td>{_num(r.load_1m)}<td>{escape(r.how)}</td></tr>")
    return (f"<h2>Stage rates</h2><table><tr>{head}</tr>{rows}</table><p class=\"caption\">limit: the matmul FLOP/s "
            "measured in this run over the stage's FLOPs per token; ratio: tokens/s over the limit.</p>")


def _datasets(s: RunSummary) -> str:
    engine = any(d.engine is not None for d in s.datasets)
    load = any(d.load is not None for d in s.datasets)
    head = "".join(f"<th>{h}</th>" for h in ["dataset", "tau", "floor (pld)", "tau/floor", "speedup"]
                   + (["load (1 min)"] if load else []) + (["engine", "engine speedup"] if engine else []))
    rows = "".join(f"<tr><td>{escape(d.dataset)}</td>{_num(d.tau)}{_num(d.floor)}{_num(d.tau_over_floor)}"
                   f"{_num(d.speedup)}{_num(d.load) if load else ''}"
                   f"{_num(d.engine) + _num(d.engine_speedup) if engine else ''}</tr>"
                   for d in s.datasets)
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in s.notes)
    return f"<table><tr>{head}</tr>{rows}</table>{notes}"


def _rows(rows: list[tuple[str, str]], code: set[str]) -> str:
    body = "".join(f"<tr><th>{escape(label)}</th>"
                   f"<td>{f'<code>{escape(text)}</code>' if label in code else escape(text)}</td></tr>"
                   for label, text in rows)
    return f"<table>{body}</table>"


def _plot_or_note(build, missing: str) -> str:
    return build() if missing == "" else f'<p class="missing">{escape(missing)}</p>'


def _page(s: RunSummary, generated: datetime | None, body: str) -> str:
    """A report page: the run's name and headline, ``body``, and when it was generated."""
    when = (generated or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>specdraft run {escape(s.name)}</title><style>{STYLE}</style></head>
<body>
<h1>specdraft run '{escape(s.name)}'</h1>
<p class="headline">{escape(s.headline)}</p>
{body}
<footer>generated {when} by specdraft</footer>
</body></html>
"""


def _versions_and_drift(history: list[dict[str, Any]], drift: list[dict[str, Any]] | None) -> tuple[str, str]:
    """The registered versions' plot and the offline drift part (empty when ``monitor.offline`` is off)."""
    gate = _plot_or_note(lambda: _png(plots.history_figure(history)),
                         "" if history else "no registered versions (tracking disabled, or none registered yet)")
    offline = "" if drift is None else "<h2>Offline drift</h2>" + _plot_or_note(
        lambda: _png(plots.drift_figure(drift)),
        "" if drift else "no offline drift measured yet (no champion before this night, or tracking disabled)")
    return gate, offline


def render_report(s: RunSummary, *, training: list[dict[str, Any]], eval_report: dict[str, Any] | None,
                  history: list[dict[str, Any]], drift: list[dict[str, Any]] | None = None,
                  generated: datetime | None = None) -> str:
    """The report page: ``training`` the rows of the train stage's ``metrics.jsonl`` (``[]``: none), ``eval_report``
    the eval stage's report, ``history`` ``pipelines.registry.version_history`` (``[]``: no registry), ``drift``
    the offline drift series (``pipelines.freshness.drift_series``; None: ``monitor.offline`` is off, no part)."""
    register = [("register", s.decision), ("champion", s.champion), ("exports", s.exports)]
    register += [(f"serve ({engine})", command) for engine, command in sorted(s.serve.items())]
    register += list(s.fresh)  # the traffic window, the served monitor, the gate's comparisons, the hand-off
    curves = _plot_or_note(lambda: _png(plots.training_figure(training)),
                           "" if training else "no training metrics (metrics.jsonl not found)")
    alpha = _plot_or_note(lambda: _png(plots.alpha_figure(eval_report)),
                          "" if eval_report else "no eval report (report.json not found)")
    floor = _plot_or_note(lambda: _png(plots.floor_figure([d.dataset for d in s.datasets], [d.tau for d in s.datasets],
                                                          [d.floor for d in s.datasets],
                                                          [d.engine for d in s.datasets])),
                          "" if s.datasets else "no eval set has a tau")
    gate, offline = _versions_and_drift(history, drift)
    return _page(s, generated, f"""<div class="grid"><div><h2>Stages</h2>{_stages(s)}</div><div><h2>Eval sets</h2>{_datasets(s)}</div></div>
{_rates(s)}
<h2>Champion gate</h2>{_rows(register, {label for label, _ in register if label.startswith("serve")})}
<h2>Where the results are</h2>{_rows(s.where(), {"workdir", "report", "browse", "open"})}
<h2>Training curves</h2>{curves}
<p class="caption">A dashed line marks where a training stage starts: a new objective, whose loss is not
comparable with the previous stage's (a jump there is expected).</p>
<div class="grid"><div><h2>Acceptance per draft depth</h2>{alpha}</div>
<div><h2>tau against the floor</h2>{floor}</div></div>
<h2>Champion against challenger</h2>{gate}
{offline}""")


def render_skipped_report(s: RunSummary, decisions: list[tuple[str, str]], *, history: list[dict[str, Any]],
                          drift: list[dict[str, Any]] | None, generated: datetime | None = None) -> str:
    """The report page of a night that did not train (``retrain.policy=when_it_pays``): its decisions (the traffic
    window, the monitors, why it did not train), the registered versions and the offline drift series."""
    gate, offline = _versions_and_drift(history, drift)
    return _page(s, generated, f"""<h2>This night's decisions</h2>{_rows(decisions, set())}
<h2>Where the results are</h2>{_rows(s.where(), {"workdir", "report", "browse", "open"})}
<h2>Registered versions</h2>{gate}
{offline}""")


def write_run_report(out: str | Path, s: RunSummary, *, metrics_file: str, eval_report: dict[str, Any] | None,
                 history: list[dict[str, Any]], drift: list[dict[str, Any]] | None = None) -> Path:
    """``render_report`` written to ``out`` (whole: a temporary name, then renamed)."""
    training = plots.read_training_metrics(metrics_file) if metrics_file and Path(metrics_file).is_file() else []
    return files.write_text(out, render_report(s, training=training, eval_report=eval_report, history=history,
                                               drift=drift))
