"""A DFlash block draft end to end through the command line (issue 25's "Done means"): ``specdraft dump`` with
the EAGLE-3 aux layers, ``specdraft train --recipe dflash``, ``specdraft eval`` (one block drafted per round,
verified as a chain: lossless against the target's greedy output) and ``specdraft export`` (``--format auto``:
vLLM's speculators ``dflash``) on the tiny toy target, each a real command with real Ray. vLLM serving the
export is ``tests/serving/test_vllm_engine.py``'s.
"""

from __future__ import annotations

import json

import pytest
import yaml

from flows.cli import main
from pipelines.conversations import write_conversations
from specdraft.toy.conversations import generate_prompts, generate_conversations

pytestmark = pytest.mark.slow


def test_dflash_trains_evaluates_and_exports_through_the_cli(local_ray, tiny_toy_target, tmp_path, capsys):
    rows = [{"id": f"c{i}", "messages": m, "source": "test"} for i, m in enumerate(generate_conversations(24, seed=5))]
    prompts = write_conversations(tmp_path / "convs.parquet", rows)
    store = tmp_path / "store"
    assert main(["dump", "--target", str(tiny_toy_target), "--prompts", str(prompts), "--out", str(store), "--quiet",
                 "samples_per_shard=12", "max_length=96", "aux_layers=[0,1]"]) == 0
    capsys.readouterr()

    draft = tmp_path / "run"
    assert main(["train", "--store", str(store), "--target", str(tiny_toy_target), "--out", str(draft),
                 "--recipe", "dflash", "epochs=[1]", "min_steps=2", "checkpoint_every=0", "draft_layers=1",
                 "block_size=4", "reader.max_tokens=512", "scaling.num_workers=1"]) == 0
    capsys.readouterr()
    config = json.loads((draft / "draft" / "config.json").read_text())
    assert config["arch"] == "dflash" and config["block_size"] == 4 and config["num_layers"] == 1

    questions = tmp_path / "toy.jsonl"
    questions.write_text("".join(
        json.dumps({"question_id": i, "category": "toy", "turns": [m["content"] for m in c if m["role"] == "user"]})
        + "\n" for i, c in enumerate(generate_prompts(2, seed=11))))
    settings = tmp_path / "eval.yaml"
    settings.write_text(yaml.safe_dump({"decode": {"max_new_tokens": 12}, "warmup": False}))
    report = tmp_path / "report.json"
    assert main(["eval", "--target", str(tiny_toy_target), "--draft", str(draft / "draft"), "--questions",
                 str(questions), "--out", str(report), "--quiet", "--config", str(settings), "--mode", "chain"]) == 0
    capsys.readouterr()
    block = json.loads(report.read_text())["datasets"]["toy"]
    assert block["lossless_checked"] == block["num_turns"] >= 2 and block["lossless_mismatches"] == 0
    assert block["rounds"] > 0 and len(block["alpha"]) == 3  # a block of 4: anchor + 3 drafted tokens a round

    served = tmp_path / "served"
    assert main(["export", "--draft", str(draft / "draft"), "--target", str(tiny_toy_target), "--out", str(served)]) == 0
    printed = capsys.readouterr().out
    exported = json.loads((served / "config.json").read_text())
    assert exported["speculators_model_type"] == "dflash" and exported["block_size"] == 4, exported
    assert '"method": "dflash"' in printed and str(served) in printed, printed
