"""The promotion decision (``specdraft.freshness.promotion``) on plain numbers, no MLflow: the floor, the champion,
the gate and which measure compares them — each case beside its neighbours (equal values, just above, just below).
"""

from __future__ import annotations

import pytest

from specdraft.configs.fresh import GateSettings
from specdraft.freshness.gate import decide
from specdraft.freshness.promotion import Champion, Measures, choose_measure, decide_promotion

GATE = GateSettings(enabled=True, margin=0.01, max_regression=0.02)


@pytest.mark.parametrize(("tau", "floor", "above"), [(1.72, 1.72, False), (1.7201, 1.72, True), (1.71, 1.72, False),
                                                      (1.1, None, None)])
def test_the_floor_is_beaten_strictly_and_none_measured_is_said(tau, floor, above):
    d = decide_promotion(Measures(tau=tau, floor=floor), champion=None)
    assert d.above_floor is above and d.promote is (above is not False)
    if above is False:
        assert d.reasons == [f"tau {tau:.4f} <= prompt-lookup floor tau_pld {floor:.4f}: the draft does not beat "
                             "training-free prompt lookup, not promoted"]
    elif above is None:
        assert d.reasons == ["no prompt-lookup floor measured", "no champion yet"]
    else:
        assert d.reasons == [f"tau {tau:.4f} > prompt-lookup floor {floor:.4f}", "no champion yet"]
    assert d.reason == "; ".join(d.reasons)


@pytest.mark.parametrize(("ours", "theirs", "promote"), [(2.41, 2.40, True), (2.40, 2.40, False), (2.39, 2.40, False)])
def test_the_champion_is_beaten_strictly_on_tau(ours, theirs, promote):
    d = decide_promotion(Measures(tau=ours, floor=1.7), Champion(value=theirs))
    assert d.promote is promote and d.compared_by == "tau"
    assert d.reasons[1] == f"tau {ours:.4f} {'>' if promote else '<='} champion {theirs:.4f}"


def test_a_champion_of_unknown_value_keeps_its_place_and_one_that_cannot_load_does_not():
    unknown = decide_promotion(Measures(tau=2.9, floor=1.7), Champion(value=None))
    assert not unknown.promote and unknown.reasons[1] == "champion tau unknown on these eval sets"
    gone = decide_promotion(Measures(tau=1.8, floor=1.7), Champion(value=None, unusable="v3: model.safetensors missing"))
    assert gone.promote and gone.reasons == [
        "tau 1.8000 > prompt-lookup floor 1.7000",
        "the champion could not be loaded, not compared (judged against the floor alone): v3: model.safetensors missing"]
    below = decide_promotion(Measures(tau=1.6, floor=1.7), Champion(unusable="gone"))  # the floor still refuses
    assert not below.promote and len(below.reasons) == 1


@pytest.mark.parametrize(("engine", "promote"), [(2.31, True), (2.30, False), (0.0, False)])
def test_the_engine_acceptance_compares_when_measured_whatever_tau_says(engine, promote):
    d = decide_promotion(Measures(tau=1.9, floor=1.7, engine_tau=engine), Champion(value=2.30))  # tau far below
    assert d.compared_by == "engine acceptance length" and d.promote is promote
    assert d.reasons[1] == f"engine acceptance {engine:.4f} {'>' if promote else '<='} champion 2.3000"
    assert not decide_promotion(Measures(tau=2.9, floor=1.7, engine_tau=None), Champion(value=3.0)).promote  # by tau
    assert decide_promotion(Measures(tau=1.6, floor=1.7, engine_tau=9.0), None).promote is False  # the floor is tau's


def test_one_measure_choice_for_every_caller():
    assert choose_measure(None).name == "tau" and choose_measure(None).of(2.0, None) == 2.0
    assert choose_measure(0.0).name == "engine acceptance length" and choose_measure(0.0).of(2.0, 0.0) == 0.0
    assert choose_measure(2.5).of(2.0, None) is None  # the champion not measured by the engine: unknown, not tau
    assert Measures(tau=2.0, engine_tau=2.5).measure == choose_measure(2.5)


def test_the_gate_replaces_the_eval_set_comparison_above_the_floor_only():
    passed = decide(GATE, window=(2.60, 2.40), regression=(2.37, 2.40), has_champion=True)  # -1.25 % >= -2 %
    refused = decide(GATE, window=(2.60, 2.40), regression=(2.30, 2.40), has_champion=True)  # -4.2 %
    champion = Champion(value=2.40)
    d = decide_promotion(Measures(tau=2.37, floor=1.3), champion, passed)  # the plain rule would refuse 2.37 <= 2.40
    assert d.promote and d.reasons == ["tau 2.3700 > prompt-lookup floor 1.3000", passed.reason]
    d = decide_promotion(Measures(tau=2.50, floor=1.3), champion, refused)  # the plain rule would promote
    assert not d.promote and d.reasons[1].startswith("gate refused")
    none_yet = decide(GATE, window=(2.6, None), regression=(2.5, None), has_champion=False)
    assert decide_promotion(Measures(tau=2.5, floor=1.3), None, none_yet).reasons[1] == (
        "no champion yet: nothing to protect")
    assert not decide_promotion(Measures(tau=1.2, floor=1.3), champion, passed).promote  # below the floor
    assert decide_promotion(Measures(tau=1.4, floor=1.3), Champion(unusable="gone"), refused).promote  # unusable


@pytest.mark.parametrize(("draft", "ngram", "champion_value", "promote"), [
    (1.20, 1.15, 1.40, True),    # faster than both, beats the champion
    (1.15, 1.15, 1.40, False),   # ties ngram: refused however well it beats the champion
    (1.20, 1.15, 1.60, False),   # the engine passes, the champion holds
    (0.95, None, 1.40, False),   # slower than no draft, ngram not measured
    (1.01, None, 1.40, True),    # above 1, ngram not measured: judged against 1 alone
])
def test_the_engine_rule_must_pass_beside_the_floor_and_the_champion(draft, ngram, champion_value, promote):
    from specdraft.freshness.engine_gate import engine_verdict

    best = {"draft": {"k": 2, "speedup": draft}, **({"ngram": {"k": 4, "speedup": ngram}} if ngram else {})}
    engine = engine_verdict(best)
    measures = Measures(tau=1.9, floor=1.6, engine_tau=1.5)
    without = decide_promotion(measures, Champion(value=champion_value))
    d = decide_promotion(measures, Champion(value=champion_value), engine=engine)
    assert d.promote is promote and d.promote is (without.promote and engine.passed)
    assert d.reasons[:-1] == without.reasons  # the engine's reason ends the decision's
    assert d.reasons[-1] == f"engine gate {'passed' if engine.passed else 'refused'}: {engine.reason}"
    assert decide_promotion(measures, Champion(value=champion_value), engine=None) == without
