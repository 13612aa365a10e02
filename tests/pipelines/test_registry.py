"""Champion gate on a real SQLite MLflow store: the prompt-lookup floor and the champion comparison.

A draft whose mean tau does not beat the mean tau of training-free prompt lookup measured in
the same evaluation is registered (tagged with the decision and both numbers) but never
promoted, even when there is no champion yet; above the floor the champion rule applies.
"""

from __future__ import annotations

import json

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipelines.registry import register_draft, version_history
from specdraft.freshness.promotion import Measures

ALIAS, KEY = "champion", "evalkey1"


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")  # one database: its migrations take seconds
    experiment = client.create_experiment("gate", artifact_location=(root / "artifacts").as_uri())
    draft = root / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"arch": "beagle"}))
    (draft / "model.safetensors").write_bytes(b"not read by the registry")
    return client, experiment, draft


@pytest.fixture
def store(mlflow_store, request):
    return (*mlflow_store, f"gate-{request.node.name}")  # a registered model per test


def register(store, mean_tau, mean_tau_pld, train_key, evaluate_champion=None, mean_engine_tau=None, key=KEY,
             engine=None, tags=None):
    client, experiment, draft, name = store
    run_id = client.create_run(experiment).info.run_id
    decision = register_draft(client, run_id=run_id, draft_dir=draft, model_name=name, alias=ALIAS, eval_key=key,
                              measures=Measures(tau=mean_tau, floor=mean_tau_pld, engine_tau=mean_engine_tau),
                              taus={"toy": mean_tau}, train_key=train_key, evaluate_champion=evaluate_champion,
                              engine=engine, tags=tags)
    return decision, run_id


def champion_version(store) -> str | None:
    client, name = store[0], store[3]
    try:
        return str(client.get_model_version_by_alias(name, ALIAS).version)
    except MlflowException:
        return None


def test_a_draft_below_the_floor_is_refused_even_without_a_champion(store):
    client = store[0]
    decision, run_id = register(store, mean_tau=1.58, mean_tau_pld=1.72, train_key="a")
    assert decision["version"] == 1 and not decision["promoted"] and decision["above_floor"] is False
    assert "prompt-lookup floor" in decision["reason"] and "1.5800" in decision["reason"]
    assert "1.7200" in decision["reason"]
    assert decision["tau_over_pld"] == pytest.approx(1.58 / 1.72)
    assert champion_version(store) is None
    tags = client.get_model_version(store[3], "1").tags  # registered as a version with both numbers
    assert tags[f"mean_tau.{KEY}"] == "1.580000" and tags[f"mean_tau_pld.{KEY}"] == "1.720000"
    assert tags["gate.promoted"] == "False" and tags["gate.mean_tau_pld"] == "1.72"
    assert client.get_run(run_id).data.tags["gate.reason"] == decision["reason"]
    # equal is not better
    decision, _ = register(store, mean_tau=1.72, mean_tau_pld=1.72, train_key="b")
    assert not decision["promoted"] and champion_version(store) is None


def test_a_draft_above_the_floor_is_promoted_and_then_must_beat_the_champion(store):
    client = store[0]
    decision, _ = register(store, mean_tau=2.4, mean_tau_pld=1.7, train_key="a")
    assert decision["promoted"] and decision["above_floor"] is True and champion_version(store) == "1"
    assert "no champion yet" in decision["reason"] and "> prompt-lookup floor" in decision["reason"]
    # above the floor but not above the champion
    decision, _ = register(store, mean_tau=2.2, mean_tau_pld=1.7, train_key="b")
    assert not decision["promoted"] and decision["champion_mean_tau"] == 2.4 and champion_version(store) == "1"
    assert "<= champion 2.4000" in decision["reason"]
    # above the champion but below this evaluation's floor: refused, and the champion is not re-evaluated
    calls = []
    decision, _ = register(store, mean_tau=2.5, mean_tau_pld=2.6, train_key="c", evaluate_champion=calls.append)
    assert not decision["promoted"] and "prompt-lookup floor" in decision["reason"] and champion_version(store) == "1"
    # above both
    decision, _ = register(store, mean_tau=2.9, mean_tau_pld=1.7, train_key="d")
    assert decision["promoted"] and decision["version"] == 4 and champion_version(store) == "4"
    assert calls == []
    # what the run report plots: each version's tau against the champion it met, oldest first
    history = version_history(client, store[3])
    rows = [(h["version"], h["mean_tau"], h["champion_mean_tau"], h["mean_tau_pld"], h["promoted"]) for h in history]
    assert rows == [(1, 2.4, None, 1.7, True), (2, 2.2, 2.4, 1.7, False), (3, 2.5, 2.4, 2.6, False),
                    (4, 2.9, 2.4, 1.7, True)]
    assert [h["champion"] for h in history] == [False, False, False, True]
    assert [h["version"] for h in version_history(client, store[3], ALIAS, limit=2)] == [3, 4]
    assert version_history(client, "no-such-model") == []


def test_without_a_floor_the_gate_is_the_champion_rule_and_says_so(store):
    decision, _ = register(store, mean_tau=1.1, mean_tau_pld=None, train_key="a")
    assert decision["promoted"] and decision["above_floor"] is None
    assert decision["reason"] == "no prompt-lookup floor measured; no champion yet"
    assert f"mean_tau_pld.{KEY}" not in store[0].get_model_version(store[3], "1").tags
    again, rerun = register(store, mean_tau=1.1, mean_tau_pld=None, train_key="a")  # same trained draft
    assert again["version"] == 1 and again["reason"].startswith("already registered (same trained draft) as v1")
    # the rerun's run records what it found, though it registers nothing
    tags = store[0].get_run(rerun).data.tags
    assert tags["gate.version"] == "1" and tags["gate.reason"] == again["reason"] and tags["gate.promoted"] == "True"
    assert tags["gate.version_run_id"] == store[0].get_model_version(store[3], "1").run_id != rerun
    assert len(store[0].search_model_versions(f"name='{store[3]}'")) == 1


def test_with_an_engine_the_gate_compares_the_engines_acceptance(store):
    """The engine serves the draft: champion and challenger are compared by what it measured, even where our
    decoder ranks them the other way; the floor is still our decoder's (prompt lookup measured beside it)."""
    client = store[0]
    decision, _ = register(store, mean_tau=2.4, mean_tau_pld=1.7, train_key="a", mean_engine_tau=2.3)
    assert decision["promoted"] and decision["compared_by"] == "engine acceptance length"
    assert client.get_model_version(store[3], "1").tags[f"mean_engine_tau.{KEY}"] == "2.300000"
    # a better tau of ours, a worse one served: not promoted
    decision, _ = register(store, mean_tau=2.6, mean_tau_pld=1.7, train_key="b", mean_engine_tau=2.2)
    assert not decision["promoted"] and decision["champion_mean_tau"] == 2.3 and champion_version(store) == "1"
    assert "engine acceptance 2.2000 <= champion 2.3000" in decision["reason"]
    # a worse tau of ours, a better one served: promoted
    decision, _ = register(store, mean_tau=2.35, mean_tau_pld=1.7, train_key="c", mean_engine_tau=2.5)
    assert decision["promoted"] and champion_version(store) == "3"
    # on other eval sets the champion is served again, and both of its numbers are kept
    calls = []
    decision, _ = register(store, mean_tau=2.5, mean_tau_pld=1.7, train_key="d", mean_engine_tau=2.45, key="other",
                           evaluate_champion=lambda uri: calls.append(uri) or (2.6, 2.4))
    assert calls == [f"models:/{store[3]}/3"] and decision["promoted"] and decision["champion_mean_tau"] == 2.4
    tags = client.get_model_version(store[3], "3").tags
    assert tags["mean_tau.other"] == "2.600000" and tags["mean_engine_tau.other"] == "2.400000"


def test_with_an_engine_a_draft_slower_than_none_or_than_ngram_is_never_promoted(store, tmp_path):
    """Issue 40's run: our decoder's τ beat the floor and there was no champion, yet vLLM served the draft slower
    than no draft and than its own ngram — refused, the numbers in the reason; a faster one is promoted and its
    fastest K is kept on the version for its serve commands."""
    from pipelines.registry import BEST_K_TAG, champion_exports
    from specdraft.freshness.engine_gate import engine_verdict

    def verdict(draft, k=2, ngram=1.15):
        return engine_verdict({"draft": {"k": k, "speedup": draft}, "ngram": {"k": 5, "speedup": ngram}})

    client = store[0]
    decision, _ = register(store, mean_tau=1.51, mean_tau_pld=1.49, train_key="a", engine=verdict(0.84))
    assert not decision["promoted"] and champion_version(store) is None and decision["above_floor"] is True
    assert decision["reason"].endswith("engine gate refused: engine speedup 0.840x at K=2 vs 1 without a draft "
                                       "(needs > 1): FAIL; vs vLLM's ngram 1.150x at K=5 (needs >): FAIL")
    assert decision["engine_gate"]["draft_speedup"] == 0.84 and decision["engine_best_k"] == 2
    decision, _ = register(store, mean_tau=1.51, mean_tau_pld=1.49, train_key="b", engine=verdict(1.12))
    assert not decision["promoted"] and "(needs > 1): pass; vs vLLM's ngram 1.150x" in decision["reason"]
    decision, _ = register(store, mean_tau=1.51, mean_tau_pld=1.49, train_key="c", engine=verdict(1.31, k=4),
                           tags={BEST_K_TAG: "4"})
    assert decision["promoted"] and champion_version(store) == "3" and "engine gate passed" in decision["reason"]
    assert client.get_model_version(store[3], "3").tags["gate.promoted"] == "True"
    assert champion_exports(client, store[3], ALIAS, tmp_path, local={3: {}})["best_k"] == 4
    # the floor still refuses first: the engine's verdict does not override it
    decision, _ = register(store, mean_tau=1.4, mean_tau_pld=1.49, train_key="d", engine=verdict(1.5))
    assert not decision["promoted"] and champion_version(store) == "3"


def test_the_window_gate_refuses_a_candidate_that_regresses_and_promotes_a_good_one(store):
    """``gate.enabled`` (issue 33 Deliver 5): the eval sets are the regression set, the window's held-out
    slice the other comparison; a candidate that wins on the window but loses 4 % on the regression set stays
    out, one that wins and holds is promoted; the comparisons are tags of the version and the run."""
    from specdraft.configs.fresh import GateSettings
    from specdraft.freshness.gate import decide

    settings = GateSettings(enabled=True, margin=0.01, max_regression=0.02)
    client, name = store[0], store[3]
    register(store, mean_tau=2.40, mean_tau_pld=1.3, train_key="champ")  # v1: the champion, no gate to pass
    asked = []

    def gate(window_candidate, window_champion):
        def call(champion_regression, champion_uri):
            asked.append((champion_regression, champion_uri))
            return decide(settings, window=(window_candidate, window_champion), regression=(2.30, champion_regression),
                          has_champion=champion_uri is not None)
        return call

    run_id = client.create_run(store[1]).info.run_id
    refused = register_draft(client, run_id=run_id, draft_dir=store[2], model_name=name, alias=ALIAS, eval_key=KEY,
                             measures=Measures(tau=2.30, floor=1.3), taus={"toy": 2.30}, train_key="regresses",
                             gate=gate(2.60, 2.40))
    assert asked == [(2.40, f"models:/{name}/1")]
    assert not refused["promoted"] and champion_version(store) == "1"
    assert "gate refused" in refused["reason"] and "regression tau 2.3000 vs champion 2.4000" in refused["reason"]
    assert [c["passed"] for c in refused["gate"]["comparisons"]] == [True, False]
    tags = client.get_model_version(name, "2").tags
    assert tags["gate.window.passed"] == "True" and tags["gate.regression.passed"] == "False"
    assert client.get_run(run_id).data.tags["gate.regression.change"].startswith("-0.04")
    good, _ = register(store, mean_tau=2.37, mean_tau_pld=1.3, train_key="good")  # no gate: plain rule refuses
    assert not good["promoted"]
    run_id = client.create_run(store[1]).info.run_id
    promoted = register_draft(client, run_id=run_id, draft_dir=store[2], model_name=name, alias=ALIAS, eval_key=KEY,
                              measures=Measures(tau=2.37, floor=1.3), taus={"toy": 2.37}, train_key="holds",
                              gate=lambda reg, uri: decide(settings, window=(2.60, 2.40), regression=(2.37, reg),
                                                           has_champion=uri is not None))
    assert promoted["promoted"] and champion_version(store) == str(promoted["version"])
    assert "gate passed" in promoted["reason"]
