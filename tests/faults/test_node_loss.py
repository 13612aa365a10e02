"""A worker node lost during the dump, training and eval, on a Ray cluster of three nodes on this machine
(``tests/ray_nodes.py``: a head without CPUs, two worker nodes of 2 CPUs; issue 43 item 3).

The dump: A replacement node joins (as an autoscaler would add one); the dump then either goes on (Ray
retries the lost node's tasks, and the pool works on with the actors it has) or fails (a lost actor is never
restarted: ``pipelines.cluster.ACTOR_POOL``) and its rerun — the flow's retry of the stage — resumes; both were seen
here, depending on what the node held when it went. Either way it ends with the store an uninterrupted dump
writes — complete shards kept, not rewritten; every sample once; the same arrays — checked as
``tests/pipelines/test_dump.py`` checks a dump killed on one node (``tests/dump_checks.py``).

Training (two DDP workers, one per node, ``max_failures=1``): Ray Train restarts the worker group on the node left
and the replacement, from the last checkpoint — checked as ``tests/faults/test_results.py`` and the FSDP resume
test of ``tests/pipelines/test_train.py`` check a worker failure on one node: the run resumed (params logged once),
not from scratch, at a checkpoint; the steps it re-does repeat the lost run's (loss, gradient norm, learning rate:
the same batches, the same state); every step logged once; the planned step count, no more.

Eval (two replicas, one per node): like the dump, it goes on or fails and is run again (the flow's retry); either way
the report is the uninterrupted one, timings aside: every question answered once, every count the same."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from pipelines.configs import DumpConfig, RayEvalConfig, ScalingSection
from pipelines.dump import dump_features
from pipelines.evaluate import evaluate_with_ray
from pipelines.train import run_training
from specdraft import store
from specdraft.configs.decode import DecodeConfig
from specdraft.configs.evaluation import EvalSettings
from specdraft.configs.reader import ReaderConfig
from specdraft.toy.conversations import generate_conversations
from tests.conftest import connect_local_ray, worker_pythonpath
from tests.dump_checks import assert_resumed_like, complete_shards
from tests.faults.test_results import config, small_store  # noqa: F401 (a fixture)
from tests.pipelines.test_dump import SHARDS, conversations
from tests.pipelines.test_evaluate import models, without_timings  # noqa: F401 (a fixture)
from tests.ray_nodes import ray_nodes

pytestmark = pytest.mark.slow

CFG = DumpConfig(samples_per_shard=4, max_length=96, batch_tokens=400, max_batch_size=6, num_actors=2)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, request):
    import ray

    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    with ray_nodes(tmp_path_factory.mktemp("nodes"), workers=2, cpus=2, head_cpus=0,
                   env_vars={"PYTHONPATH": worker_pythonpath(), "GLOO_SOCKET_IFNAME": "lo"}) as up:
        yield up
    if was_up:
        connect_local_ray(request)


def test_a_worker_node_lost_during_the_dump_resumes_with_nothing_lost_or_twice(nodes, tiny_toy_target, tmp_path):
    rows = conversations()
    reference_dir, out = tmp_path / "reference", tmp_path / "resumed"
    reference = dump_features(tiny_toy_target, rows, reference_dir, CFG, progress=False)
    results: list[dict | BaseException] = []

    def dump() -> None:
        try:
            results.append(dump_features(tiny_toy_target, rows, out, CFG, progress=False))
        except BaseException as err:  # noqa: BLE001 (the failure is one of the outcomes checked)
            results.append(err)

    worker = threading.Thread(target=dump, daemon=True)
    worker.start()
    deadline = time.monotonic() + 300
    while not store.list_shard_dirs(out)[0] if out.exists() else True:
        assert worker.is_alive() and time.monotonic() < deadline, "the dump ended before a node could be lost"
        time.sleep(0.2)
    kept = complete_shards(out)  # complete before the loss
    assert len(kept) < SHARDS
    nodes["kill"](next(iter(nodes["nodes"])))
    nodes["add"]()  # the replacement node, as an autoscaler adds one
    worker.join(600)
    assert not worker.is_alive(), "the dump hangs after losing a node, with a replacement there"
    summary = results[0]
    if isinstance(summary, BaseException):  # the stage failed: the flow's retry (here: the rerun) resumes it
        print(f"the dump failed on the lost node ({type(summary).__name__}); rerun")
        summary = dump_features(tiny_toy_target, rows, out, CFG, progress=False)
    else:  # Ray retried the lost node's tasks; the pool went on with the actors it had
        print("the dump went on without the lost node")
    assert_resumed_like(out, summary, reference_dir, reference, kept)


def in_background(call: Callable[[], Any]) -> tuple[threading.Thread, list]:
    """``call`` on a thread; its result (or the exception it raised) lands in the list."""
    results: list = []

    def run() -> None:
        try:
            results.append(call())
        except BaseException as err:  # noqa: BLE001 (a failure is one of the outcomes checked)
            results.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, results


def wait_for(done: Callable[[], bool], thread: threading.Thread, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert thread.is_alive(), f"it ended before {what}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.05)


def lose_a_worker_node(nodes) -> str:
    """A worker node alive now, killed (its id)."""
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    node = next(n for n in nodes["nodes"] if n in alive)
    nodes["kill"](node)
    return node


def train_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    return [r for r in rows if r["kind"] == "metrics"]


def test_a_worker_node_lost_during_training_resumes_from_the_last_checkpoint(nodes, tiny_toy_target, small_store,
                                                                              tmp_path):
    every = 5
    cfg = config(epochs=[3, 3], checkpoint_every=every, min_steps=36, max_failures=1,
                 reader=ReaderConfig(max_tokens=4096, val_fraction=0.0, seed=0),
                 scaling=ScalingSection(num_workers=2, cpus_per_worker=2))  # one rank per worker node
    out = tmp_path / "run"
    thread, results = in_background(lambda: run_training(cfg, [small_store], tiny_toy_target, out))
    wait_for(lambda: (out / "metrics.jsonl").exists() and len(train_rows(out)) > every + 1, thread,
             "a node could be lost after the first checkpoint")
    lost = lose_a_worker_node(nodes)
    before = train_rows(out)  # the lost run's rows: its ranks wait on the lost one now
    nodes["add"]()  # the replacement node, as an autoscaler adds one
    thread.join(600)
    assert not thread.is_alive(), "training hangs after losing a node, with a replacement there"
    summary = results[0]
    assert not isinstance(summary, BaseException), summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "params" for r in records) == 1  # resumed from a checkpoint, not started over
    steps = Counter(r["step"] for r in train_rows(out))
    assert all(n == 1 for n in steps.values()), sorted(k for k, n in steps.items() if n > 1)  # each step once
    planned = next(r for r in records if r["kind"] == "params")["train.total_steps"]
    assert sorted(steps) == list(range(1, planned + 1)) and summary["metrics"]["state_step"] == planned
    after = [r for r in train_rows(out) if r not in before]  # the resumed run's rows
    killed = {r["step"]: r for r in before}
    resumed_at = after[0]["step"] - 1  # the checkpoint it restored
    assert every <= resumed_at <= max(killed) and max(killed) - resumed_at <= every, (resumed_at, sorted(killed))
    redone = [r for r in after if r["step"] in killed]
    for again in redone:  # the same batches from the same state: the lost run's values
        for key in ("loss", "grad_norm", "lr"):
            assert again[key] == pytest.approx(killed[again["step"]][key], rel=1e-6, abs=1e-7), (again["step"], key)
    print(f"lost node at step {max(killed)}, resumed at checkpoint {resumed_at}, {len(redone)} steps redone, "
          f"{planned} planned")
    # the placement of the restarted group: the node left and the replacement, one rank each, not the lost one
    placed = summary["nodes"]
    assert sorted(r for n in placed for r in n["ranks"]) == [0, 1]
    assert lost not in {n["node"] for n in placed} and len(placed) == 2, placed


QUESTIONS = 6


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> list[Path]:
    """Six one-turn questions: enough that a node is lost while some are still to answer."""
    path = tmp_path_factory.mktemp("questions") / "six.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "six", "turns": [
        next(m["content"] for m in c if m["role"] == "user")]}) + "\n"
        for i, c in enumerate(generate_conversations(QUESTIONS, 13))))
    return [path]


def test_a_worker_node_lost_during_eval_answers_every_question_once(nodes, models, questions, capsys):
    target, draft = models
    settings = EvalSettings(decode=DecodeConfig(mode="tree", depth=3, topk=4, total_tokens=12, max_new_tokens=12),
                            seed=3, warmup=False)
    ray_cfg = RayEvalConfig(replicas=2, num_cpus=2)  # one replica per worker node
    reference = evaluate_with_ray(target, draft, questions, settings, ray_cfg, progress=False)
    capsys.readouterr()
    thread, results = in_background(lambda: evaluate_with_ray(target, draft, questions, settings, ray_cfg))
    printed: list[str] = []

    def answered_one() -> bool:
        printed.append(capsys.readouterr().out)
        return re.search(rf"eval [1-9]\d*/{QUESTIONS} ", "".join(printed)) is not None

    wait_for(answered_one, thread, "a node could be lost mid-eval")
    lose_a_worker_node(nodes)
    nodes["add"]()
    thread.join(600)
    assert not thread.is_alive(), "the eval hangs after losing a node, with a replacement there"
    report = results[0]
    if isinstance(report, BaseException):  # the stage failed: the flow's retry (here: the rerun) answers them all
        print(f"the eval failed on the lost node ({type(report).__name__}); rerun")
        report = evaluate_with_ray(target, draft, questions, settings, ray_cfg, progress=False)
    else:
        print("the eval went on without the lost node")
    assert sorted(r["index"] for r in report["records"]) == sorted(r["index"] for r in reference["records"])
    assert len(reference["records"]) == QUESTIONS == sum(n["questions"] for n in report["nodes"])  # each once
    assert without_timings(report) == without_timings(reference)  # every count the same (nodes: how it ran)
