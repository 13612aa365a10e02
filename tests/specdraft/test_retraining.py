"""Retrain only when it pays (specdraft/freshness/retraining.py, issue 33 Deliver 3): skip with no drift and little new
traffic, train on drift or on enough new rows, always under the default policy."""

from __future__ import annotations

import pytest

from specdraft.config import ConfigError
from specdraft.configs.fresh import RetrainSettings
from specdraft.freshness.retraining import decide_retraining

PAYS = RetrainSettings(policy="when_it_pays", min_new_share=0.2)


def test_skip_without_drift_or_new_data_and_train_on_either():
    quiet = decide_retraining(PAYS, new_rows=5, rows=100, drift=False)
    assert not quiet.train and "5 of 100 rows new" in quiet.reason and "training skipped" in quiet.reason
    fresh = decide_retraining(PAYS, new_rows=30, rows=100, drift=False)
    assert fresh.train and fresh.reason.startswith("new data: 30 of 100")
    drifted = decide_retraining(PAYS, new_rows=0, rows=100, drift=True, drift_reason="DROP 20.0%")
    assert drifted.train and drifted.reason == "drift: DROP 20.0%"
    first = decide_retraining(PAYS, new_rows=100, rows=100, drift=False, trained_before=False)
    assert first.train and first.reason.startswith("first night")
    assert decide_retraining(PAYS, new_rows=None, rows=None, drift=False).train  # no window: cannot tell
    assert decide_retraining(RetrainSettings(), new_rows=0, rows=100, drift=False).train  # policy always
    with pytest.raises(ConfigError, match="retrain.policy"):
        RetrainSettings(policy="sometimes")
