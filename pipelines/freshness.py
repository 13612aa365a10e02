"""Keeping the draft fresh in the flow: the served drift monitor read each night, the offline drift check, the
retrain decision, the promotion gate on the traffic window's held-out slice, and the hand-off of a promoted draft
to ``exports/current``.

The decisions are the package ``specdraft.freshness`` (plain functions over numbers and files); this module
feeds them the run's stages and the registry (MLflow) and is called from the flow's register stage and its start.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipelines import stages
from pipelines.records import Evaluated, Prepared, Trained
from pipelines.registry import ChampionUnusable
from pipelines.configs import RunConfig
from pipelines.tracking import MlflowLogger, NullRun
from specdraft.freshness.record import RegressionCounts, TrafficRecord


def window_gate(cfg: RunConfig, run, prepared: Prepared, trained: Trained, evaluated: Evaluated):
    """The promotion gate (``gate.enabled``; ``specdraft.freshness.gate.decide``) as ``register_draft`` calls it:
    the candidate and the champion on the traffic window's held-out slice (the eval stage's settings and engine on
    ``held_out.jsonl``), and on the regression set: the eval sets and, when kept, the earlier windows' held-out
    slices (``regression.jsonl``, one more dataset: ``specdraft.freshness.gate.regression_pair``), its size in the
    run's tags ``gate.regression.questions``, ``gate.regression.windows``. None when the gate is off. The measure
    is the register stage's (``specdraft.freshness.promotion.choose_measure``)."""
    if not cfg.gate.enabled:
        return None
    from specdraft.freshness.gate import decide, describe_regression_set, regression_pair
    from specdraft.freshness.promotion import choose_measure

    measure = choose_measure(evaluated.mean_engine_tau)  # as register_draft compares the eval sets

    def value(e: Evaluated) -> float | None:
        return measure.of(e.mean_tau, e.mean_engine_tau)

    traffic = prepared.traffic or TrafficRecord()
    held_out, earlier = traffic.files.held_out, traffic.files.regression
    window_cfg = replace(cfg, eval=replace(cfg.eval, questions=[held_out])) if held_out else None
    earlier_cfg = replace(cfg, eval=replace(cfg.eval, questions=[earlier])) if earlier else None
    candidate = value(stages.evaluate_draft(window_cfg, prepared, trained.draft, trained.key)) if held_out else None
    eval_sets = len(evaluated.engine_tau if measure.by_engine else evaluated.tau)
    said = describe_regression_set(traffic.regression, len(cfg.eval.questions))
    if run.enabled:
        counts = traffic.regression or RegressionCounts()
        run.set_tags({"gate.regression.set": said, "gate.regression.questions": str(counts.questions),
                      "gate.regression.windows": ",".join(counts.windows)})

    def gate(champion_regression: float | None, champion_uri: str | None):
        champion_window = champion_earlier = None
        if champion_uri is not None and (window_cfg is not None or earlier_cfg is not None):
            local = str(champion_local(cfg, run, champion_uri))  # ChampionUnusable: register_draft says so
            key = f"champion:{champion_uri}"
            if window_cfg is not None:
                champion_window = value(stages.evaluate_draft(window_cfg, prepared, local, key))
            if earlier_cfg is not None:
                champion_earlier = value(stages.evaluate_draft(earlier_cfg, prepared, local, key))
        ours = value(evaluated)
        candidate_earlier = (value(stages.evaluate_draft(earlier_cfg, prepared, trained.draft, trained.key))
                             if earlier_cfg is not None and champion_uri is not None else None)
        regression, note = regression_pair(ours, champion_regression, eval_sets, earlier=bool(earlier),
                                           candidate_earlier=candidate_earlier, champion_earlier=champion_earlier)
        return decide(cfg.gate, window=(candidate, champion_window), regression=regression,
                      has_champion=champion_uri is not None, measure=measure.name, regression_set=note)

    return gate


def exports_root(cfg: RunConfig) -> Path:
    """The hand-off directory: ``handoff.exports``, else ``<workdir>/exports``."""
    return Path(cfg.handoff.exports or Path(cfg.workdir) / "exports").absolute()


def hand_off(cfg: RunConfig, target: str, draft: str, exports: dict[str, str],
             decision: dict[str, Any]) -> dict[str, Any]:
    """The promoted ``draft`` to ``<handoff.exports>/current`` (``specdraft.freshness.handoff``), the previous one kept; its
    serve commands point at ``current``; the monitor's promotion value reset to the engine's acceptance length
    when one was measured (else the next served period sets it)."""
    from specdraft.export import serve_commands
    from specdraft.freshness.handoff import publish, stable_exports

    root = exports_root(cfg)
    current = publish(root, draft, exports, meta={"version": decision["version"], "model": decision["model_name"],
                                                  "target": target})
    if cfg.monitor.metrics_url:
        from specdraft.freshness.monitor import record_promotion

        record_promotion(monitor_state(cfg), decision.get("mean_engine_tau"), decision["version"])
    serve = serve_commands(stable_exports(root), target,  # K: as set, else the draft's fastest in the engine
                           cfg.register.serving.speculative_tokens or decision.get("engine_best_k"))
    restart = ("restart the server to load it (vLLM loads its draft at start): "
               + (serve.get("vllm") or f"point the server's draft at {current}/<format>"))
    return {"handoff": str(current), "restart": restart, "serve": serve}


def settle_handoff(cfg: RunConfig, prepared: Prepared, trained: Trained | None, exports: dict[str, str],
                   decision: dict[str, Any] | None, champion: int | None, parent: MlflowLogger | NullRun | None = None,
                   logger: logging.Logger | Any = logging.getLogger(__name__)) -> dict[str, Any]:
    """The served draft (``current/handoff.json``'s version) made the registry's ``champion`` (the version
    holding the alias now; ``handoff.enabled``). This night's draft when it is the champion — a new promotion, or
    the rerun of a night whose hand-off was killed (its draft "already registered" and champion, ``current``
    still the old one): the rerun completes it. Another champion (a night that trained none, or whose hand-off
    never finished) is downloaded from the registry (``parent``) and handed off. A rollback is left alone
    (``previous`` holds the champion). Whatever still disagrees is ``served_note``, which the summary prints.
    Returns ``hand_off``'s keys when it handed off, ``version`` handed off, ``served_version`` (None: nothing
    served) and ``served_note`` ("" when they agree)."""
    if not cfg.handoff.enabled:
        return {}
    from specdraft.freshness.handoff import CURRENT, PREVIOUS, read_meta

    root = exports_root(cfg)
    served = read_meta(root / CURRENT).get("version")
    rolled_back = (served is not None and served != champion and champion is not None
                   and read_meta(root / PREVIOUS).get("version") == champion)
    out: dict[str, Any] = {}
    note = ""
    if champion is not None and served != champion and not rolled_back:
        unfinished = f"{root}/current serves {f'v{served}' if served is not None else 'nothing'}"
        if decision is not None and trained is not None and champion == decision["version"]:
            if decision["reason"].startswith("already registered"):
                logger.warning("handoff: v%s is the champion but %s: an earlier hand-off did not finish; "
                               "completing it", champion, unfinished)
            out = {**hand_off(cfg, prepared.target, trained.draft, exports, decision), "version": champion}
        else:
            try:
                out = _hand_off_registered(cfg, parent, prepared.target)
                logger.warning("handoff: %s but the champion is v%s: handed off from the registry", unfinished,
                               champion)
            except ChampionUnusable as err:
                note = f"{unfinished} but the registry's champion is v{champion}, which cannot be handed off: {err}"
        served = out.get("version", served)
    if champion is not None and served != champion and not note:
        note = (f"{root}/current serves v{served}, rolled back from the champion v{champion} (in previous/): "
                f"`specdraft rollback --exports {root}` serves the champion again")
    if note:
        logger.warning("handoff: %s", note)
    return {**out, "served_version": served, "served_note": note}


def _hand_off_registered(cfg: RunConfig, parent: MlflowLogger | NullRun | None, target: str) -> dict[str, Any]:
    """The registry's champion handed off: its draft (``download_champion``) and exports (``champion_exports``),
    both downloaded once under ``<workdir>``. ``ChampionUnusable`` when they cannot be had."""
    from pipelines.registry import champion_exports

    found = download_champion(cfg, parent) if parent is not None else None
    if found is None:
        raise ChampionUnusable("no registry to download it from (tracking off)")
    version, draft = found
    exported = champion_exports(parent.client, cfg.register.model_name, cfg.register.alias,
                                Path(cfg.workdir) / "export" / "champion")
    decision = {"version": int(version.version), "model_name": cfg.register.model_name,
                "engine_best_k": exported.get("best_k")}
    return {**hand_off(cfg, exported.get("target") or target, str(draft), exported.get("exports", {}), decision),
            "version": int(version.version)}


def serve_champion(cfg: RunConfig, parent: MlflowLogger | NullRun, prepared: Prepared,
                   logger: logging.Logger | Any) -> dict[str, Any]:
    """``settle_handoff`` for a night that registers nothing (it skipped training): the champion handed off from
    the registry when ``current`` does not serve it (a killed hand-off's rerun skips training: nothing new); {}
    with tracking or the hand-off off, or no champion."""
    if not parent.enabled or not cfg.handoff.enabled:
        return {}
    from pipelines.registry import current_champion

    champion = current_champion(parent.client, cfg.register.model_name, cfg.register.alias)
    if champion is None:
        return {}
    return settle_handoff(cfg, prepared, None, {}, None, int(champion.version), parent, logger)


def monitor_state(cfg: RunConfig) -> Path:
    return Path(cfg.monitor.state or Path(cfg.workdir) / "monitor" / "state.json")


def observe_served(cfg: RunConfig, parent: MlflowLogger | NullRun, logger: logging.Logger | Any) -> dict[str, Any]:
    """The served drift monitor (``monitor.metrics_url``; ``specdraft.freshness.monitor``): the served acceptance since
    the last night, logged to the parent run; an alarm is a WARNING in ``logger`` (the flow-run log). A server that does not
    answer is a warning too, not a failed night. {} when the monitor is off."""
    if not cfg.monitor.metrics_url:
        return {}
    from specdraft.freshness.monitor import observe

    try:
        served = observe(cfg.monitor, monitor_state(cfg))
    except (OSError, ValueError) as err:  # unreachable, not vLLM, no draft
        logger.warning("monitor: %s not read: %s: %s", cfg.monitor.metrics_url, type(err).__name__, err)
        return {"error": f"{cfg.monitor.metrics_url} not read: {type(err).__name__}: {err}", "alarm": False}
    parent.log_metrics({f"served.{k}": float(v) for k, v in served.items()
                        if k in ("acceptance_length", "acceptance_rate", "baseline", "drop") and v is not None}, step=0)
    parent.set_tags({"served.alarm": str(served["alarm"]), "served.restarted": str(served["restarted"])})
    (logger.warning if served["alarm"] else logger.info)("monitor: %s", served["message"])
    return served


def trained_state(cfg: RunConfig) -> Path:
    """The prompt hashes of the last window a night trained on (``remember_trained``)."""
    return Path(cfg.workdir) / "traffic" / "trained_rows.json"


def retrain_decision(cfg: RunConfig, prepared: Prepared, served: dict[str, Any], offline: dict[str, Any] | None = None):
    """``specdraft.freshness.retraining.decide_retraining`` on this night: the window's rows new since the last trained
    night (``trained_state``) and the drift alarms (the served monitor's, the offline check's)."""
    from specdraft.freshness.retraining import decide_retraining

    current = prepared.traffic.files.trained_rows if prepared.traffic else ""
    new_rows = rows = None
    last = trained_state(cfg)
    if current:
        hashes = set(json.loads(Path(current).read_text()))
        before = set(json.loads(last.read_text())) if last.is_file() else set()
        new_rows, rows = len(hashes - before), len(hashes)
    alarms = [d["message"] for d in (served, offline or {}) if d.get("alarm")]
    return decide_retraining(cfg.retrain, new_rows=new_rows, rows=rows, drift=bool(alarms),
                             drift_reason="; ".join(alarms), trained_before=last.is_file())


def before_training(cfg: RunConfig, parent: MlflowLogger | NullRun, prepared: Prepared,
                    logger: logging.Logger | Any) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """A night's checks before it trains: the served monitor (``observe_served``), the offline drift check
    (``offline_drift``) and the retrain decision (``retrain_decision``), logged (tags ``retrain.train``,
    ``retrain.reason``; metrics ``retrain.new_rows``, ``retrain.rows``). Returns (served, offline, decision)."""
    served = observe_served(cfg, parent, logger)
    offline = offline_drift(cfg, parent, prepared, logger)
    retrain = retrain_decision(cfg, prepared, served, offline)
    parent.set_tags({"retrain.train": str(retrain.train), "retrain.reason": retrain.reason})
    if retrain.new_rows is not None:
        parent.log_metrics({"retrain.new_rows": retrain.new_rows, "retrain.rows": retrain.rows}, step=0)
    logger.info("retrain: %s", retrain.reason)
    return served, offline, retrain


def remember_trained(cfg: RunConfig, prepared: Prepared) -> None:
    """After a night trained: its window's rows are the ones the next night's new rows are counted against."""
    from specdraft import files

    current = prepared.traffic.files.trained_rows if prepared.traffic else ""
    if current:
        files.write_text(trained_state(cfg), Path(current).read_text())


def download_champion(cfg: RunConfig, parent: MlflowLogger | NullRun):
    """(the champion's model version, its draft directory downloaded once to ``<workdir>/champion/v<version>``),
    or None with no registry (tracking off) or no champion yet. ``ChampionUnusable`` when its artifacts cannot be
    downloaded or the draft lacks what loading it needs (``specdraft.run.warm_start_gap``: the vocabulary maps)."""
    from mlflow.exceptions import MlflowException

    from pipelines.registry import current_champion, download_draft, version_uri
    from specdraft import files
    from specdraft.run import warm_start_gap

    if not parent.enabled:
        return None
    version = current_champion(parent.client, cfg.register.model_name, cfg.register.alias)
    if version is None:
        return None
    uri = version_uri(cfg.register.model_name, version.version)
    out = (Path(cfg.workdir) / "champion" / f"v{version.version}").absolute()
    if not (out / "model.safetensors").is_file():
        try:
            with tempfile.TemporaryDirectory() as tmp, files.write_directory(out) as new:
                local, _ = download_draft(parent.client, uri, tmp)
                for item in Path(local).iterdir():
                    item.rename(new / item.name)
        except (MlflowException, OSError) as err:
            first = (str(getattr(err, "message", err)).strip().splitlines() or [""])[0]
            raise ChampionUnusable(f"champion v{version.version} ({uri}): its draft's artifacts cannot be "
                                   f"downloaded from {version.source} ({type(err).__name__}: {first})") from None
    gap = warm_start_gap(out)
    if gap:
        raise ChampionUnusable(f"champion v{version.version} ({uri}, downloaded to {out}): {gap}")
    return version, out


def champion_local(cfg: RunConfig, run: MlflowLogger | NullRun, uri: str) -> Path:
    """The champion ``uri`` (``models:/NAME/VERSION``, the alias's holder) as a local draft directory
    (``download_champion``, downloaded once a night); ``ChampionUnusable`` when it cannot be loaded."""
    found = download_champion(cfg, run)
    if found is None or not uri.endswith(f"/{found[0].version}"):
        raise ChampionUnusable(f"{uri}: not the registry's champion now")
    return found[1]


def champion_unusable(cfg: RunConfig, run: MlflowLogger | NullRun, logger: logging.Logger | Any) -> str:
    """Before the register stage compares the new draft with the champion: why the champion cannot be loaded (one
    line naming the version and what is missing, said as a WARNING), "" when it can or there is none. Loadable is
    what serving and comparing it need; ``register_draft`` then judges the draft against the floor alone."""
    try:
        download_champion(cfg, run)
    except ChampionUnusable as err:
        logger.warning("register: %s: not compared, the new draft is judged against the floor alone", err)
        return str(err)
    return ""


def champion_draft(cfg: RunConfig, parent: MlflowLogger | NullRun, logger: logging.Logger | Any) -> tuple[str, str]:
    """``train.init_from=champion`` resolved: (the registered champion's draft directory — ``download_champion``: a
    new champion is a new training input —, ""); or ("", why) — train from scratch, said in the log as one line,
    and ``why`` for the summary when it is news — with no registry (tracking off), no champion yet, or a champion
    that cannot be loaded (``ChampionUnusable``: the version and what is missing)."""
    try:
        found = download_champion(cfg, parent)
    except ChampionUnusable as err:
        logger.warning("train.init_from=champion: %s: training from scratch", err)
        return "", f"{err}: trained from scratch"
    if found is None:
        logger.warning("train.init_from=champion: %s: from scratch", "no champion yet" if parent.enabled else
                       "tracking is off, no registry to find the champion in")
        return "", ""
    version, out = found
    logger.info("train.init_from=champion: warm start from v%s (%s)", version.version, out)
    return str(out), ""


BASELINE_TAG = "offline.window_tau_at_promotion"
ENGINE_BASELINE_TAG = "offline.window_engine_tau_at_promotion"


def offline_drift(cfg: RunConfig, parent: MlflowLogger | NullRun, prepared: Prepared,
                  logger: logging.Logger | Any) -> dict[str, Any]:
    """The offline drift check (``monitor.offline``): before training, the champion evaluated
    on the new window's held-out slice (the eval stage's settings: our decoder's tau, and the serving engine's
    acceptance length when ``eval.settings.engine`` measures one), beside its value on the first window it was
    measured on after its promotion (version tags); a drop beyond ``monitor.max_drop`` — of the engine's
    acceptance when measured, as the gate compares, else of tau — is an alarm (WARNING). Logged to the parent run
    as ``offline.window_tau`` (and ``offline.window_engine_tau``), one point a night: a time series across the
    nights' runs (``drift_series`` reads it back for the report). {} when off, without a window slice or without
    a champion."""
    held_out = prepared.traffic.files.held_out if prepared.traffic else ""
    if not cfg.monitor.offline or not held_out:
        return {}
    try:
        found = download_champion(cfg, parent)
    except ChampionUnusable as err:  # said here, and by the warm start when it asks
        logger.warning("drift: %s: not measured", err)
        return {"alarm": False, "message": f"not measured: {err}"}
    if found is None:
        return {}
    from pipelines.registry import version_uri
    from specdraft.freshness.monitor import judge_drift
    from specdraft.freshness.promotion import choose_measure

    version, local = found
    window_cfg = replace(cfg, eval=replace(cfg.eval, questions=[held_out]))
    # the gate's key for the same measurement (window_gate): the register stage finds it done
    evaluated = stages.evaluate_draft(window_cfg, prepared, str(local),
                                      f"champion:{version_uri(cfg.register.model_name, version.version)}")
    tau, engine = evaluated.mean_tau, evaluated.mean_engine_tau
    if tau is None:
        return {}
    baselines = {}
    for name, tag, value in (("tau", BASELINE_TAG, tau), ("engine", ENGINE_BASELINE_TAG, engine)):
        if value is None:
            continue
        baseline = version.tags.get(tag)
        if baseline is None:  # the first window after its promotion sets it
            parent.client.set_model_version_tag(cfg.register.model_name, version.version, tag, f"{value:.6f}")
            baseline = value
        baselines[name] = float(baseline)
    measure = choose_measure(engine)  # as the gate compares
    value, baseline = measure.of(tau, engine), baselines["engine" if measure.by_engine else "tau"]
    drop, alarm, message = judge_drift(value, baseline, cfg.monitor.max_drop, measure=measure.name,
                                       who=f"champion v{version.version}")
    metrics = {"offline.window_tau": tau, "offline.window_tau_at_promotion": baselines["tau"], "offline.drop": drop}
    if engine is not None:
        metrics.update({"offline.window_engine_tau": engine,
                        "offline.window_engine_tau_at_promotion": baselines["engine"]})
    parent.log_metrics(metrics, step=0)
    parent.set_tags({"offline.alarm": str(alarm), "offline.champion_version": str(version.version),
                     "offline.measure": measure.name, "offline.window_end": prepared.traffic.end})
    (logger.warning if alarm else logger.info)("drift: %s", message)
    return {"champion_version": int(version.version), "window_tau": tau, "window_engine_tau": engine,
            "measure": measure.name, "value": value, "baseline": baseline, "drop": drop, "alarm": alarm,
            "message": message}


def drift_series(parent: MlflowLogger | NullRun, name: str, limit: int = 30) -> list[dict[str, Any]]:
    """The offline drift check's time series for the run report: the last ``limit`` runs named ``name``
    (``specdraft.run`` tag) of the parent's experiment that logged ``offline.window_tau``, oldest first — each
    night's champion version, its tau (and engine acceptance) on that night's window beside the value at its
    promotion, the drop and the alarm — as plain data (the report imports no MLflow). [] with tracking off."""
    if not parent.enabled:
        return []
    runs = parent.client.search_runs([parent.experiment_id], filter_string=f"tags.`specdraft.run` = '{name}'",
                                     order_by=["attributes.start_time DESC"], max_results=1000)
    series = []
    for r in runs:
        m, tags = r.data.metrics, r.data.tags
        if "offline.window_tau" not in m:
            continue
        series.append({"start": r.info.start_time, "window_end": tags.get("offline.window_end", ""),
                       "champion_version": int(tags.get("offline.champion_version") or 0),
                       "tau": m["offline.window_tau"], "tau_at_promotion": m.get("offline.window_tau_at_promotion"),
                       "engine": m.get("offline.window_engine_tau"),
                       "engine_at_promotion": m.get("offline.window_engine_tau_at_promotion"),
                       "drop": m.get("offline.drop"), "alarm": tags.get("offline.alarm") == "True"})
        if len(series) == limit:
            break
    return series[::-1]
