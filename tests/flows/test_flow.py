"""The regenerate-and-train flow in-process (ephemeral Prefect API, local Ray, SQLite MLflow).

One sequence, because each run costs a minute: an injected train failure leaves valid
stores and no registered model; the rerun resumes training and registers a champion;
an identical rerun (through ``specdraft run``) skips every stage; a changed training config reuses the
stores. Each run's summary and report say what happened and where.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.regenerate_and_train import regenerate_and_train
from specdraft.store import validate
from specdraft.toy.conversations import generate_prompts
from tests.eval_records import check_tau, records_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": c}) + "\n"
                               for i, c in enumerate(generate_prompts(48, seed=21))))
    questions = root / "questions.jsonl"
    questions.write_text("".join(
        json.dumps({"question_id": i, "category": "toy", "turns": [m["content"] for m in c if m["role"] == "user"]}) + "\n"
        for i, c in enumerate(generate_prompts(3, seed=22))))
    return root, prompts, questions


def overrides(root: Path, target: Path, prompts: Path, questions: Path, *extra: str) -> list[str]:
    return [
        f"workdir={root / 'work'}", f"target.path={target}", f"data.prompts=[{prompts}]",
        "regenerate.max_new_tokens=24", "regenerate.batch_size=24", "features.samples_per_shard=32",
        "features.aux_layers=[0,1]",  # the default beagle3 reads EAGLE-3 features: the 2-layer target's two
        "train.epochs=[1,1]", "train.checkpoint_every=25", "train.reader.max_tokens=768", "train.log_every=1000",
        f"eval.questions=[{questions}]", "eval.settings.decode.max_new_tokens=16", "eval.settings.decode.depth=3",
        "eval.settings.decode.topk=3", "eval.settings.decode.total_tokens=8",
        f"tracking.uri=sqlite:///{root / 'mlflow.db'}", "tracking.experiment=flow-test",
        "register.model_name=flow-test-draft", "ray.num_cpus=2", *extra,
    ]


def test_flow_fails_cleanly_resumes_skips_and_reuses(local_ray, tiny_toy_target, run_files, caplog, capsys):
    root, prompts, questions = run_files
    config = str(Path(__file__).resolve().parents[2] / "configs" / "toy.yaml")
    args = overrides(root, tiny_toy_target, prompts, questions)
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")

    # 1. the train stage fails once (no retries): stores are complete and valid, nothing registered
    with pytest.raises(Exception, match="injected failure"):
        regenerate_and_train(config, args + ["retries=0", "fault.train_fail_at_step=26"])
    stores = [p for p in (root / "work" / "features").iterdir() if (p / "DONE").is_file()]
    assert len(stores) == 1 and validate(stores[0]).ok
    assert not client.search_model_versions("name='flow-test-draft'")
    train_dirs = list((root / "work" / "train").iterdir())
    assert len(train_dirs) == 1 and not (train_dirs[0] / "DONE").exists()

    # 2. rerun: upstream stages are skipped, training resumes from its checkpoint, a champion is registered
    caplog.set_level(logging.INFO)
    second = regenerate_and_train(config, args)
    assert all(r["skipped"] for r in second["regenerate"] + second["features"])
    assert not second["train"]["skipped"]
    steps = [json.loads(line)["step"] for line in Path(second["train"]["metrics_file"]).read_text().splitlines()
             if '"kind": "metrics"' in line]
    # checkpoint at step 25, failure after step 26: the resumed run re-does step 26 (never step 1) and the
    # killed run's row of it is dropped on resume (docs/guarantees.md: one row per step)
    assert steps.count(1) == 1 and steps.count(26) == 1 and steps.count(25) == 1, steps
    assert second["register"]["version"] == 1 and second["register"]["promoted"]
    assert str(client.get_model_version_by_alias("flow-test-draft", "champion").version) == "1"
    assert second["eval"]["lossless_mismatches"] == 0
    report = json.loads(Path(second["eval"]["report"]).read_text())  # the tau logged is the one its records imply
    assert second["eval"]["tau"] == {name: check_tau(block, records_of(report, name))
                                     for name, block in report["datasets"].items()} != {}

    parent = client.get_run(second["mlflow_parent_run"])
    exp = parent.info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {c.data.tags["specdraft.stage"] for c in children} == {"prepare", "regenerate", "features", "train",
                                                                     "eval", "register"}
    train_run = next(c for c in children if c.data.tags["specdraft.stage"] == "train")
    assert "sim_tau" in train_run.data.metrics and "loss" in train_run.data.metrics
    eval_run = next(c for c in children if c.data.tags["specdraft.stage"] == "eval")
    artifacts = {a.path for a in client.list_artifacts(eval_run.info.run_id, "plots")}
    assert "plots/alpha_per_depth.png" in artifacts
    assert any(k.startswith("tau.") for k in parent.data.metrics)
    # the run summary is the flow-run log's last word (what a deployment's worker output shows), and with the
    # report an artifact of the parent run; the report is in the workdir
    logged = [r.getMessage() for r in caplog.records
              if r.name == "prefect.flow_runs" and "run summary" in r.getMessage()]
    assert len(logged) == 1 and second["summary"] in logged[0]
    for needle in ("promoted to champion", f"run {parent.info.run_id}", f"sqlite:///{root / 'mlflow.db'}",
                   f"mlflow ui --backend-store-uri sqlite:///{root / 'mlflow.db'}", str(root / "work")):
        assert needle in second["summary"], needle
    assert Path(second["report"]).parent == root / "work" / "reports"
    assert f"report    {second['report']}" in second["summary"]
    assert {"report.html", "summary.txt"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    # the rates (issue 41 item 4): training ran in this run, rated against the matmul measured in it; the stages it
    # skipped have none (their time is the first run's)
    rates = second["rates"]
    assert list(rates["stages"]) == [f"train/{second['train']['key']}"] and len(rates["matmul"]) == 1
    row = re.search(r"^train\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+$", second["summary"], re.M)
    # training resumed from the failed try's checkpoint: the tokens of the steps this run logged, not the first try's
    assert row and 0 < int(row[1]) < second["train"]["metrics"]["state_tokens"], second["summary"]
    assert "resumed:" in second["summary"]
    assert float(row[3]) == pytest.approx(int(row[1]) / second["train"]["wall_s"], abs=0.06)
    assert re.search(r"^regenerate\s+skipped: done by an earlier run", second["summary"], re.M)
    assert "limit train: 6 x" in second["summary"] and "measured in this run" in " ".join(second["summary"].split())

    # 3. identical rerun, through the CLI: every stage skipped (no seconds: the earlier run's are not this one's),
    # nothing registered twice, and the register run records what it found
    capsys.readouterr()
    assert main(["run", "--config", config, *args]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^train\s+skipped\s+-\s+done by an earlier run", printed, re.M), printed
    assert re.search(r"^eval\s+skipped\s+-\s+done by an earlier run", printed, re.M), printed
    assert re.search(r"^train\s+skipped: done by an earlier run", printed, re.M) and "limit train:" not in printed
    assert "was registered by an earlier run (same trained draft)" in " ".join(printed.split())
    assert len(client.search_model_versions("name='flow-test-draft'")) == 1
    third_parent = re.search(r"^mlflow\s+run (\w+) ", printed, re.M).group(1)
    third_runs = {c.data.tags["specdraft.stage"]: c for c in
                  client.search_runs([exp], f"tags.mlflow.parentRunId = '{third_parent}'")}
    assert third_runs["register"].data.tags["gate.reason"].startswith("already registered (same trained draft) as v1")
    assert third_runs["register"].data.tags["gate.version"] == "1"
    assert "wall_s" not in third_runs["train"].data.metrics and "wall_s" in third_runs["register"].data.metrics

    # 4. a changed training config (here the cheapest: one epoch of the plain EAGLE recipe, trained in this
    # process) reuses the feature store and goes through the champion gate
    fourth = regenerate_and_train(config, args[:] + ["train.recipe=eagle", "train.epochs=[1]",
                                                     "train.scaling.num_workers=0"])
    assert all(r["skipped"] for r in fourth["features"]) and not fourth["train"]["skipped"]
    decision = fourth["register"]
    assert decision["version"] == 2
    assert decision["promoted"] == (decision["mean_tau"] > decision["champion_mean_tau"])
    tags = client.get_model_version("flow-test-draft", "2").tags
    assert tags["gate.promoted"] == str(decision["promoted"])
    # the report plots training, alpha, tau against the floor and the gate over both versions
    report = Path(fourth["report"]).read_text()
    assert report.count('<img src="data:image/png;base64,') == 4 and "no registered versions" not in report
