"""The ``regenerate-and-train`` Prefect flow: prepare -> regenerate -> dump -> train -> evaluate -> register
(docs/commands.md, ``specdraft run``; docs/operations.md "The nightly deployment").

Tasks are thin: each loads the config, calls one ``pipelines.stages`` function and returns
its record (a frozen dataclass of paths, keys, metrics: ``pipelines.stages.Prepared`` ...
``Registered``); tensors never cross a task boundary. Stage outputs are keyed by their
inputs, so a rerun skips finished stages and resumes partial ones. MLflow gets one parent
run per flow run and one child run per stage, with the stage's config section as params and
the numbers of its record (``to_dict()``) as metrics. The flow returns the records as plain
dicts (``to_dict()``) with the run summary (``pipelines.summary``: each stage, tau against the floor,
the champion gate's decision, where the results are) and the path of the run's HTML report
(``pipelines.report``); the summary is also the flow-run log's last word (a deployment's worker output
and the Prefect UI), and both are artifacts of the parent run. ``specdraft run`` prints the summary.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from pipelines import freshness, rates, stages
from pipelines.records import Dumped, Evaluated, Prepared, PromptFile, Regenerated, Registered, Trained
from pipelines.stage_log import stage_log
from pipelines.configs import RunConfig, TrackingConfig
from pipelines.tracking import MlflowLogger, NullRun, open_run
from flows.preflight import check_run
from specdraft import files
from specdraft.config import ConfigError, config_hash, flatten, from_dict, load, to_dict
from specdraft.limits import LoadSampler
from specdraft.outputs import held_output, mark_output



def retry_unless_config_error(task, task_run, state) -> bool:
    """Prefect's ``retry_condition_fn`` of every stage: a ``ConfigError`` fails the same way on every try, so it is
    never retried (the flow fails at once, naming the key); anything else — a lost worker, a full disk — is."""
    return not isinstance(getattr(state, "data", None), ConfigError)


TASK = dict(cache_policy=NO_CACHE, retry_delay_seconds=[10, 60, 180], retry_condition_fn=retry_unless_config_error)


def _numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[name] = float(value)
        elif isinstance(value, dict):
            out.update(_numbers(value, f"{name}."))
    return out


def _child(tr: dict, stage: str, params: dict[str, Any]) -> MlflowLogger | NullRun:
    """The stage's child run under the flow's parent run (``tr``: the parent's tracking reference)."""
    run = open_run(from_dict(TrackingConfig, tr["tracking"]), run_name=stage, parent_run_id=tr["parent"],
                   tags={"specdraft.stage": stage, **tr["tags"]})
    run.log_params(params)
    return run


def _close(run: MlflowLogger | NullRun, record: Prepared | Regenerated | Dumped | Trained | Evaluated | Registered
           ) -> None:
    skipped = getattr(record, "skipped", False)  # prepare and register always run
    run.set_tags({"skipped": str(skipped)})
    # a skipped stage's wall_s is the earlier run's (from its DONE file): not this run's metric
    drop = {"metrics", "wall_s"} if skipped else {"metrics"}
    run.log_metrics(_numbers({k: v for k, v in record.to_dict().items() if k not in drop}), step=0)
    run.close()


def _rate(cfg: RunConfig, tr: dict, name: str, record: Any, args: tuple, load: LoadSampler) -> None:
    """A throughput stage's tokens, FLOPs per token and load in this run's ``rates.json`` (``pipelines.rates``): the
    summary's rate and limit. One that cannot be measured is warned about, and the summary says so; the run goes on."""
    if name not in rates.RATE_STAGES or not tr.get("rates"):
        return
    try:
        rates.after_stage(cfg, tr["rates"], name, record, args[0].target, load.summary())
    except Exception as err:
        get_run_logger().warning("%s: its rate's limit not measured: %s: %s", name, type(err).__name__, err)


def _stage_task(name: str, section: Callable[..., Any] | None = None):
    """Decorate a stage: a Prefect task with retries, a child MLflow run, a one-line summary, its third-party log
    lines in ``<workdir>/logs/<stage>.log`` (``pipelines.stage_log``). The child run's
    params are the stage's config section (``section(cfg, *args)``; default: the ``RunConfig`` field named
    like the stage, none when there is none)."""

    def wrap(fn):
        def body(cfg_data: dict, tr: dict, *args, **kwargs):
            cfg = from_dict(RunConfig, cfg_data)
            params = section(cfg, *args) if section else getattr(cfg, fn.__name__.removesuffix("_stage"), {})
            run = _child(tr, name, flatten(params or {}, name))
            try:
                # third-party lines off the console; the load average sampled for the stage's rate
                with stage_log(Path(cfg.workdir) / "logs" / f"{name}.log"), LoadSampler() as load:
                    record = fn(cfg, run, *args, **kwargs)
            except BaseException:
                run.close("FAILED")
                raise
            _close(run, record)
            _rate(cfg, tr, name, record, args, load)
            get_run_logger().info("%s: %s", name, "skipped (done)" if getattr(record, "skipped", False) else
                                  f"done in {record.wall_s:.1f}s")
            return record

        body.__name__ = fn.__name__
        return body

    return wrap


@_stage_task("prepare")
def prepare_stage(cfg: RunConfig, run) -> Prepared:
    return stages.prepare(cfg)


@_stage_task("regenerate")
def regenerate_stage(cfg: RunConfig, run, prepared: Prepared, prompt: PromptFile) -> Regenerated:
    return stages.regenerate_file(cfg, prepared, prompt)


@_stage_task("features", section=lambda cfg, *rest: stages.run_features(cfg))  # the features the dump computes
def features_stage(cfg: RunConfig, run, prepared: Prepared, regenerated: Regenerated) -> Dumped:
    return stages.dump_file(cfg, prepared, regenerated)


# params: the config training runs with (online: the run's features section as train.online), which the
# worker logs again into the same run — MLflow refuses a param logged twice with different values
@_stage_task("train", section=lambda cfg, prepared, stores, *rest: stages.train_config(cfg, stores))
def train_stage(cfg: RunConfig, run, prepared: Prepared, stores: list[Dumped] | list[Regenerated],
                fail_at_step: int | None = None) -> Trained:
    record = stages.train(cfg, prepared, stores, tracking=run.ref(), fail_at_step=fail_at_step)
    if Path(record.metrics_file).is_file():
        from pipelines.plots import plot_training, read_training_metrics

        with tempfile.TemporaryDirectory() as tmp:
            run.log_artifact(plot_training(record.metrics_file, Path(tmp) / "training_curves.png"), "plots")
        if record.skipped:  # a finished run logged nothing this time: replay its metrics
            for item in read_training_metrics(record.metrics_file):
                if item.get("kind") == "metrics":
                    run.log_metrics({k: v for k, v in item.items() if k not in ("kind", "step", "time")}, item["step"])
    return record


@_stage_task("eval")
def eval_stage(cfg: RunConfig, run, prepared: Prepared, trained: Trained) -> Evaluated:
    from pipelines.plots import plot_alpha

    record = stages.evaluate_draft(cfg, prepared, trained.draft, trained.key)
    report = json.loads(Path(record.report).read_text())
    run.log_artifact(record.report, "eval")
    with tempfile.TemporaryDirectory() as tmp:
        run.log_artifact(plot_alpha(report, Path(tmp) / "alpha_per_depth.png"), "plots")
    for name, d in report["datasets"].items():
        run.log_metrics({f"tau.{name}": d["tau"] or 0.0, f"speedup.{name}": d["speedup"] or 0.0,
                         f"lossless_mismatches.{name}": d["lossless_mismatches"] or 0}, step=0)
        if d.get("load_1m") is not None:  # the load the speedup was measured under
            run.log_metrics({f"load_1m.{name}": d["load_1m"]}, step=0)
        if d.get("tau_pld") is not None:  # the prompt-lookup floor beside the draft's tau
            run.log_metrics({f"tau_pld.{name}": d["tau_pld"], f"tau_over_pld.{name}": d["tau_over_pld"] or 0.0},
                            step=0)
        for i, a in enumerate(d["alpha"]):
            if a is not None:
                run.log_metrics({f"alpha.{name}": a}, step=i + 1)
    for name, d in (report.get("engine") or {}).get("datasets", {}).items():  # the serving engine beside ours
        run.log_metrics({key: d[field] for key, field in ((f"engine_tau.{name}", "acceptance_length"),
                                                          (f"engine_tau_ours.{name}", "tau_ours"),
                                                          (f"engine_gap.{name}", "gap"),
                                                          (f"engine_speedup.{name}", "speedup"))
                         if d.get(field) is not None}, step=0)
        for i, a in enumerate(d["accepted_per_pos"]):
            run.log_metrics({f"engine_accepted_per_pos.{name}": a}, step=i + 1)
    return record


@_stage_task("register")
def register_stage(cfg: RunConfig, run, prepared: Prepared, trained: Trained, evaluated: Evaluated) -> Registered:
    from pipelines.registry import BEST_K_TAG, champion_exports, log_exports, register_draft
    from specdraft.freshness.engine_gate import engine_verdict
    from specdraft.export import serve_commands
    from specdraft.freshness.promotion import Measures

    started = time.perf_counter()
    if not run.enabled:  # the registry lives in MLflow: nothing to register into
        return Registered(registered=False, reason="tracking disabled", wall_s=0.0)
    if evaluated.mean_tau is None:
        raise RuntimeError("evaluation produced no tau: nothing to compare, refusing to register")

    def evaluate_champion(uri: str) -> tuple[float | None, float | None]:
        local = freshness.champion_local(cfg, run, uri)  # ChampionUnusable: register_draft says so
        champion = stages.evaluate_draft(cfg, prepared, str(local), f"champion:{uri}")
        return champion.mean_tau, champion.mean_engine_tau

    exported = stages.export_formats(cfg, prepared, trained.draft, trained.key)
    tags = {"specdraft.arch": exported.arch, "specdraft.recipe": cfg.train.recipe, "specdraft.target": prepared.target,
            "specdraft.target_id": prepared.target_id}
    measures = Measures(tau=evaluated.mean_tau, floor=evaluated.mean_tau_pld, engine_tau=evaluated.mean_engine_tau)
    best_k = (evaluated.engine_best.get("draft") or {}).get("k")  # the engine's fastest K: the serve commands'
    tags.update({BEST_K_TAG: str(best_k)} if best_k else {})
    decision = register_draft(run.client, run_id=run.run_id, draft_dir=trained.draft,
                              model_name=cfg.register.model_name, alias=cfg.register.alias,
                              eval_key=evaluated.eval_key, measures=measures, taus=evaluated.tau,
                              train_key=trained.key, evaluate_champion=evaluate_champion,
                              tags=tags, gate=freshness.window_gate(cfg, run, prepared, trained, evaluated),
                              champion_unusable=freshness.champion_unusable(cfg, run, get_run_logger()),
                              engine=engine_verdict(evaluated.engine_best))
    log_exports(run.client, decision["run_id"], exported.exports)
    champion = champion_exports(run.client, cfg.register.model_name, cfg.register.alias,
                                Path(cfg.workdir) / "export" / "champion",
                                local={decision["version"]: exported.exports})
    serve = serve_commands(champion.get("exports", {}), champion.get("target") or prepared.target,
                           cfg.register.serving.speculative_tokens or champion.get("best_k"))
    # the served draft made the champion when it is ours (a rerun completes a killed hand-off), else said
    handoff = freshness.settle_handoff(cfg, prepared, trained, exported.exports, decision, champion.get("version"),
                                       run, get_run_logger())
    handoff.pop("version", None)
    serve = handoff.pop("serve", None) or serve
    return Registered(**decision, recipe=cfg.train.recipe, exports=exported.exports, export_note=exported.note,
                      serving_champion=champion.get("version"), champion_recipe=champion.get("recipe", ""),
                      serve=serve, **handoff,
                      wall_s=time.perf_counter() - started)


def open_parent_run(cfg: RunConfig) -> tuple[MlflowLogger | NullRun, dict[str, Any]]:
    """The flow's parent run (a ``NullRun`` with tracking disabled) and the reference each task
    opens its child run from (the URI pinned to the parent's, resolved once here)."""
    parent = open_run(cfg.tracking, run_name=f"{cfg.name}-{flow_run.get_name() or 'local'}",
                      tags={"prefect.flow_run_id": str(flow_run.get_id() or ""), "config_hash": config_hash(cfg),
                            "specdraft.run": cfg.name})
    parent.log_params(flatten(cfg))
    tr = {"tracking": to_dict(replace(cfg.tracking, uri=parent.uri)), "parent": parent.run_id,
          "tags": {"config_hash": config_hash(cfg)}}
    return parent, tr


def _task(fn, retries: int):
    return task(fn, name=fn.__name__.removesuffix("_stage"), retries=retries, **TASK)


@flow(name="regenerate-and-train", log_prints=True)
def regenerate_and_train(config: str = "configs/toy.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Run every stage for ``config`` (+ ``key=value`` overrides); returns the stage records as dicts."""
    cfg = load(RunConfig, config, list(overrides or []))
    check_run(cfg)  # the pre-flight: a bad path fails here, before Ray, a model or a stage starts
    # one run per workdir (specdraft/outputs.py): `specdraft run` took the lock already; a deployment's run takes it
    with held_output(cfg.workdir, "run"):
        mark_output(cfg.workdir, "run")  # the workdir a run's own from now on
        return run_stages(cfg)


def run_stages(cfg: RunConfig) -> dict[str, Any]:
    """The flow's stages for ``cfg`` (checked, its workdir held): the records as dicts, with the summary."""
    data = to_dict(cfg)
    retries = cfg.retries
    parent, tr = open_parent_run(cfg)
    tr["rates"] = rates.start_run(cfg.workdir)  # this run's matmul references and stage rates (an earlier run's: gone)
    try:
        prepared = _task(prepare_stage, retries)(data, tr)
        parent.set_tags({"target_id": prepared.target_id})
        # the served monitor, the offline drift check and whether this night trains (retrain.policy)
        served, offline, retrain = freshness.before_training(cfg, parent, prepared, get_run_logger())
        if not retrain.train:
            return skip_night(cfg, parent, {"prepare": prepared.to_dict(), "monitor": served, "drift": offline,
                                            "retrain": retrain.to_dict(), "mlflow_parent_run": parent.run_id,
                                            "handoff": freshness.serve_champion(cfg, parent, prepared,
                                                                                get_run_logger())})
        warm = ""  # a champion that cannot be loaded: why this night trains from scratch
        if cfg.train.init_from == "champion":  # warm start: the registered champion's draft directory
            init_from, warm = freshness.champion_draft(cfg, parent, get_run_logger())
            data = {**data, "train": {**data["train"], "init_from": init_from}}
            cfg = from_dict(RunConfig, data)
        regenerated = [_task(regenerate_stage, retries)(data, tr, prepared, p) for p in prepared.prompts]
        online = cfg.train.features == "online"  # no store: training runs the target on every batch
        stores = [] if online else [_task(features_stage, retries)(data, tr, prepared, r) for r in regenerated]
        trained = _task(train_stage, retries)(data, tr, prepared, regenerated if online else stores,
                                              cfg.fault.train_fail_at_step)
        freshness.remember_trained(cfg, prepared)  # the next night counts its new rows against this window
        evaluated = _task(eval_stage, retries)(data, tr, prepared, trained)
        registered = (_task(register_stage, retries)(data, tr, prepared, trained, evaluated)
                      if cfg.register.enabled else Registered(registered=False, reason="register.enabled=false"))
    except BaseException:
        parent.close("FAILED")
        raise
    parent.log_metrics({f"{metric}.{k}": v for metric in ("tau", "tau_pld", "tau_over_pld")
                        for k, v in getattr(evaluated, metric).items()}, step=0)
    result = {"prepare": prepared.to_dict(), "regenerate": [r.to_dict() for r in regenerated],
              "features": [s.to_dict() for s in stores], "train": trained.to_dict(), "eval": evaluated.to_dict(),
              "register": registered.to_dict(), "monitor": served, "drift": offline, "retrain": retrain.to_dict(),
              "warm": warm, "mlflow_parent_run": parent.run_id, "rates": rates.read_run(cfg.workdir, tr["rates"])}
    try:
        result.update(report_run(cfg, parent, result))
    finally:
        parent.close()
    return result


def skip_night(cfg: RunConfig, parent: MlflowLogger | NullRun, result: dict[str, Any]) -> dict[str, Any]:
    """A night that does not train (``retrain.policy=when_it_pays``): its summary (why, the traffic window, the
    monitors) and its report (those decisions, the registered versions, the offline drift series) written, logged
    and returned; no stage after prepare ran."""
    from datetime import datetime

    from pipelines.report import render_skipped_report
    from pipelines.summary import Place, render_skipped, skipped_summary

    try:
        name = f"{datetime.now():%Y%m%d-%H%M%S}-{flow_run.get_name() or 'local'}.html"
        report_path = Path(cfg.workdir).absolute() / "reports" / name
        place = Place(workdir=str(Path(cfg.workdir).absolute()), report=str(report_path), tracking_uri=parent.uri,
                      experiment_id=parent.experiment_id, run_id=parent.run_id)
        try:
            history = []
            if parent.enabled:
                from pipelines.registry import version_history

                history = version_history(parent.client, cfg.register.model_name, cfg.register.alias)
            drift = freshness.drift_series(parent, cfg.name) if cfg.monitor.offline else None
            summary, decisions = skipped_summary(cfg.name, result, place)
            files.write_text(report_path, render_skipped_report(summary, decisions, history=history, drift=drift))
        except Exception as err:  # the night itself succeeded: a report that cannot be written is said, not raised
            get_run_logger().warning("report: not written: %s: %s", type(err).__name__, err)
            place = replace(place, report="", report_error=f"{type(err).__name__}: {err}")
            report_path = ""
        text = render_skipped(cfg.name, result, place)
        parent.set_tags({"specdraft.summary": text.splitlines()[0].strip("= ")})
        with tempfile.TemporaryDirectory() as tmp:
            parent.log_artifact(files.write_text(Path(tmp) / "summary.txt", text + "\n"))
            if report_path:
                parent.log_artifact(shutil.copyfile(report_path, Path(tmp) / "report.html"))
        get_run_logger().info("run summary\n%s", text, extra={SUMMARY: True})
    finally:
        parent.close()
    return {**result, "summary": text, "report": str(report_path)}


SUMMARY = "specdraft_summary"  # the attribute marking the summary's log record (``summary_off_the_console``)


def report_run(cfg: RunConfig, parent: MlflowLogger | NullRun, result: dict[str, Any]) -> dict[str, str]:
    """The run summary (``pipelines.summary``) and report (``pipelines.report``): the report written to
    ``<workdir>/reports/`` and, with the summary, logged to the parent run; the summary logged to the flow-run
    log, the last thing a worker's output and the Prefect UI show. Returns ``summary`` (the text) and ``report``
    (its path; "" when it could not be written — the summary then says why)."""
    from datetime import datetime

    from pipelines.report import write_run_report
    from pipelines.summary import Place, render_text, summarize_run

    logger = get_run_logger()
    name = f"{datetime.now():%Y%m%d-%H%M%S}-{flow_run.get_name() or 'local'}.html"
    report_path = Path(cfg.workdir).absolute() / "reports" / name
    place = Place(workdir=str(Path(cfg.workdir).absolute()), report=str(report_path), tracking_uri=parent.uri,
                  experiment_id=parent.experiment_id, run_id=parent.run_id)
    report_file = Path(result["eval"]["report"])
    eval_report = json.loads(report_file.read_text()) if report_file.is_file() else None
    summary = summarize_run(cfg.name, result, place, eval_report)
    try:
        history = []
        if parent.enabled:
            from pipelines.registry import version_history

            history = version_history(parent.client, cfg.register.model_name, cfg.register.alias)
        drift = freshness.drift_series(parent, cfg.name) if cfg.monitor.offline else None  # the nights' series
        write_run_report(report_path, summary, metrics_file=result["train"]["metrics_file"], eval_report=eval_report,
                     history=history, drift=drift)
    except Exception as err:  # the run itself succeeded: a report that cannot be written is said, not raised
        logger.warning("report: not written: %s: %s", type(err).__name__, err)
        summary = summarize_run(cfg.name, result, replace(place, report="", report_error=f"{type(err).__name__}: {err}"),
                            eval_report)
        report_path = ""
    text = render_text(summary)
    parent.set_tags({"specdraft.summary": summary.headline})
    with tempfile.TemporaryDirectory() as tmp:  # under fixed names: summary.txt, report.html
        parent.log_artifact(files.write_text(Path(tmp) / "summary.txt", text + "\n"))
        if report_path:
            parent.log_artifact(shutil.copyfile(report_path, Path(tmp) / "report.html"))
    logger.info("run summary\n%s", text, extra={SUMMARY: True})
    return {"summary": text, "report": str(report_path)}


@contextmanager
def summary_off_the_console() -> Iterator[None]:
    """Within: the summary the flow logs reaches the flow-run log (Prefect's API) but not the console — for a
    caller that prints it itself (``specdraft run``), so it does not show twice."""
    def drop(record: logging.LogRecord) -> bool:
        return not getattr(record, SUMMARY, False)

    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(drop)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop)
