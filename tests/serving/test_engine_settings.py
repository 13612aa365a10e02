"""The engine measurement's settings and its refusals before anything runs (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from flows.cli import main, parse
from flows.options import command_config
from flows.preflight import check_run
from specdraft.config import ConfigError, load
from specdraft.configs.evaluation import EngineSettings, EvalSettings
from specdraft.evaluation.engine import engine_summary
from specdraft.preflight import check_engine, engine_model_len, target_positions

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "specdraft" / "toy" / "prebuilt"  # the shipped toy target: 1,024 positions


def test_engine_settings_are_checked_when_loaded():
    settings = load(EvalSettings, None, ["engine.name=vllm", "engine.speculative_tokens=4"])
    assert settings.engine.enabled and settings.engine.speculative_tokens == 4
    assert not EvalSettings().engine.enabled  # off unless asked: no engine is started by default
    for bad, key in (("engine.name=sglang", "name"), ("engine.speculative_tokens=0", "speculative_tokens"),
                     ("engine.gpu_memory_utilization=1.5", "gpu_memory_utilization"), ("engine.max_gap=-1", "max_gap")):
        with pytest.raises(ConfigError, match=key):
            load(EvalSettings, None, [bad])


def test_vanilla_is_timed_twice_unless_set_and_its_settings_are_checked():
    assert EngineSettings().vanilla_passes == 2 and EngineSettings().vanilla_drift_warn == 0.10
    quick = load(EvalSettings, None, ["engine.vanilla_passes=1", "engine.vanilla_drift_warn=0"])
    assert quick.engine.vanilla_passes == 1 and quick.engine.vanilla_drift_warn == 0
    for bad, key in (("engine.vanilla_passes=0", "vanilla_passes=0"), ("engine.vanilla_passes=3", "vanilla_passes=3"),
                     ("engine.vanilla_passes=-1", "vanilla_passes=-1"),
                     ("engine.vanilla_drift_warn=-0.01", "vanilla_drift_warn=-0.01")):
        with pytest.raises(ConfigError, match=f"^engine: {key}: must be"):
            load(EvalSettings, None, [bad])


def test_the_run_summary_keeps_vanillas_warnings_on_the_engine_line_not_among_the_drafts():
    """A drift between vanilla's passes is about the machine, not the served draft: the eval report's warnings hold
    both, the run summary's draft warnings only the gaps (the sweep's own go on its engine line)."""
    from pipelines.stages import engine_gap_warnings

    drift = "vanilla ran at 10.0 tokens/s before the drafters and 6.7 after them (...)"
    engine = {"warnings": ["toy: a gap", drift], "sweep": {"warnings": [drift]}}
    assert engine_gap_warnings(engine) == ["toy: a gap"]
    assert engine_gap_warnings({"warnings": ["toy: a gap"]}) == ["toy: a gap"]  # a report from before: all kept
    assert engine_gap_warnings({}) == []


def test_an_engine_that_is_not_installed_is_refused_before_anything_runs(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"eval.settings.engine.name=vllm: vLLM is not installed .*=none"):
        check_engine(EngineSettings(name="vllm"), "eval.settings.engine")
    check_engine(EngineSettings())  # none: nothing to find


def test_the_engine_lines_of_an_eval_report():
    row = {"acceptance_length": 2.04, "tau_ours": 2.0, "gap": 0.02, "accepted_per_pos": [0.6, 0.3, 0.14],
           "tokens_per_s": 90.0, "tokens_per_s_vanilla": 60.0, "speedup": 1.5, "load_1m": 1.25, "load_1m_vanilla": 0.5}
    report = {"engine": {"name": "vllm", "version": "0.32.0"}, "format": "vllm", "speculative_tokens": 3,
              "datasets": {"toy": row}, "overall": row, "warnings": ["toy: a gap"]}
    text = engine_summary(report)
    assert "engine vllm 0.32.0 (vllm export, chain K=3):" in text
    assert ("toy: acceptance length 2.040 vs ours 2.000 (gap +2.0%), accepted per position [0.60, 0.30, 0.14], "
            "90.0 tokens/s vs 60.0 without the draft (engine speedup 1.50, both timed in this run, load 1.25 / 0.50 "
            "without)") in text
    assert text.splitlines()[-1] == "  warning: toy: a gap"


def test_the_engines_own_ngram_drafter_is_our_floors_range_and_reported_from_its_counters():
    """vLLM's ``ngram`` prompt lookup rides in a request like an exported draft (our floor's n-gram range) and is
    reported from the engine's counters alone: acceptance length 1 + accepted / drafts, per-position rates,
    tokens/s with and without it, and its answers against the engine's own."""
    from specdraft.configs.decode import PromptLookupConfig
    from specdraft.evaluation.engine import ngram_drafter
    from specdraft.evaluation.engine_comparison import engine_only
    from specdraft.evaluation.engine_records import EngineRun

    assert ngram_drafter() == {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert ngram_drafter(PromptLookupConfig(max_ngram=5, min_ngram=2))["prompt_lookup_min"] == 2
    run = EngineRun(turns=[{"dataset": "mt", "index": 0}, {"dataset": "mt", "index": 1}, {"dataset": "he", "index": 0}],
                    vanilla=[[1, 2, 3, 4], [5, 6], [7, 8, 9]], vanilla_s={"mt": 3.0, "he": 1.5},
                    spec={"ngram": [[1, 2, 3, 4], [5, 0], [7, 8, 9]]}, spec_s={"ngram": {"mt": 2.0, "he": 3.0}},
                    counters={"ngram": {"mt": {"num_drafts": 4, "num_accepted_tokens": 2,
                                               "num_accepted_tokens_per_pos": [2, 0, 0]},
                                        "he": {"num_drafts": 0, "num_accepted_tokens": 0}}},
                    engine={"name": "vllm"}, load_1m={"vanilla": {"mt": [1.0, 2.0], "he": [4.0]}, "ngram": {"mt": [0.5]}})
    report = engine_only(run, "ngram", k=3)
    mt, he, overall = report["datasets"]["mt"], report["datasets"]["he"], report["overall"]
    assert mt["acceptance_length"] == 1.5 and mt["accepted_per_pos"] == [0.5, 0.0, 0.0]
    assert mt["tokens_per_s"] == 3.0 and mt["tokens_per_s_vanilla"] == 2.0 and mt["speedup"] == 1.5
    assert mt["engine_lossless"] == 1 and mt["prompts"] == 2  # the second answer differs from the engine's own
    assert he["acceptance_length"] is None and he["accepted_per_pos"] == [] and he["speedup"] == 0.5  # nothing drafted
    assert overall["acceptance_length"] == 1.5 and overall["prompts"] == 3 and overall["engine_lossless"] == 2
    # each speedup carries the load it was measured under, with and without the drafter (None: none sampled)
    assert (mt["load_1m"], mt["load_1m_vanilla"], he["load_1m"], he["load_1m_vanilla"]) == (0.5, 1.5, None, 4.0)
    assert overall["load_1m_vanilla"] == pytest.approx(7 / 3)
    assert overall["tokens_per_s"] == pytest.approx(9 / 5) and overall["tokens_per_s_vanilla"] == pytest.approx(9 / 4.5)


@pytest.fixture
def vllm_found(monkeypatch):
    """The engine counts as installed (pre-flight finds the package; nothing imports it)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))


def test_the_engine_context_is_the_targets_unless_set():
    assert json.loads((TOY / "config.json").read_text())["max_position_embeddings"] == 1024
    assert target_positions(TOY) == 1024
    assert EngineSettings().max_model_len is None  # no default above a small target's positions
    assert engine_model_len(EngineSettings(name="vllm"), 1024) == 1024  # derived from the target
    assert engine_model_len(EngineSettings(name="vllm", max_model_len=512), 1024) == 512  # below it: as set
    assert engine_model_len(EngineSettings(name="vllm", max_model_len=1024), 1024) == 1024
    assert engine_model_len(EngineSettings(name="vllm"), None) is None  # the target states none: vLLM reads it
    with pytest.raises(ConfigError, match=r"^engine.max_model_len=2048: above the target's "
                                          r"max_position_embeddings=1024"):
        engine_model_len(EngineSettings(name="vllm", max_model_len=2048), 1024)


def test_a_text_config_states_the_positions_of_a_multimodal_target(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096},
                                                      "max_position_embeddings": 77}))
    assert target_positions(tmp_path) == 4096
    (tmp_path / "config.json").write_text("{}")
    assert target_positions(tmp_path) is None


def test_eval_refuses_an_engine_context_above_the_target_before_anything_runs(vllm_found, tmp_path, capsys):
    draft = tmp_path / "draft"
    draft.mkdir()
    for name in ("config.json", "model.safetensors"):  # pre-flight reads names only: nothing is loaded
        (draft / name).write_text("{}")
    questions = tmp_path / "toy.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["Hi"]}) + "\n")
    out = tmp_path / "report.json"
    argv = ["eval", "--target", str(TOY), "--draft", str(draft), "--questions", str(questions), "--out", str(out),
            "--engine", "vllm", "engine.max_model_len=2048"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine.max_model_len=2048" in err[0] and "max_position_embeddings=1024" in err[0], err
    assert not out.exists()


def test_a_run_refuses_an_engine_context_above_the_toy_targets(vllm_found):
    base = ["run", "--config", str(REPO / "configs" / "toy.yaml"), "eval.settings.engine.name=vllm"]
    cfg, _ = command_config(parse(base + ["eval.settings.engine.max_model_len=2048"]))
    assert not cfg.target.path and cfg.target.toy.max_position_embeddings == 1024  # the toy target is built
    with pytest.raises(ConfigError, match=r"^eval.settings.engine.max_model_len=2048: above the target's"):
        check_run(cfg)
    cfg, _ = command_config(parse(base))  # unset: the toy target's 1,024, nothing refused
    check_engine(cfg.eval.settings.engine, "eval.settings.engine", positions=cfg.target.toy.max_position_embeddings)
