"""The served drift monitor (specdraft/freshness/monitor.py, issue 33 Deliver 2b) on Prometheus text as vLLM's server writes
it: counters summed over engines, the period since the last reading, a restart (by the process start time, or
a counter going down), the promotion baseline and the alarm. A real vLLM server is
``tests/serving/test_served_monitor.py``'s."""

from __future__ import annotations

import json

import pytest

from specdraft.config import ConfigError
from specdraft.configs.fresh import MonitorSettings
from specdraft.freshness.monitor import observe, parse_metrics, record_promotion


def exposition(drafts: int, draft_tokens: int, accepted: int, started: float = 1.7e9) -> str:
    half = {"d": drafts // 2, "t": draft_tokens // 2, "a": accepted // 2}
    lines = ["# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
             "# TYPE vllm:spec_decode_num_drafts_total counter",
             f"process_start_time_seconds {started}"]
    for engine, part in (("0", half), ("1", {"d": drafts - half["d"], "t": draft_tokens - half["t"],
                                              "a": accepted - half["a"]})):
        labels = f'{{engine="{engine}",model_name="toy"}}'
        lines += [f"vllm:spec_decode_num_drafts_total{labels} {float(part['d'])}",
                  f"vllm:spec_decode_num_drafts_created{labels} 1.7e9",
                  f"vllm:spec_decode_num_draft_tokens_total{labels} {float(part['t'])}",
                  f"vllm:spec_decode_num_accepted_tokens_total{labels} {float(part['a'])}",
                  f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{engine}",position="0"}} 5.0']
    return "\n".join(lines) + "\n"


def test_periods_restarts_and_the_alarm(tmp_path):
    settings = MonitorSettings(metrics_url="http://127.0.0.1:1/metrics", max_drop=0.10)
    state = tmp_path / "monitor" / "state.json"
    first = observe(settings, state, parse_metrics(exposition(100, 300, 150), read_at=1.0))
    assert first["acceptance_length"] == pytest.approx(2.5) and first["acceptance_rate"] == pytest.approx(0.5)
    assert first["baseline"] == pytest.approx(2.5) and not first["alarm"]  # no promotion value: the first period
    second = observe(settings, state, parse_metrics(exposition(200, 600, 250), read_at=2.0))  # +100 drafts, +100
    assert second["period"] == {"drafts": 100, "draft_tokens": 300, "accepted": 100} and not second["restarted"]
    assert second["acceptance_length"] == pytest.approx(2.0) and second["drop"] == pytest.approx(0.2)
    assert second["alarm"] and "DROP 20.0% > monitor.max_drop 10%" in second["message"]
    restarted = observe(settings, state, parse_metrics(exposition(250, 750, 400, started=1.8e9), read_at=3.0))
    assert restarted["restarted"] and restarted["period"]["drafts"] == 250  # grew past the old value: start time
    down = observe(settings, state, parse_metrics(exposition(10, 30, 14, started=1.8e9), read_at=4.0))
    assert down["restarted"] and down["period"] == {"drafts": 10, "draft_tokens": 30, "accepted": 14}
    record_promotion(state, 2.3, version=4)  # a new champion, measured by the engine at promotion
    third = observe(settings, state, parse_metrics(exposition(20, 60, 27, started=1.8e9), read_at=5.0))
    assert third["baseline"] == pytest.approx(2.3) and third["acceptance_length"] == pytest.approx(2.3)
    assert not third["alarm"] and json.loads(state.read_text())["promotion"]["version"] == 4
    idle = observe(settings, state, parse_metrics(exposition(20, 60, 27, started=1.8e9), read_at=6.0))
    assert idle["acceptance_length"] is None and not idle["alarm"]


def test_refusals():
    with pytest.raises(ValueError, match="spec_decode"):
        parse_metrics("process_start_time_seconds 1.0\nvllm:num_requests_running 0.0\n")
    with pytest.raises(ConfigError, match="monitor.max_drop"):
        MonitorSettings(max_drop=1.5)
    with pytest.raises(ConfigError, match="monitor.metrics_url"):
        MonitorSettings(metrics_url="127.0.0.1:8000/metrics")


@pytest.mark.parametrize(("value", "alarm"), [(1.9, False), (1.8, False), (1.79, True)])
def test_the_offline_drift_verdict_alarms_only_past_max_drop(value, alarm):
    from specdraft.freshness.monitor import judge_drift

    drop, raised, message = judge_drift(value, 2.0, 0.1, measure="tau", who="champion v3")
    assert drop == pytest.approx((2.0 - value) / 2.0) and raised is alarm
    assert message.startswith(f"champion v3 on this window's held-out slice: tau {value:.3f}, at promotion 2.000 (")
    assert message.endswith(": DROP > monitor.max_drop 10%)" if alarm else "%)")
    assert judge_drift(1.0, 0.0, 0.1, measure="tau", who="v1")[:2] == (0.0, False)  # no baseline: no drop
