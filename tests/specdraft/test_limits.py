"""A stage's limit (``specdraft.limits``): the matmul measured in this run and kept for this run only, the
parameters that cost FLOPs, and a rate's arithmetic against its limit."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import save_file

from specdraft import limits

TINY = dict(shape=(64, 32, 48), seconds=0.05)  # a measurement of a few milliseconds


def test_a_measurement_is_kept_for_its_run_and_never_read_by_another(tmp_path):
    first = limits.RunReferences.start(tmp_path)
    measured = first.matmul("cpu", "float32", 1, **TINY)
    assert measured.run == first.run and measured.flops > 0 and measured.shape == (64, 32, 48)
    # the same run asks again: the kept figure, not a new measurement (even one doctored to be absurd)
    data = json.loads((tmp_path / limits.FILE).read_text())
    data["matmul"][measured.key]["flops"] = 1e30
    (tmp_path / limits.FILE).write_text(json.dumps(data))
    assert first.matmul("cpu", "float32", 1, **TINY).flops == 1e30
    assert first.matmul("cpu", "float32", 2, **TINY).flops < 1e30  # another thread count: measured on its own
    # a later run over the same workdir never reads the earlier run's figure, whether it starts its file ...
    later = limits.RunReferences.start(tmp_path)
    assert later.run != first.run and later.read()["matmul"] == {}
    assert later.matmul("cpu", "float32", 1, **TINY).flops < 1e30
    # ... or finds the earlier run's file in place (a reader of another run's id sees nothing of it)
    (tmp_path / limits.FILE).write_text(json.dumps(data))
    other = limits.RunReferences(tmp_path, "another-run")
    assert other.read() == {"run": "another-run", "matmul": {}, "stages": {}}
    fresh = other.matmul("cpu", "float32", 1, **TINY)
    assert fresh.flops < 1e30 and fresh.run == "another-run"
    assert json.loads((tmp_path / limits.FILE).read_text())["run"] == "another-run"


def test_measure_restores_the_thread_count():
    before = torch.get_num_threads()
    limits.measure_matmul("cpu", "bfloat16", 1, **TINY)
    assert torch.get_num_threads() == before


def test_matmul_parameters_count_weights_and_the_head_once(tmp_path):
    weights = {"model.embed_tokens.weight": torch.zeros(100, 8), "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16), "model.norm.weight": torch.zeros(8)}
    tied = tmp_path / "tied"
    tied.mkdir()
    save_file(weights, str(tied / "model.safetensors"))
    assert limits.matmul_parameters(tied) == 16 * 8 + 8 * 16 + 100 * 8  # the embedding as the tied head; no norm
    untied = tmp_path / "untied"
    untied.mkdir()
    save_file({**weights, "lm_head.weight": torch.zeros(50, 8)}, str(untied / "model-00001-of-00002.safetensors"))
    save_file({"model.layers.1.mlp.up_proj.weight": torch.zeros(4, 8)}, str(untied / "model-00002-of-00002.safetensors"))
    assert limits.matmul_parameters(untied) == 16 * 8 + 8 * 16 + 50 * 8 + 4 * 8  # the embedding is a lookup
    assert limits.forward_flops(1000) == 2000 and limits.train_flops(1000, 7) == 42000
    (tied / "config.json").write_text(json.dumps({"hidden_size": 8, "intermediate_size": 16}))
    assert limits.mlp_shape(tied, "cpu") == (2048, 8, 16) and limits.mlp_shape(tied, "cuda") == (8192, 8, 16)
    assert limits.mlp_shape(untied, "cpu") is None  # no config: the default shape is measured


def test_stage_rate_arithmetic_and_what_it_refuses():
    reference = limits.Matmul(device="cpu", dtype="bfloat16", threads=2, shape=(2048, 576, 1536), flops=3.0e11,
                              seconds=1.0, load_1m=4.31, run="r")
    references = {reference.key: asdict(reference)}
    entry = {"tokens": 26312, "flops_per_token": 2 * 134_515_008, "counted": "2 x 134.5M target matmul params",
             "reference": reference.key, "load_1m": 12.5}
    rate = limits.stage_rate(entry, references, 330.9)
    assert rate.tokens_per_s == pytest.approx(26312 / 330.9)
    assert rate.limit_tokens_per_s == pytest.approx(3.0e11 / (2 * 134_515_008))
    assert rate.ratio == pytest.approx((26312 / 330.9) / (3.0e11 / (2 * 134_515_008)))
    assert rate.load_1m == 12.5
    assert rate.how == ("2 x 134.5M target matmul params at 300.0 GFLOP/s (bfloat16 2048x576x1536 matmul, 2 threads, "
                        "measured in this run at load 4.3)")
    assert limits.stage_rate({**entry, "tokens": 0}, references, 330.9) is None  # nothing to rate
    assert limits.stage_rate({**entry, "reference": "cpu/float32/2/2048x576x1536"}, references, 330.9) is None
    assert reference.key == "cpu/bfloat16/2/2048x576x1536"
