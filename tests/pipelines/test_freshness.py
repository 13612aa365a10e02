"""The flow's freshness steps (pipelines/freshness.py): a promoted draft handed off to exports/current with the
monitor's promotion value reset, and a monitor whose server does not answer is a warning, not a failed night."""

from __future__ import annotations

import json
import logging

from pipelines.freshness import hand_off, monitor_state, observe_served, settle_handoff
from pipelines.records import Prepared, Trained
from pipelines.tracking import NullRun
from pipelines.configs import RunConfig
from specdraft.config import from_dict
from benchmarks.processes import free_port
from specdraft.freshness.handoff import publish, read_meta, rollback


def test_hand_off_publishes_and_resets_the_monitor_baseline(tmp_path):
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"),
                                "monitor": {"metrics_url": "http://127.0.0.1:1/metrics"}})
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    trained = Trained(key="t", draft=str(draft), metrics={}, metrics_file="", wall_s=0.0)
    prepared = Prepared(target="/t", target_id="tid", prompts=[], wall_s=0.0)
    out = hand_off(cfg, prepared.target, trained.draft, {}, {"version": 7, "model_name": "toy-draft", "mean_engine_tau": 2.4})
    current = tmp_path / "runs" / "exports" / "current"
    assert out["handoff"] == str(current.absolute()) and (current / "draft" / "config.json").is_file()
    assert json.loads((current / "handoff.json").read_text())["version"] == 7
    assert out["restart"].startswith("restart the server")
    assert json.loads(monitor_state(cfg).read_text())["promotion"]["acceptance_length"] == 2.4


def test_a_server_that_does_not_answer_is_a_warning(tmp_path, caplog):
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path),
                                "monitor": {"metrics_url": f"http://127.0.0.1:{free_port()}/metrics", "timeout_s": 2}})
    with caplog.at_level(logging.WARNING):
        served = observe_served(cfg, NullRun(), logging.getLogger("test"))
    assert not served["alarm"] and "not read" in served["error"] and "not read" in caplog.text
    assert observe_served(from_dict(RunConfig, {}), NullRun(), logging.getLogger("test")) == {}


def test_the_offline_drift_series_reaches_the_report_as_plain_data(tmp_path):
    """The nights' ``offline.window_tau`` read back from a real MLflow store (SQLite), oldest first, runs of another
    name or without the check left out; the report draws it in its own part."""
    from pipelines.freshness import drift_series
    from pipelines.report import render_report
    from pipelines.summary import summarize_run
    from pipelines.tracking import MlflowLogger
    from tests.pipelines.test_run_summary import EVAL_REPORT, PLACE, records

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    nights = [(2.50, 2.50, "False", "7"), (2.41, 2.50, "False", "7"), (2.05, 2.50, "True", "7"), (2.60, 2.60, "False", "8")]
    for i, (tau, base, alarm, version) in enumerate(nights):
        night = MlflowLogger(uri, run_name=f"night-{i}", tags={"specdraft.run": "nightly"})
        night.log_metrics({"offline.window_tau": tau, "offline.window_tau_at_promotion": base,
                           "offline.drop": (base - tau) / base}, step=0)
        night.set_tags({"offline.alarm": alarm, "offline.champion_version": version,
                        "offline.window_end": f"2026-11-2{i}"})
        night.close()
        MlflowLogger(uri, run_name="skipped", tags={"specdraft.run": "nightly"}).close()  # no drift check
    MlflowLogger(uri, run_name="other", tags={"specdraft.run": "other"}).log_metrics({"offline.window_tau": 9.0}, 0)
    parent = MlflowLogger(uri, run_name="tonight", tags={"specdraft.run": "nightly"})
    series = drift_series(parent, "nightly")
    assert [s["tau"] for s in series] == [2.50, 2.41, 2.05, 2.60]
    assert [s["champion_version"] for s in series] == [7, 7, 7, 8] and [s["alarm"] for s in series][2]
    assert series[2]["tau_at_promotion"] == 2.50 and series[0]["window_end"] == "2026-11-20"
    assert drift_series(parent, "nightly", limit=2) == series[-2:]
    assert drift_series(NullRun(), "nightly") == []
    summary = summarize_run("nightly", records(tmp_path), PLACE, EVAL_REPORT)
    html = render_report(summary, training=[], eval_report=None, history=[], drift=series)
    part = html.split("<h2>Offline drift</h2>")[1]
    assert part.lstrip().startswith('<img src="data:image/png;base64,') and 'alt="offline drift' in part
    empty = render_report(summary, training=[], eval_report=None, history=[], drift=[])
    assert "no offline drift measured yet" in empty
    assert "Offline drift" not in render_report(summary, training=[], eval_report=None, history=[])  # check off


def _night(tmp_path, version: int) -> Trained:
    draft = tmp_path / f"draft-{version}"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"version": version}))
    return Trained(key=f"t{version}", draft=str(draft), metrics={}, metrics_file="", wall_s=0.0)


def _decision(version: int, promoted: bool, rerun: bool) -> dict:
    reason = f"already registered (same trained draft) as v{version} by run r" if rerun else "tau 3 > champion 2"
    return {"version": version, "model_name": "toy-draft", "promoted": promoted, "reason": reason}


def test_a_rerun_completes_a_killed_hand_off_and_a_disagreement_is_said(tmp_path, caplog):
    """Issue 44 item 5: a night killed during its hand-off left current/ at v1 while v2 is the champion; its rerun
    ("already registered") completes the hand-off. Neighbours: a new promotion hands off; served == champion: nothing
    is written again; a rollback is left alone and said; a champion this run did not train and cannot download
    (no registry) is said (downloaded from one: ``test_champion_load``); off: nothing."""
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs")})
    prepared = Prepared(target="/t", target_id="tid", prompts=[], wall_s=0.0)
    root = tmp_path / "runs" / "exports"
    v1, v2 = _night(tmp_path, 1), _night(tmp_path, 2)
    new = settle_handoff(cfg, prepared, v1, {}, _decision(1, True, False), champion=1)
    assert new["served_version"] == 1 and new["served_note"] == "" and new["handoff"] == str(root / "current")
    with caplog.at_level(logging.WARNING):  # the killed night's rerun: its draft is the champion, current is not
        done = settle_handoff(cfg, prepared, v2, {}, _decision(2, True, True), champion=2)
    assert done["served_version"] == 2 and done["served_note"] == "" and "did not finish" in caplog.text
    assert read_meta(root / "current")["version"] == 2 and read_meta(root / "previous")["version"] == 1
    published = read_meta(root / "current")["published"]
    again = settle_handoff(cfg, prepared, v2, {}, _decision(2, True, True), champion=2)  # agree: nothing to do
    assert "handoff" not in again and again["served_note"] == "" and read_meta(root / "current")["published"] == published
    rollback(root)  # the user went back to v1 on purpose: a rerun does not undo it, and says so
    back = settle_handoff(cfg, prepared, v2, {}, _decision(2, True, True), champion=2)
    assert "handoff" not in back and back["served_version"] == 1 and read_meta(root / "current")["version"] == 1
    assert "rolled back from the champion v2" in back["served_note"] and "specdraft rollback" in back["served_note"]
    rollback(root)
    other = settle_handoff(cfg, prepared, _night(tmp_path, 3), {}, _decision(3, False, False), champion=5)
    assert "handoff" not in other and other["served_version"] == 2
    assert "serves v2 but the registry's champion is v5, which cannot be handed off: no registry" in other["served_note"]
    off = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "handoff": {"enabled": False}})
    assert settle_handoff(off, prepared, v2, {}, _decision(2, True, False), champion=2) == {}
