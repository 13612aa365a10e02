"""A trained draft beats the prompt-lookup floor (README "Evaluation and the prompt-lookup floor"): on the toy
questions (``configs/data/toy_questions.jsonl``), in our lossless decoder, a toy draft trained briefly with the
default recipe (``beagle3``: Beagle over EAGLE-3 features) commits more tokens per target forward than prompt
lookup (Saxena 2023; the floor every report measures beside τ, with no draft at all), with the toy run's tree
and with a chain of 3.

Measured here (the draft of ``toy_drafts``, 3 epochs on 288 toy conversations): tree τ 2.55 against the floor's
1.35, chain τ 1.78 against 1.33. The bound, 1.2 times the floor, leaves room for the last bits of a training
run on other cores (other thread counts) and catches a draft that no longer learns what the target says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.configs.decode import DecodeConfig
from specdraft.configs.evaluation import EvalSettings
from specdraft.evaluation.run import run_eval
from tests.eval_records import check_tau

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # training the draft: about 100 s on 2 idle cores, 10 min under load

QUESTIONS = Path(__file__).resolve().parents[2] / "configs" / "data" / "toy_questions.jsonl"


@pytest.mark.parametrize("decode", [
    DecodeConfig(mode="tree", depth=5, topk=4, total_tokens=24, max_new_tokens=64),  # configs/toy.yaml's eval
    DecodeConfig(mode="chain", gamma=3, max_new_tokens=48),
], ids=["tree", "chain"])
def test_a_trained_toy_draft_beats_the_prompt_lookup_floor(shipped_toy_target, toy_drafts, decode):
    report = run_eval(shipped_toy_target, toy_drafts("beagle3"), [QUESTIONS],
                      EvalSettings(decode=decode, workers=1, baselines="off"), progress=False)
    block = report["datasets"]["toy_questions"]
    turns = sum(len(json.loads(line)["turns"]) for line in QUESTIONS.read_text().splitlines())
    assert block["num_turns"] == len(report["records"]) == turns  # every turn of every toy question answered
    assert block["lossless_mismatches"] == 0 and block["pld_lossless"] is True  # both decoders are the target's
    tau, floor = check_tau(block, report["records"]), check_tau(block, report["records"], "_pld")
    assert tau > 1.2 * floor, (decode.mode, tau, floor)
