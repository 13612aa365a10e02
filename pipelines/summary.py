"""The run summary of ``regenerate-and-train``: what happened and where, readable in ten seconds
(docs/commands.md, ``specdraft run``; docs/operations.md "The nightly deployment").

Built from the stage records the flow returns (``pipelines.records``, as dicts) and the eval report,
so ``specdraft run`` prints and the flow-run log holds the same text (the flow renders it once). It says:
* each stage done or skipped and its time — a skipped stage shows no seconds: the time in its ``DONE``
  file is the earlier run's, not this one's; and which Ray node ran which part of it (``placement_rows``);
* regenerate's, the dump's and training's tokens/s beside the limit the machine's matmul sets and their ratio,
  with the load during the stage and how the limit was computed (``pipelines.rates``; a skipped stage: no rate);
* τ per eval set beside the prompt-lookup floor τ_pld ("Evaluation and the prompt-lookup floor"), the
  serving engine's acceptance length and its speedup when they were measured (``Evaluated.engine_tau``,
  ``engine_speedup``: its tokens/s with the draft over its own without; a gap to our decoder at the engine's K
  above ``eval.settings.engine.max_gap`` a warning), and the speedup over plain decoding — one below 1 explained by what a
  speculative round cost in plain decoding steps (τ / speedup, measured);
* the champion gate's decision and reason, the champion version, the exports and serve commands;
* where the results are: the workdir, the HTML report, the MLflow run, its tracking URI and the
  ``mlflow ui`` command that shows it.

``RunSummary`` holds the rows; ``render_text`` prints them and ``pipelines.report`` lays the same rows out
as HTML.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.rates import RateLine, rate_lines, rate_text
from pipelines.records import Dumped, Evaluated, Prepared, Regenerated, Registered, Trained
from specdraft.evaluation.engine_sweep import sweep_note

MLFLOW_UI = "http://127.0.0.1:5000"  # where ``mlflow ui`` serves by default
WIDTH = 110  # columns of the text summary's prose
ONE_LINE = ("restart", "rollback", "rejects")  # fresh rows printed unwrapped: a command or a path


@dataclass(frozen=True, kw_only=True, slots=True)
class Place:
    """Where a run's results are: its workdir, its report and (tracking on) its MLflow run."""

    workdir: str  # absolute
    report: str = ""  # the HTML report in the workdir ("": none was written)
    report_error: str = ""  # why it was not
    tracking_uri: str | None = None  # None: tracking disabled
    experiment_id: str | None = None
    run_id: str | None = None  # the flow's parent run


@dataclass(frozen=True, kw_only=True, slots=True)
class StageLine:
    stage: str
    status: str  # "done", "skipped" (finished by an earlier run) or "off"
    seconds: float | None  # this run's time; None when skipped or off
    note: str = ""  # the prompt file of a per-file stage, why a stage is off


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetLine:
    dataset: str
    tau: float | None
    floor: float | None  # the prompt-lookup floor tau_pld (None: not measured)
    speedup: float | None  # tokens/s with the draft over plain decoding (our decoder, this machine)
    load: float | None = None  # the machine's 1-minute load average while the speedup was measured
    engine: float | None = None  # the serving engine's acceptance length (None: not measured)
    engine_speedup: float | None = None  # its tokens/s with the draft over without it (None: not measured)

    @property
    def tau_over_floor(self) -> float | None:
        return self.tau / self.floor if self.tau is not None and self.floor else None

    @property
    def round_cost(self) -> float | None:
        """What one speculative round (draft + verify) cost, in plain decoding steps: τ / speedup."""
        return self.tau / self.speedup if self.tau is not None and self.speedup else None


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    name: str
    headline: str  # one line: the outcome
    stages: list[StageLine]
    datasets: list[DatasetLine]
    notes: list[str]  # a speedup below 1 explained, engine gaps, a stage without tau
    decision: str  # the register row
    champion: str
    exports: str
    serve: dict[str, str] = field(default_factory=dict)  # engine -> command serving the champion
    place: Place
    fresh: list[tuple[str, str]] = field(default_factory=list)  # (label, text): traffic window, monitor, gate, hand-off
    rates: list[RateLine] = field(default_factory=list)  # regenerate, features, train: rate beside the limit
    placement: list[tuple[str, str]] = field(default_factory=list)  # (stage, which node ran which part)

    def where(self) -> list[tuple[str, str]]:
        """(label, text) rows saying where the results are."""
        p = self.place
        rows = [("workdir", p.workdir)]
        if p.report:
            rows.append(("report", p.report + (" (also the MLflow run's artifact report.html)" if p.run_id else "")))
        elif p.report_error:
            rows.append(("report", f"not written: {p.report_error}"))
        if p.tracking_uri is None:
            rows.append(("mlflow", "tracking disabled (tracking.enabled=false): nothing logged, nothing registered"))
            return rows
        rows.append(("mlflow", f"run {p.run_id} (experiment {p.experiment_id}) at {p.tracking_uri}"))
        if p.tracking_uri.startswith(("http://", "https://")):  # a tracking server: its own UI
            rows.append(("open", f"{p.tracking_uri.rstrip('/')}/#/experiments/{p.experiment_id}/runs/{p.run_id}"))
        else:
            rows.append(("browse", f"mlflow ui --backend-store-uri {shlex.quote(p.tracking_uri)}"))
            rows.append(("open", f"{MLFLOW_UI}/#/experiments/{p.experiment_id}/runs/{p.run_id}"))
        return rows


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def stage_lines(result: dict[str, Any]) -> list[StageLine]:
    """One line per stage (per prompt file for regenerate and features), in flow order."""

    def line(stage: str, record, note: str = "") -> StageLine:
        skipped = getattr(record, "skipped", False)
        return StageLine(stage=stage, status="skipped" if skipped else "done",
                         seconds=None if skipped else record.wall_s, note=note)

    lines = [line("prepare", Prepared.from_dict(result["prepare"]))]
    for r in map(Regenerated.from_dict, result["regenerate"]):
        lines.append(line("regenerate", r, r.prompt.rsplit("/", 1)[-1] + mode_note(r.summary)))
    dumped = [Dumped.from_dict(d) for d in result["features"]]
    for d, r in zip(dumped, result["regenerate"]):
        lines.append(line("features", d, r["prompt"].rsplit("/", 1)[-1]))
    if not dumped:
        lines.append(StageLine(stage="features", status="off", seconds=None,
                               note="online features: the target ran inside training"))
    lines.append(line("train", Trained.from_dict(result["train"])))
    lines.append(line("eval", Evaluated.from_dict(result["eval"])))
    registered = Registered.from_dict(result["register"])
    lines.append(StageLine(stage="register", status="done" if registered.registered else "off",
                           seconds=registered.wall_s if registered.registered else None,
                           note="" if registered.registered else registered.reason))
    return lines


def _on_nodes(nodes: list[dict[str, Any]]) -> str:
    """``pipelines.nodes.by_node``'s entries as text: each node's id (short), address and parts."""
    def parts(entry: dict[str, Any]) -> str:
        return ", ".join(f"{unit} {', '.join(map(str, v))}" if isinstance(v, list) else f"{v} {unit}"
                         for unit, v in entry.items() if unit not in ("node", "ip"))
    return "; ".join(f"{n['node'][:12]} ({n['ip']}) {parts(n)}" for n in nodes)


def placement_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(stage, text): which Ray node ran which part of each distributed stage, from the records (the
    ``nodes`` of a summary or record, ``pipelines.nodes``); a stage that recorded none (not run on Ray, or
    finished by an earlier run before nodes were recorded) has no row; a skipped stage's is the earlier run's."""
    rows = []
    for r in map(Regenerated.from_dict, result["regenerate"]):
        if r.summary.get("nodes"):
            rows.append(("regenerate", f"{r.prompt.rsplit('/', 1)[-1]}: {_on_nodes(r.summary['nodes'])}"))
    for d, r in zip(map(Dumped.from_dict, result["features"]), result["regenerate"]):
        if d.summary.get("nodes"):
            rows.append(("features", f"{r['prompt'].rsplit('/', 1)[-1]}: {_on_nodes(d.summary['nodes'])}"))
    for stage, record in (("train", Trained.from_dict(result["train"])), ("eval", Evaluated.from_dict(result["eval"]))):
        if record.nodes:
            rows.append((stage, _on_nodes(record.nodes) + (" (an earlier run)" if record.skipped else "")))
    return rows


def mode_note(summary: dict[str, Any]) -> str:
    """What a shipped / mixed regenerate did with the rows (nothing in target mode, as before the modes)."""
    if summary.get("mode", "target") == "target":
        return ""
    return (f" ({summary['mode']}: {summary['rows_regenerated']} regenerated, {summary['rows_shipped']} as shipped, "
            f"{summary['rows_no_answer']} with no answer)")


def dataset_lines(evaluated: Evaluated, report: dict[str, Any] | None) -> list[DatasetLine]:
    """τ, floor, speedup (from the eval report) and the engine's acceptance and speedup per eval set."""
    datasets = (report or {}).get("datasets", {})
    names = list(dict.fromkeys([*datasets, *evaluated.tau]))
    return [DatasetLine(dataset=name, tau=evaluated.tau.get(name, datasets.get(name, {}).get("tau")),
                        floor=evaluated.tau_pld.get(name, datasets.get(name, {}).get("tau_pld")),
                        speedup=datasets.get(name, {}).get("speedup"), load=datasets.get(name, {}).get("load_1m"),
                        engine=evaluated.engine_tau.get(name), engine_speedup=evaluated.engine_speedup.get(name))
            for name in names]


def notes(datasets: list[DatasetLine], engine_warnings: list[str] | None = None,
          sweep: dict[str, Any] | None = None) -> list[str]:
    """What a bare number would hide: a speedup below 1 (why), an engine that accepts other than we measured
    (``engine_warnings``: the engine report's gaps above ``eval.settings.engine.max_gap``, our decoder counted
    at the engine's K on the engine's prompts), and the engine's fastest K with the draft's cost model (``sweep``:
    the eval report's ``engine.sweep``; ``specdraft.evaluation.engine_sweep``)."""
    out = [sweep_note(sweep)] if sweep else []
    for d in datasets:
        if d.tau is None:
            out.append(f"{d.dataset}: no tau (no speculative round ran: are the questions empty?)")
        if d.speedup is not None and d.speedup < 1 and d.round_cost is not None:
            out.append(
                f"speedup {d.speedup:.2f} < 1 on {d.dataset}: one speculative round (draft + verify) took as long as "
                f"{d.round_cost:.1f} plain decoding steps and yielded {d.tau:.2f} tokens. On a small target, and on "
                "CPU above all, a draft step costs about as much as a target step, so speculation is slower than "
                "plain decoding there; it pays off where the target's forward dominates (a large target on a GPU). "
                "tau is what carries over to serving, and what the champion gate compares.")
    out += [f"warning: {w}: the served draft does not behave as evaluated here" for w in engine_warnings or []]
    return out


def _register_rows(r: Registered) -> tuple[str, str, str, str]:
    """(headline, decision, champion, exports) of the register record."""
    if not r.registered:
        return "not registered", f"not registered: {r.reason}", "-", "-"
    recipe = f" (recipe {r.recipe})" if r.recipe else ""
    if r.reason.startswith("already registered"):
        decision = (f"{r.model_name} v{r.version}{recipe} was registered by an earlier run (same trained draft); "
                    f"nothing new to compare")
        headline = f"nothing new: v{r.version} already registered"
    else:
        verdict = f"promoted to {r.alias}" if r.promoted else "not promoted"
        decision = f"{r.model_name} v{r.version}{recipe}: {verdict} ({r.reason})"
        headline = f"v{r.version} {verdict}"
    held = f" (recipe {r.champion_recipe})" if r.champion_recipe else ""
    champion = (f"v{r.serving_champion}{held} holds '{r.alias}' of {r.model_name}" if r.serving_champion is not None
                else f"none: no version of {r.model_name} holds '{r.alias}' yet")
    exports = (", ".join(f"{fmt} {path}" for fmt, path in sorted(r.exports.items())) if r.exports
               else f"none ({r.export_note or 'no serving format fits this draft'})")
    return headline, decision, champion, exports


def _replay_days_read(c: dict[str, int]) -> str:
    """How many of the rows read were on the replay days (before the window), when any were."""
    earlier = c.get("read_replay_days", 0)
    return f" ({c['read'] - earlier} in the window, {earlier} on the earlier days replay draws from)" if earlier else ""


def _reasons(counts: dict[str, int]) -> str:
    """The window's rejects by reason (``rejected.<reason>`` counts), in words: `` (bad_json 2, not_utf8 1)``."""
    said = [f"{k[len('rejected.'):]} {n}" for k, n in sorted(counts.items()) if k.startswith("rejected.")]
    return f" ({', '.join(said)})" if said else ""


def traffic_rows(prepared: dict[str, Any]) -> list[tuple[str, str]]:
    """The traffic window's counts and warnings (``data.traffic``; none when off): ``prepared`` is the prepare
    stage's record as a dict, its ``traffic`` a ``TrafficRecord``'s."""
    from specdraft.freshness.record import TrafficRecord

    if not prepared.get("traffic"):
        return []
    traffic = TrafficRecord.from_dict(prepared["traffic"])
    c, days = traffic.counts, traffic.days
    other = (f" ({c['other_model_answers']} with another model's logged answer, which regenerate.mode "
             "shipped/mixed keeps as it shipped)" if "other_model_answers" in c else "")
    rows = [("traffic", f"window {days[-1] if days else '-'}..{days[0] if days else '-'} ({len(days)} days): "
                        f"{c['read']} rows read{_replay_days_read(c)}, {c['rejected']} rejected{_reasons(c)}, {c['deduplicated']} deduplicated, "
                        f"{c['over_cap']} over the cap, {c['held_out']} held out; {c['to_regenerate']} to regenerate{other}, "
                        f"{c['reused'] + c['replay_reused']} reused as logged (not regenerated), {c['replayed']} "
                        f"replayed from {len(traffic.replay_days)} earlier days ({c['dropped_replay']} not drawn"
                        + (f", {c['replay_held_out']} held out in their own window" if c.get("replay_held_out") else "")
                        + ")")]
    if traffic.regression is not None:  # gate.enabled: the earlier windows' held-out slices
        from specdraft.freshness.gate import describe_regression_set

        rows.append(("gate", describe_regression_set(traffic.regression, traffic.regression.eval_sets)))
    rows += [("warning", w) for w in traffic.warnings]
    if c["rejected"]:
        rows.append(("rejects", traffic.files.rejects))
    return rows


def _read(path: Path | None) -> dict[str, Any]:
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def warm_rows(train_dir: Path | None) -> list[tuple[str, str]]:
    """The warm line: where the run started from (``draft_vocab.json``: the vocabulary kept, or why not) and the
    schedule it trained (``schedule.json``: epochs per stage, warm or fresh, and why); none for a fresh run that
    was not asked to warm-start."""
    vocab = _read(train_dir / "draft_vocab.json" if train_dir else None)
    schedule = _read(train_dir / "schedule.json" if train_dir else None)
    said = (f"; schedule: epochs {schedule['epochs']} over {', '.join(schedule['stages'])} ({schedule['why']})"
            if schedule else "")
    if vocab.get("init_from"):
        return [("warm", f"started from {vocab['init_from']}: its weights and draft vocabulary kept ({vocab['size']} "
                         f"tokens, covering {vocab['coverage']:.1%} of the new predicted tokens){said}")]
    if vocab.get("warm_start_fallback"):
        return [("warm", f"no warm start: {vocab['warm_start_fallback']}{said}")]
    if schedule.get("start") == "warm":  # a draft over the target's vocabulary: only the weights to keep
        return [("warm", f"started from {schedule.get('init_from', 'train.init_from')}: its weights kept{said}")]
    return []


def vocab_rows(train_dir: Path | None) -> list[tuple[str, str]]:
    """The vocab line of a run that chose a fresh draft vocabulary (``draft_vocab.json``): its size and the share of
    the training data's predicted tokens it covers (a kept one is the warm line's); none for a draft over the
    target's whole vocabulary."""
    vocab = _read(train_dir / "draft_vocab.json" if train_dir else None)
    if not vocab or vocab.get("init_from"):
        return []
    of = f" of {vocab['vocab_size']}" if vocab.get("vocab_size") else ""
    return [("vocab", f"draft vocabulary: {vocab['size']}{of} target tokens (train.draft_vocab_size), covering "
                      f"{vocab['coverage']:.1%} of the {vocab['counted_tokens']} predicted tokens of the training data")]


def fresh_rows(result: dict[str, Any], registered: Registered | None) -> list[tuple[str, str]]:
    """The traffic window, the served monitor (an alarm first), the gate's comparisons and the hand-off."""
    rows = traffic_rows(result["prepare"])
    served = result.get("monitor") or {}
    if served.get("error"):
        rows.append(("monitor", f"warning: {served['error']}"))
    elif served:
        rows.append(("ALARM" if served["alarm"] else "monitor", served["message"]))
    drift = result.get("drift") or {}
    if drift:
        rows.append(("ALARM" if drift["alarm"] else "drift", drift["message"]))
    retrain = result.get("retrain") or {}
    if retrain and retrain["reason"] != "retrain.policy=always":
        rows.append(("retrain", retrain["reason"]))
    if registered is None:  # a night that did not train: the champion handed off from the registry, or not
        handoff = result.get("handoff") or {}
        return rows + handoff_rows(handoff.get("version"), handoff.get("handoff", ""), handoff.get("restart", ""),
                                   handoff.get("served_note", ""))
    if result.get("warm"):  # train.init_from=champion and the champion could not be loaded
        rows.append(("warm", f"warning: {result['warm']}"))
    train_dir = Path(result["train"]["draft"]).parent if result.get("train") else None
    rows += vocab_rows(train_dir) + warm_rows(train_dir)
    for c in (registered.gate or {}).get("comparisons", []):
        values = (f"candidate {_f(c['candidate'], 4)} vs champion {_f(c['champion'], 4)}"
                  + (f" ({c['change']:+.1%}, bound {c['bound']:+.1%})" if c["change"] is not None else ""))
        rows.append(("gate", f"{c['slice']}: {values}: {'pass' if c['passed'] else 'FAIL'}"
                             + (f" ({c['note']})" if c["note"] else "")))
    version = registered.version if registered.served_version is None else registered.served_version
    return rows + handoff_rows(version, registered.handoff, registered.restart, registered.served_note)


def handoff_rows(version: int | None, handoff: str, restart: str, served_note: str) -> list[tuple[str, str]]:
    """The hand-off (``version`` now at ``handoff``: <exports>/current; "" when none) and, when the served draft
    is not the champion, why — never silent (``pipelines.freshness.settle_handoff``)."""
    rows = []
    if handoff:
        rows += [("handoff", f"v{version} is {handoff} (the one before it: previous/)"),
                 ("rollback", f"specdraft rollback --exports {handoff.rsplit('/', 1)[0]}"), ("restart", restart)]
    if served_note:
        rows.append(("served", f"warning: {served_note}"))
    return rows


def summarize_run(name: str, result: dict[str, Any], place: Place, report: dict[str, Any] | None) -> RunSummary:
    """The summary of one flow run: ``result`` the flow's stage records (``to_dict()``), ``report`` the eval
    report (``report.json``; None when it is not readable: no speedups)."""
    evaluated = Evaluated.from_dict(result["eval"])
    registered = Registered.from_dict(result["register"])
    datasets = dataset_lines(evaluated, report)
    headline, decision, champion, exports = _register_rows(registered)
    tau = f"mean tau {_f(evaluated.mean_tau)}" + (f" vs floor {_f(evaluated.mean_tau_pld)}"
                                                  if evaluated.mean_tau_pld is not None else "")
    if (result.get("monitor") or {}).get("alarm"):
        headline += "; ALARM: served acceptance dropped"
    if (result.get("drift") or {}).get("alarm"):
        headline += "; ALARM: the champion's tau on the new window dropped"
    return RunSummary(name=name, headline=f"{tau}; {headline}", stages=stage_lines(result), datasets=datasets,
                      notes=notes(datasets, evaluated.engine_warnings,
                                  ((report or {}).get("engine") or {}).get("sweep")),
                      decision=decision, champion=champion, exports=exports,
                      serve=dict(registered.serve), place=place, fresh=fresh_rows(result, registered),
                      rates=rate_lines(result), placement=placement_rows(result))


def render_text(s: RunSummary) -> str:
    """The summary as plain text: prose wrapped at ``WIDTH`` columns; paths, URIs and commands on one line each
    (to copy)."""
    out = [f"== specdraft run '{s.name}': {s.headline} ==", "", f"{'stage':<12} {'status':<8} {'seconds':>8}"]
    for st in s.stages:
        seconds = f"{st.seconds:8.1f}" if st.seconds is not None else f"{'-':>8}"
        note = st.note or ("done by an earlier run with the same inputs" if st.status == "skipped" else "")
        out.append(f"{st.stage:<12} {st.status:<8} {seconds}  {note}".rstrip())
    out += rate_text(s.rates, WIDTH)
    if s.placement:
        out += ["", "placement (the Ray node that ran each part: id, address, parts)"]
        out += [textwrap.fill(text, WIDTH, initial_indent=f"{stage:<12} ", subsequent_indent=" " * 13)
                for stage, text in s.placement]
    engine = any(d.engine is not None for d in s.datasets)
    load = any(d.load is not None for d in s.datasets)
    out += ["", f"{'dataset':<20} {'tau':>6} {'floor':>6} {'tau/floor':>9} {'speedup':>8}"
            + (f" {'load':>5}" if load else "") + (f" {'engine':>7} {'engine x':>8}" if engine else "")
            + "   (floor: prompt-lookup tau_pld" + ("; load: the 1-minute load average while the speedup was measured"
                                                    if load else "")
            + ("; engine: the serving engine's acceptance length, engine x: its speedup)" if engine else ")")]
    for d in s.datasets:
        out.append(f"{d.dataset:<20} {_f(d.tau):>6} {_f(d.floor):>6} {_f(d.tau_over_floor):>9} {_f(d.speedup):>8}"
                   + (f" {_f(d.load):>5}" if load else "")
                   + (f" {_f(d.engine):>7} {_f(d.engine_speedup):>8}" if engine else ""))
    out += [textwrap.fill(n, WIDTH, initial_indent="note: ", subsequent_indent="      ") for n in s.notes]
    out += [""] + [textwrap.fill(text, WIDTH, initial_indent=f"{label:<9} ", subsequent_indent=" " * 10)
                   for label, text in [("register", s.decision), ("champion", s.champion), ("exports", s.exports)]]
    for engine_name, command in sorted(s.serve.items()):
        out.append(f"{'serve':<9} {engine_name}: {command}")
    if not s.serve and "holds" in s.champion:
        out.append(f"{'serve':<9} the champion has no exported serving format")
    out += fresh_lines(s.fresh)
    out.append("")
    out += [f"{label:<9} {text}" for label, text in s.where()]
    return "\n".join(out)


def fresh_lines(rows: list[tuple[str, str]]) -> list[str]:
    """The fresh rows as text: commands and paths (``ONE_LINE``) on one line each, to copy; prose wrapped at
    ``WIDTH`` without breaking a path."""
    return [f"{label:<9} {text}" if label in ONE_LINE else
            textwrap.fill(text, WIDTH, initial_indent=f"{label:<9} ", subsequent_indent=" " * 10,
                          break_on_hyphens=False, break_long_words=False) for label, text in rows]


def skipped_summary(name: str, result: dict[str, Any], place: Place) -> tuple[RunSummary, list[tuple[str, str]]]:
    """A night that skipped training (``retrain``): its summary (where the results are) and its decision rows —
    the traffic window, the monitors, why it did not train, the champion unchanged."""
    rows = [(label, text) for label, text in fresh_rows(result, None) if label != "retrain"]
    rows += [("retrain", result["retrain"]["reason"]),
             ("champion", "unchanged: nothing trained, evaluated or registered")]
    s = RunSummary(name=name, headline="night skipped: no training", stages=[], datasets=[], notes=[], decision="",
                   champion="", exports="", place=place)
    return s, rows


def render_skipped(name: str, result: dict[str, Any], place: Place) -> str:
    """The summary of a night that skipped training (``retrain``): why, the traffic window, the monitor, where."""
    s, rows = skipped_summary(name, result, place)
    out = [f"== specdraft run '{name}': night skipped: no training ==", ""]
    out += fresh_lines(rows[:-2])
    out += [textwrap.fill(rows[-2][1], WIDTH, initial_indent=f"{'retrain':<9} ", subsequent_indent=" " * 10),
            f"{'champion':<9} {rows[-1][1]}", ""]
    out += [f"{label:<9} {text}" for label, text in s.where()]
    return "\n".join(out)
