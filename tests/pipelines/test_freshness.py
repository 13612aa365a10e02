"""The flow's freshness steps (pipelines/freshness.py): a promoted draft handed off to exports/current with the
monitor's promotion value reset, and a monitor whose server does not answer is a warning, not a failed night."""

from __future__ import annotations

import json
import logging

from pipelines.freshness import hand_off, monitor_state, observe_served
from pipelines.records import Prepared, Trained
from pipelines.tracking import NullRun
from pipelines.stages import RunConfig
from specdraft.config import from_dict
from tests.flows.processes import free_port


def test_hand_off_publishes_and_resets_the_monitor_baseline(tmp_path):
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"),
                                "monitor": {"metrics_url": "http://127.0.0.1:1/metrics"}})
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    trained = Trained(key="t", draft=str(draft), metrics={}, metrics_file="", wall_s=0.0)
    prepared = Prepared(target="/t", target_id="tid", prompts=[], wall_s=0.0)
    out = hand_off(cfg, prepared, trained, {}, {"version": 7, "model_name": "toy-draft", "mean_engine_tau": 2.4})
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
