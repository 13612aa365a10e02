"""The Ray Train adapter's driver side, without Ray: the worker config travels as a dict, a CPU worker's torch
threads follow the CPUs it holds, and a wrong schedule is refused before any cluster is reached."""

from __future__ import annotations

import pytest

from pipelines import train
from pipelines.configs import ClusterTrainConfig, ScalingSection
from specdraft.config import ConfigError, from_dict, to_dict
from specdraft.configs.train import TrainConfig
from specdraft.plan import build_plan


def test_worker_config_round_trips_through_a_dict():
    cfg = ClusterTrainConfig(recipe="dflash", epochs=3)
    job = train.WorkerConfig(train=cfg, plan=build_plan(cfg, aux_layers=[1], vocab=[0, 2]), target="/t", target_id="t",
                             out="/o", stores=["/s"], tracking={"uri": "u", "run_id": "r"})
    data = to_dict(job)
    assert isinstance(data["train"], dict) and from_dict(train.WorkerConfig, data) == job
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['vocabb'\]"):
        from_dict(train.WorkerConfig, {**data, "vocabb": None}, "worker config")


def test_a_wrong_epoch_count_is_refused_on_the_driver(tmp_path, monkeypatch):
    def no_cluster(*args, **kwargs):
        raise AssertionError("connect_ray reached")

    monkeypatch.setattr(train, "connect_ray", no_cluster)
    with pytest.raises(ConfigError, match="one epoch count per stage"):  # when the config is built, before the driver
        train.run_training(TrainConfig(recipe="beagle", epochs=[3]), [tmp_path], tmp_path, tmp_path / "out")


def test_a_cpu_worker_uses_the_cpus_it_holds_as_torch_threads():
    # Ray starts a worker with OMP_NUM_THREADS=1 unless told otherwise: the loop sets what the worker holds
    assert ScalingSection(cpus_per_worker=2).cpu_threads() == 2
    assert ScalingSection(cpus_per_worker=3.5).cpu_threads() == 3
    assert ScalingSection(cpus_per_worker=0.5).cpu_threads() == 1
    assert ScalingSection(cpus_per_worker=2, use_gpu=True).cpu_threads() is None
    assert ScalingSection(num_workers=0, cpus_per_worker=2).cpu_threads() is None  # the driver's own process
