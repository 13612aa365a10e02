"""The promotion gate (specdraft/freshness/gate.py, issue 33 Deliver 5): a candidate that wins on the window but regresses
on the regression set is refused; one that wins by the margin and holds the regression set is promoted; every
comparison is in the record."""

from __future__ import annotations

import pytest

from specdraft.config import ConfigError
from specdraft.configs.fresh import GateSettings
from specdraft.freshness.gate import decide, describe_regression_set, regression_value
from specdraft.freshness.record import RegressionCounts

GATE = GateSettings(enabled=True, margin=0.01, max_regression=0.02)


def test_a_window_win_that_regresses_is_refused():
    d = decide(GATE, window=(2.60, 2.40), regression=(2.30, 2.40), has_champion=True)  # +8.3 %, -4.2 %
    assert not d.promote
    window, regression = d.comparisons
    assert window.passed and window.change == pytest.approx(0.2 / 2.4)
    assert not regression.passed and regression.change == pytest.approx(-0.1 / 2.4) and regression.bound == -0.02
    assert d.reason.startswith("gate refused") and "regression tau 2.3000 vs champion 2.4000 (-4.2%" in d.reason


def test_a_good_candidate_is_promoted_and_the_margin_counts():
    good = decide(GATE, window=(2.60, 2.40), regression=(2.37, 2.40), has_champion=True)  # -1.25 %: allowed
    assert good.promote and all(c.passed for c in good.comparisons)
    tie = decide(GATE, window=(2.41, 2.40), regression=(2.40, 2.40), has_champion=True)  # +0.4 % < margin 1 %
    assert not tie.promote and not tie.comparisons[0].passed
    engine = decide(GATE, window=(1.9, 1.8), regression=(None, None), has_champion=True,
                    measure="engine acceptance length")
    assert engine.promote and "no regression set measured" in engine.reason
    assert "engine acceptance length 1.9000" in engine.reason


def test_no_champion_promotes_and_no_window_refuses():
    assert decide(GATE, window=(2.0, None), regression=(2.0, None), has_champion=False).promote
    blind = decide(GATE, window=(None, None), regression=(2.5, 2.4), has_champion=True)
    assert not blind.promote and "not measured on the window" in blind.reason
    with pytest.raises(ConfigError, match="gate.max_regression"):
        GateSettings(max_regression=-0.1)
    with pytest.raises(ConfigError, match="gate.regression_max_questions"):
        GateSettings(regression_max_questions=-1)


def test_earlier_windows_are_one_more_dataset_of_the_regression_set():
    # two eval sets at mean 2.4, the earlier windows' slices at 1.8: the mean over the three datasets
    assert regression_value(2.4, 2, 1.8) == pytest.approx(2.2)
    assert regression_value(None, 0, 1.8) == 1.8  # no eval set: the earlier slices alone
    # the candidate holds the eval sets but loses the earlier traffic: the gate refuses
    d = decide(GATE, window=(2.6, 2.4), regression=(regression_value(2.4, 2, 1.5), regression_value(2.4, 2, 1.8)),
               has_champion=True)
    assert not d.promote and not d.comparisons[1].passed and d.comparisons[1].change == pytest.approx(-0.3 / 6.6)
    said = describe_regression_set(RegressionCounts(questions=37, windows=["2026-11-25", "2026-11-24"], over_cap=4,
                                                    max_questions=37), 2)
    assert said == ("regression set: the 2 eval sets (eval.questions) + 37 questions from 2 earlier windows' held-out "
                    "slices (ending 2026-11-24..2026-11-25, 4 more over gate.regression_max_questions 37)")
    assert describe_regression_set(RegressionCounts(), 1) == describe_regression_set(None, 1) == (
        "regression set: the 1 eval set (eval.questions) alone (no earlier traffic window's held-out slice kept yet)")


def test_the_regression_pair_uses_the_earlier_slices_only_when_both_drafts_were_measured_there():
    from specdraft.freshness.gate import regression_pair

    both = regression_pair(2.4, 2.5, 2, earlier=True, candidate_earlier=1.5, champion_earlier=1.8)
    assert both == ((regression_value(2.4, 2, 1.5), regression_value(2.5, 2, 1.8)), "")
    assert both[0][0] == pytest.approx((2.4 * 2 + 1.5) / 3)
    unknown = regression_pair(2.4, None, 2, earlier=True, candidate_earlier=1.5, champion_earlier=1.8)
    assert unknown == ((1.5, 1.8), "the champion's eval sets unknown: the earlier windows' slices alone")
    one_side = regression_pair(2.4, 2.5, 2, earlier=True, candidate_earlier=1.5)  # the champion not measured there
    assert one_side == ((2.4, 2.5), "the earlier windows' slices not measured on both drafts: the eval sets alone")
    assert regression_pair(2.4, 2.5, 2, earlier=False) == ((2.4, 2.5), "")  # no slice kept: nothing to say
