"""The engine measurement's settings and its refusals before anything runs (no vLLM needed)."""

from __future__ import annotations

import importlib.util

import pytest

from specdraft.config import ConfigError, load
from specdraft.decoding.eval import EvalSettings
from specdraft.preflight import check_engine
from specdraft.serving.engine import EngineSettings, engine_summary


def test_engine_settings_are_checked_when_loaded():
    settings = load(EvalSettings, None, ["engine.name=vllm", "engine.speculative_tokens=4"])
    assert settings.engine.enabled and settings.engine.speculative_tokens == 4
    assert not EvalSettings().engine.enabled  # off unless asked: no engine is started by default
    for bad, key in (("engine.name=sglang", "name"), ("engine.speculative_tokens=0", "speculative_tokens"),
                     ("engine.gpu_memory_utilization=1.5", "gpu_memory_utilization"), ("engine.max_gap=-1", "max_gap")):
        with pytest.raises(ConfigError, match=key):
            load(EvalSettings, None, [bad])


def test_an_engine_that_is_not_installed_is_refused_before_anything_runs(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"eval.settings.engine.name=vllm: vLLM is not installed .*=none"):
        check_engine(EngineSettings(name="vllm"), "eval.settings.engine.name")
    check_engine(EngineSettings())  # none: nothing to find


def test_the_engine_lines_of_an_eval_report():
    row = {"acceptance_length": 2.04, "tau_ours": 2.0, "gap": 0.02, "accepted_per_pos": [0.6, 0.3, 0.14],
           "tokens_per_s": 90.0, "tokens_per_s_vanilla": 60.0, "speedup": 1.5}
    report = {"engine": {"name": "vllm", "version": "0.32.0"}, "format": "vllm", "speculative_tokens": 3,
              "datasets": {"toy": row}, "overall": row, "warnings": ["toy: a gap"]}
    text = engine_summary(report)
    assert "engine vllm 0.32.0 (vllm export, chain K=3):" in text
    assert ("toy: acceptance length 2.040 vs ours 2.000 (gap +2.0%), accepted per position [0.60, 0.30, 0.14], "
            "90.0 tokens/s vs 60.0 without the draft (engine speedup 1.50)") in text
    assert text.splitlines()[-1] == "  warning: toy: a gap"
