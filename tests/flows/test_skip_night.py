"""A night that does not pay (issue 33, Deliver 3): with ``retrain.policy=when_it_pays``, the same traffic window
as the last trained night and no drift, the flow stops after prepare — nothing regenerated, trained, evaluated
or registered — and its summary and report say why; a new day with enough new rows trains again (decided, not run here)."""

from __future__ import annotations

import json
from pathlib import Path

from flows.regenerate_and_train import regenerate_and_train
from tests.flows.test_fresh_flow import write_day

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "toy.yaml")


def test_a_night_without_new_data_or_drift_skips_training(tmp_path):
    traffic, work = tmp_path / "traffic", tmp_path / "work"
    write_day(traffic, "2026-11-25", seed=32)
    args = [f"workdir={work}", "data.prompts=[]", f"data.traffic.path={traffic}", "data.traffic.replay=0.0",
            "retrain.policy=when_it_pays", "retrain.min_new_share=0.2", "tracking.enabled=false", "retries=0"]
    from pipelines.stages import prepare
    from pipelines.configs import RunConfig
    from specdraft.config import load

    prepared = prepare(load(RunConfig, CONFIG, args))  # what the last trained night read: the same window
    state = work / "traffic" / "trained_rows.json"
    state.write_text(Path(prepared.traffic.files.trained_rows).read_text())
    result = regenerate_and_train(config=CONFIG, overrides=args)
    assert set(result) == {"prepare", "monitor", "drift", "retrain", "mlflow_parent_run", "handoff", "summary", "report"}
    assert result["handoff"] == {}  # tracking off: no champion to serve
    assert not result["retrain"]["train"] and result["retrain"]["new_rows"] == 0
    text = result["summary"]
    assert text.splitlines()[0] == "== specdraft run 'toy': night skipped: no training =="
    assert "no drift and 0 of" in text and "training skipped" in text and "rows read" in text
    assert not (work / "train").exists() and not (work / "regenerate").exists()
    assert not (work / ".specdraft-lock").exists()  # the flow held its workdir while it ran, and released it
    report = Path(result["report"])  # the night's decisions are in its report too
    assert report.parent == work / "reports" and f"report    {report}" in text
    page = report.read_text()
    assert "night skipped: no training" in page and "training skipped" in page and "rows read" in page
    assert "Registered versions" in page and "unchanged: nothing trained, evaluated or registered" in page
    write_day(traffic, "2026-11-26", seed=33)  # a new day: half the window is new
    from flows.regenerate_and_train import freshness

    decision = freshness.retrain_decision(load(RunConfig, CONFIG, args), prepare(load(RunConfig, CONFIG, args)), {})
    assert decision.train and decision.reason.startswith("new data:")
    assert json.loads(state.read_text())  # the trained state is the night that trained, not this one
