"""``data.traffic`` in the run (issue 33, Deliver 1): prepare reads the window into the run's prompt files, the
served model's logged answers are a file of their own that the regenerate stage ingests as they are (no
target, no Ray), and the counts reach the record the summary and MLflow read."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.conversations import read_conversations
from pipelines.stages import RunConfig, prepare, regenerate_file
from flows.preflight import check_run
from specdraft.config import ConfigError, from_dict
from tests.specdraft.test_traffic import SERVED, write_traffic


def test_prepare_reads_the_window_and_the_reused_rows_are_not_regenerated(tmp_path):
    root = write_traffic(tmp_path / "traffic")
    cfg = from_dict(RunConfig, {"workdir": str(tmp_path / "runs"), "data": {"traffic": {
        "path": str(root), "days": 4, "served_model": SERVED, "replay": 0.0, "held_out": 0.0}}})
    check_run(cfg)  # data.prompts may be empty when data.traffic.path is set
    prepared = prepare(cfg)
    assert [(Path(p.path).name, p.reuse) for p in prepared.prompts] == [("prompts.jsonl", False),
                                                                        ("reused.jsonl", True)]
    counts = prepared.traffic["counts"]
    assert (counts["reused"], counts["to_regenerate"], counts["rejected"], counts["deduplicated"]) == (2, 3, 2, 1)
    assert prepared.traffic["warnings"] == [f"traffic: day 2026-11-24 has no folder under {root}"]
    reused = regenerate_file(cfg, prepared, prepared.prompts[1])  # would need Ray and the target if regenerated
    rows = read_conversations([reused.conversations])
    assert sorted(r["messages"][-1]["content"] for r in rows) == ["four", "licnep"]
    assert reused.summary["rows_out"] == 2
    again = prepare(cfg)  # the same logs: the same files, the same keys (a rerun skips finished stages)
    assert [p.digest for p in again.prompts] == [p.digest for p in prepared.prompts]
    assert regenerate_file(cfg, again, again.prompts[1]).skipped


def test_run_refuses_missing_traffic(tmp_path):
    with pytest.raises(ConfigError, match="data.traffic.path"):
        check_run(from_dict(RunConfig, {"workdir": str(tmp_path / "runs"),
                                         "data": {"traffic": {"path": str(tmp_path / "nowhere")}}}))
    with pytest.raises(ConfigError, match="data.traffic.days"):
        from_dict(RunConfig, {"data": {"traffic": {"days": 0}}})
