"""The Ray Train adapter's driver side, without Ray: the worker config travels as a dict and a wrong
schedule is refused before any cluster is reached."""

from __future__ import annotations

import pytest

from specdraft.config import ConfigError

from pipelines import train
from specdraft.recipes import TrainConfig


def test_worker_config_round_trips_through_a_dict():
    job = train.WorkerConfig(train=TrainConfig(recipe="hass", epochs=[2]), target="/t", target_id="t", out="/o",
                             stores=["/s"], aux_layers=[1], vocab=[0, 2], tracking={"uri": "u", "run_id": "r"})
    data = job.to_dict()
    assert isinstance(data["train"], dict) and train.WorkerConfig.from_dict(data) == job
    with pytest.raises(AssertionError, match="unknown worker config key"):
        train.WorkerConfig.from_dict({**data, "vocabb": None})


def test_a_wrong_epoch_count_is_refused_on_the_driver(tmp_path, monkeypatch):
    def no_cluster(*args, **kwargs):
        raise AssertionError("connect_ray reached")

    monkeypatch.setattr(train, "connect_ray", no_cluster)
    with pytest.raises(ConfigError, match="one epoch count per stage"):  # when the config is built, before the driver
        train.run_training(TrainConfig(recipe="beagle", epochs=[3]), [tmp_path], tmp_path, tmp_path / "out")
