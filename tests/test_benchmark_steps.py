"""The real-model benchmark's fairness (issue 32 item 4, ``benchmarks/real_model.py``): recipes of one and of
two stages train the same number of optimizer steps (``epoch_batches``: each epoch its first N batches, the LR
schedule sized to them), and held-out question files in any prompt format ingest reads become MT-Bench rows."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def toy_store(shipped_toy_target, tmp_path_factory):
    from benchmarks.toy_data import build_store

    store = tmp_path_factory.mktemp("bench-store") / "store"
    build_store(store, shipped_toy_target, 48, 1000, 96, 10, 48, [0, 1, 2])  # the EAGLE-3 features too
    return store


@pytest.mark.parametrize("recipe", ["eagle3", "beagle3"])  # one stage; two stages ([1, 1] of 2 epochs)
def test_every_recipe_trains_the_steps_it_is_given(recipe, shipped_toy_target, toy_store, tmp_path):
    from benchmarks.recipe_training import SHARED, train_recipe

    args = {k: None for k in SHARED} | {"threads": 1, "seed": 0, "epochs": 2, "max_tokens": 256, "lr": 1e-3,
                                        "warmup": None, "schedule": "cosine", "min_lr_ratio": 0.1, "sim_depth": 3,
                                        "val_fraction": 0.1, "epoch_batches": 3}
    r = train_recipe(args, recipe, str(toy_store), str(shipped_toy_target), str(tmp_path / recipe))
    assert r["optimizer_steps"] == 6 and r["batches_per_epoch"] == 3 < r["store_batches_per_epoch"], r
    assert [h["step"] for h in r["history"]] == [3, 6] and r["tokens_per_s"] > 0
    with pytest.raises(ValueError, match="batches per epoch asked"):
        train_recipe({**args, "epoch_batches": 10**6}, recipe, str(toy_store), str(shipped_toy_target),
                     str(tmp_path / f"{recipe}-too-many"))


def test_held_out_question_files_become_mt_bench_rows(tmp_path):
    from benchmarks.real_model import write_question_sets

    he = tmp_path / "humaneval.jsonl"
    he.write_text("".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\r\n    pass\r\n"}) + "\n"
                          for i in range(3)))
    mt = tmp_path / "mt_bench.jsonl"
    mt.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["first", "second"]}) + "\n")
    files = write_question_sets([he, mt], tmp_path / "out", 2)
    rows = {f.stem: [json.loads(x) for x in f.read_text().splitlines()] for f in files}
    assert [r["turns"] for r in rows["humaneval"]] == [["def f0():\n    pass"], ["def f1():\n    pass"]]
    assert rows["mt_bench"] == [{"question_id": 81, "category": "writing", "turns": ["first", "second"]}]


def test_a_result_is_written_with_the_host_facts_under_what_the_script_measured(tmp_path):
    import os

    from benchmarks.host import write_result

    path = write_result(tmp_path / "new" / "dir" / "r.json", {"benchmark": "x", "host": {"threads": 3}}, load={"n": 1})
    written = json.loads(path.read_text())
    assert written["benchmark"] == "x" and path.read_text().endswith("}\n")
    host = written["host"]
    assert host["cpus"] == os.cpu_count() and host["threads"] == 3 and host["load"] == {"n": 1}
    assert {"platform", "python", "cpu", "memory_gib", "versions", "loadavg_at_write"} <= set(host)
    # a result read back and written again keeps the host it was measured on, not this one's facts
    again = write_result(path, {**written, "benchmark": "y", "host": {**host, "cpus": -1}})
    assert json.loads(again.read_text())["host"]["cpus"] == -1 and json.loads(again.read_text())["benchmark"] == "y"
