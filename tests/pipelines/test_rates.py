"""The stages' rates (``pipelines.rates``): what each stage's tokens and FLOPs per token are, recorded in the run's
``rates.json`` after the stage, and the lines the summary shows from them — checked against the arithmetic written
out here, on records of a toy run (real safetensors and metrics.jsonl, a real matmul measurement)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipelines import rates
from pipelines.configs import RunConfig
from pipelines.records import Dumped, Regenerated, Trained
from specdraft.config import from_dict

TARGET_WEIGHTS = {"model.embed_tokens.weight": (128, 16), "model.layers.0.mlp.up_proj.weight": (32, 16),
                  "model.layers.0.mlp.down_proj.weight": (16, 32), "model.norm.weight": (16,)}
TARGET_PARAMS = 128 * 16 + 32 * 16 + 16 * 32  # the tied head counted once, the norm not
DRAFT_WEIGHTS = {"fc.weight": (16, 48), "layers.0.q_proj.weight": (16, 16), "norm.weight": (16,)}
DRAFT_PARAMS = 16 * 48 + 16 * 16


def model(path, weights):
    path.mkdir(parents=True)
    save_file({k: torch.zeros(*shape) for k, shape in weights.items()}, str(path / "model.safetensors"))
    return str(path)


def toy_run(tmp_path):
    """A toy run's records: one prompt file regenerated and dumped, a two-stage training (one step of 1 sub-step,
    two of 3: mean 7/3)."""
    target = model(tmp_path / "target", TARGET_WEIGHTS)
    (tmp_path / "target" / "config.json").write_text(json.dumps({"hidden_size": 16, "intermediate_size": 32}))
    draft = model(tmp_path / "train" / "draft", DRAFT_WEIGHTS)
    metrics = tmp_path / "train" / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(row) for row in [
        {"kind": "params", "train.recipe": "x"},
        {"kind": "metrics", "step": 1, "loss": 1.0, "loss_step1": 1.0},
        {"kind": "metrics", "step": 2, "loss": 1.0, "loss_step1": 1.0, "loss_step2": 1.0, "loss_step3": 1.0},
        {"kind": "metrics", "step": 3, "loss": 1.0, "loss_step1": 1.0, "loss_step2": 1.0, "loss_step3": 1.0},
        {"kind": "eval", "step": 3, "sim_tau": 2.0}]) + "\n")
    regenerated = Regenerated(key="r1", prompt="/data/chat.jsonl", conversations="/w/r", wall_s=20.0,
                              summary={"tokens_generated": 500, "prompt_tokens": 900})
    dumped = Dumped(key="f1", store="/w/f", summary={"tokens": 1500, "tokens_written": 1400}, wall_s=7.0)
    trained = Trained(key="t1", draft=draft, metrics={"state_tokens": 2800}, metrics_file=str(metrics), wall_s=40.0)
    return target, regenerated, dumped, trained


def test_after_stage_records_tokens_flops_and_this_runs_matmul(tmp_path):
    cfg = RunConfig(workdir=str(tmp_path / "work"))
    target, regenerated, dumped, trained = toy_run(tmp_path)
    run = rates.start_run(cfg.workdir)
    load = {"load_1m_mean": 3.5, "load_1m_max": 4.0}
    for stage, record in (("regenerate", regenerated), ("features", dumped), ("train", trained)):
        rates.after_stage(cfg, run, stage, record, target, load)
    rates.after_stage(cfg, run, "train", Trained(**{**trained.to_dict(), "key": "t0", "skipped": True}), target, load)
    rates.after_stage(cfg, run, "eval", trained, target, load)  # not a throughput stage
    got = rates.read_run(cfg.workdir, run)
    assert sorted(got["stages"]) == ["features/f1", "regenerate/r1", "train/t1"]  # nothing of the skipped, or eval
    # the defaults' one setting, measured once for all three, in the shape of the target's MLP
    assert list(got["matmul"]) == ["cpu/float32/1/2048x16x32"] and got["matmul"]["cpu/float32/1/2048x16x32"]["run"] == run
    s = got["stages"]
    assert (s["regenerate/r1"]["tokens"], s["regenerate/r1"]["flops_per_token"]) == (500, 2 * TARGET_PARAMS)
    assert (s["features/f1"]["tokens"], s["features/f1"]["flops_per_token"]) == (1400, 2 * TARGET_PARAMS)
    assert s["train/t1"]["tokens"] == 2800
    assert s["train/t1"]["flops_per_token"] == pytest.approx(6 * DRAFT_PARAMS * 7 / 3)
    assert "2.33 sub-steps (mean of 3 steps)" in s["train/t1"]["counted"]
    assert s["train/t1"]["load_1m"] == 3.5 and s["train/t1"]["reference"] == "cpu/float32/1/2048x16x32"
    # a training resumed from an earlier try's checkpoint: the share of the tokens its steps logged in this run
    resumed = tmp_path / "train" / "resumed.jsonl"
    rows = [json.loads(line) for line in Path(trained.metrics_file).read_text().splitlines()]
    now = time.time()
    rows[1]["time"], rows[2]["time"], rows[3]["time"] = now - 3600, now - 5, now - 1  # step 1 before this try
    resumed.write_text("\n".join(map(json.dumps, rows)) + "\n")
    again = Trained(**{**trained.to_dict(), "key": "t2", "metrics_file": str(resumed)})
    rates.after_stage(cfg, run, "train", again, target, load)
    entry = rates.read_run(cfg.workdir, run)["stages"]["train/t2"]
    assert entry["tokens"] == round(2800 * 2 / 3) and "resumed: 2 of 3 steps ran now" in entry["counted"]
    assert entry["flops_per_token"] == pytest.approx(6 * DRAFT_PARAMS * 7 / 3)  # all steps' sub-steps still
    # another setting is measured on its own: bf16 training on 2 threads
    bf16 = from_dict(RunConfig, {"workdir": cfg.workdir,
                                 "train": {"precision": "bf16", "scaling": {"cpus_per_worker": 2}}})
    assert rates.stage_setting(bf16, "train", trained) == ("cpu", "bfloat16", min(2, os.cpu_count()))
    assert rates.stage_setting(cfg, "train", trained) == ("cpu", "float32", 1)  # the default: fp32 on CPU
    # a stage that says its own setting (a vLLM engine's resolved dtype) is held against that one
    said = Regenerated(**{**regenerated.to_dict(), "summary": {**regenerated.summary, "dtype": "bfloat16"}})
    assert rates.stage_setting(cfg, "regenerate", said)[1] == "bfloat16"


def test_rate_lines_do_the_arithmetic_and_say_what_was_skipped(tmp_path):
    target, regenerated, dumped, trained = toy_run(tmp_path)
    flops = 5.0e10
    result = {
        "regenerate": [regenerated.to_dict()], "features": [dumped.to_dict()],
        "train": Trained(**{**trained.to_dict(), "skipped": True}).to_dict(),
        "rates": {"run": "r", "matmul": {"cpu/float32/1/2048x16x32": {
            "device": "cpu", "dtype": "float32", "threads": 1, "shape": [64, 32, 48], "flops": flops, "seconds": 1.0,
            "load_1m": 2.0, "run": "r"}},
            "stages": {"regenerate/r1": {"tokens": 500, "flops_per_token": 2 * TARGET_PARAMS, "counted": "2 x P",
                                         "reference": "cpu/float32/1/2048x16x32", "load_1m": 3.5}}}}
    lines = rates.rate_lines(result)
    assert [(x.stage, x.note) for x in lines] == [("regenerate", "chat.jsonl"), ("features", "chat.jsonl"),
                                                   ("train", "")]
    r = lines[0].rate
    assert (r.tokens, r.wall_s) == (500, 20.0)
    assert r.tokens_per_s == pytest.approx(25.0)
    assert r.limit_tokens_per_s == pytest.approx(flops / (2 * TARGET_PARAMS))
    assert r.ratio == pytest.approx(25.0 / (flops / (2 * TARGET_PARAMS)))
    assert lines[1].rate is None and lines[1].why == "limit not measured in this run"  # the dump has no entry
    assert lines[2].rate is None and lines[2].why.startswith("skipped: done by an earlier run")
    # a record of another run's rates: nothing is rated
    assert all(x.rate is None for x in rates.rate_lines({**result, "rates": {}}))


def test_the_stage_benchmark_reads_the_runs_own_rates(tmp_path):
    """``benchmarks/real_model_stages.py`` shows a finished run's rates as its summary does (one implementation): a
    stage the last run did not record (an earlier run's DONE) has no rate."""
    from benchmarks.real_model_stages import stage_rows

    cfg = RunConfig(workdir=str(tmp_path / "work"))
    target, regenerated, dumped, trained = toy_run(tmp_path)
    run = rates.start_run(cfg.workdir)
    for stage, record in (("regenerate", regenerated), ("train", trained)):  # the dump: done by an earlier run
        rates.after_stage(cfg, run, stage, record, target, {"load_1m_mean": 2.5})
        (tmp_path / "work" / stage / record.key).mkdir(parents=True)
        (tmp_path / "work" / stage / record.key / "DONE").write_text(json.dumps(record.to_dict()))
    (tmp_path / "work" / "features" / "f1").mkdir(parents=True)
    (tmp_path / "work" / "features" / "f1" / "DONE").write_text(json.dumps(dumped.to_dict()))
    rows = stage_rows(tmp_path / "work")
    assert rows["rates_run"] == run
    by_stage = {r["stage"]: r for r in rows["rates"]}
    flops = rows["matmul"]["cpu/float32/1/2048x16x32"]["flops"]
    assert by_stage["regenerate"]["tokens_per_s"] == round(500 / 20.0, 1)
    assert by_stage["regenerate"]["limit_tokens_per_s"] == round(flops / (2 * TARGET_PARAMS), 1)
    assert by_stage["train"]["ratio"] == round((2800 / 40.0) / (flops / (6 * DRAFT_PARAMS * 7 / 3)), 4)
    assert by_stage["features"] == {"stage": "features", "file": "chat.jsonl", "why": "limit not measured in this run"}


def test_a_stage_record_saying_auto_is_held_at_the_dtype_auto_resolves_to(tmp_path):
    """The regenerate stage's summary says its dtype as set (``auto``, ``bfloat16``): the limit uses the dtype the
    stage computed in, never the word ``auto``; a record without a dtype falls back to the run's settings."""
    from types import SimpleNamespace

    cfg = RunConfig(workdir=str(tmp_path / "work"))
    expected = "bfloat16" if torch.cuda.is_available() else "float32"
    for said, dtype in (({"dtype": "auto"}, expected), ({"dtype": "bfloat16"}, "bfloat16"), ({}, expected)):
        record = SimpleNamespace(summary={**said, "threads": 1})
        assert rates.stage_setting(cfg, "regenerate", record)[1:] == (dtype, 1)
