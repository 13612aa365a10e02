"""K chosen by the engine and the cost model (``specdraft.evaluation.engine_sweep``), and the gate's engine rule
(``specdraft.freshness.engine_gate``): pure functions over numbers, checked on synthetic timings (no vLLM needed)."""

from __future__ import annotations

import pytest

from specdraft.config import ConfigError, load
from specdraft.configs.evaluation import EngineSettings, EvalSettings
from specdraft.freshness.engine_gate import best_of, engine_verdict
from specdraft.evaluation.engine import sweep_ks
from specdraft.evaluation.engine_records import VANILLA_AGAIN, VANILLA_KEYS, EngineRun, vanilla_timing
from specdraft.evaluation.engine_sweep import (alpha_for_tau, best_k, cost_line, fit_cost, needed_tau, sweep_name,
                                               sweep_note, sweep_report, sweep_summary, tau_for_alpha)


def test_the_fastest_k_is_chosen_and_a_tie_goes_to_the_smaller_k():
    assert best_k({1: 50.0, 2: 61.0, 3: 60.9, 4: None}) == 2
    assert best_k({1: 50.0, 2: 61.0, 3: 61.0, 5: 20.0}) == 2  # equal speed: fewer drafted tokens
    assert best_k({3: 10.0}) == 3
    assert best_k({1: None, 2: None}) is None and best_k({}) is None


def test_the_settings_sweep_k_one_to_five_and_always_measure_our_decoders_k():
    assert EngineSettings().sweep_k == (1, 2, 3, 4, 5) and EngineSettings().ngram
    settings = load(EvalSettings, None, ["engine.sweep_k=[2,4]", "engine.speculative_tokens=3", "engine.ngram=false"])
    assert settings.engine.measured_k == (2, 3, 4)
    assert sweep_ks(settings.engine) == {"draft": [2, 3, 4]}  # ngram off: the draft alone
    block = EngineSettings(sweep_k=(1, 5, 7), speculative_tokens=3)
    assert sweep_ks(block, max_k=4) == {"draft": [1, 3], "ngram": [1, 3, 5, 7]}  # a block of 5: K <= 4
    for bad in ("engine.sweep_k=[]", "engine.sweep_k=[0,1]", "engine.sweep_k=[2,2]"):
        with pytest.raises(ConfigError, match="sweep_k"):
            load(EvalSettings, None, [bad])


def _points(c: float, v: float, taus: dict[int, float]) -> list[tuple[int, float, float]]:
    """(K, τ, speedup) as an engine timing them would see: vanilla at 100 tokens/s, a round of K drafts taking
    v + K·c target steps and emitting τ tokens."""
    vanilla_tps = 100.0
    out = []
    for k, tau in taus.items():
        round_s = (v + k * c) / vanilla_tps
        out.append((k, tau, (tau / round_s) / vanilla_tps))
    return out


def test_c_and_v_are_fitted_from_timings_at_several_k():
    taus = {1: 1.6, 2: 1.9, 3: 2.05, 4: 2.1, 5: 2.12}
    c, v = fit_cost(_points(0.17, 1.05, taus))
    assert c == pytest.approx(0.17) and v == pytest.approx(1.05)
    c, v = fit_cost(_points(0.02, 1.0, {2: 1.3, 5: 1.4}))  # two K suffice
    assert c == pytest.approx(0.02) and v == pytest.approx(1.0)
    assert fit_cost(_points(0.17, 1.05, {3: 2.0})) is None  # one K: no line
    assert fit_cost([(1, 1.5, None), (2, 1.8, 0.9)]) is None  # one K timed
    c, _ = fit_cost([(1, 1.5, None), *_points(0.1, 1.0, {2: 1.8, 3: 2.0})])  # an untimed K is left out
    assert c == pytest.approx(0.1)


def _explicit_speedup(alpha: float, k: int, c: float, v: float) -> float:
    """Expected tokens per round, summed over every outcome (j drafts accepted, then the target's token), over the
    round's cost in target steps."""
    tokens = sum((alpha ** j) * (1 - alpha) * (j + 1) for j in range(k)) + alpha ** k * (k + 1)
    return tokens / (v + k * c)


@pytest.mark.parametrize("k,c,v,speedup", [(3, 0.17, 1.0, 1.3), (3, 0.07, 1.0, 1.3), (1, 0.3, 1.1, 1.15),
                                           (5, 0.02, 1.02, 1.6)])
def test_the_needed_acceptance_matches_an_explicit_search(k, c, v, speedup):
    tau = needed_tau(speedup, k, c, v)
    alpha = alpha_for_tau(tau, k)
    grid = [i / 20000 for i in range(20001)]  # the smallest α on a fine grid whose explicit speedup reaches it
    found = next(a for a in grid if _explicit_speedup(a, k, c, v) >= speedup)
    assert alpha == pytest.approx(found, abs=1e-4)
    assert tau_for_alpha(alpha, k) == pytest.approx(tau, rel=1e-9)
    assert _explicit_speedup(alpha, k, c, v) == pytest.approx(speedup, rel=1e-6)
    assert _explicit_speedup(max(0.0, alpha - 0.01), k, c, v) < speedup  # a little less acceptance falls short


def test_an_acceptance_above_k_plus_one_is_unreachable():
    tau = needed_tau(1.3, 1, 0.7, 1.0)  # a draft costing 0.7 of a target step at K=1: 2.21 tokens a round
    assert tau > 2 and alpha_for_tau(tau, 1) is None
    assert all(_explicit_speedup(i / 100, 1, 0.7, 1.0) < 1.3 for i in range(101))
    assert alpha_for_tau(1.0, 3) == 0.0 and alpha_for_tau(4.0, 3) == pytest.approx(1.0, abs=1e-6)


def _run(timings: dict[str, tuple[float, float]], again_s: float | None = None,
         again: list[list[int]] | None = None) -> EngineRun:
    """Two prompts of 10 tokens each; vanilla in 2 s; per drafter name (seconds, accepted tokens over 8 drafts);
    ``again_s``: vanilla's second pass took that long (load 2.0), answering ``again`` (None: as the first)."""
    turns = [{"dataset": "mt", "index": 0}, {"dataset": "mt", "index": 1}]
    answers = [[1] * 10, [2] * 10]
    run = EngineRun(turns=turns, vanilla=answers, vanilla_s={"mt": 2.0}, engine={"name": "vllm"},
                    load_1m={"vanilla": {"mt": [1.0]}})
    if again_s is not None:
        run.vanilla_again, run.vanilla_again_s = again or answers, {"mt": again_s}
        run.load_1m[VANILLA_AGAIN] = {"mt": [2.0, 4.0]}
    for name, (seconds, accepted) in timings.items():
        run.spec[name], run.spec_s[name] = answers, {"mt": seconds}
        run.counters[name] = {"mt": {"num_drafts": 8, "num_accepted_tokens": accepted}}
        run.load_1m[name] = {"mt": [0.5]}
    return run


def test_the_sweep_reports_each_drafters_fastest_k_and_the_drafts_cost_model():
    run = _run({sweep_name("draft", 1): (2.5, 4), sweep_name("draft", 2): (2.2, 8),
                sweep_name("ngram", 1): (1.9, 4), sweep_name("ngram", 2): (1.6, 6)})
    sweep = sweep_report(run, {"draft": [1, 2], "ngram": [1, 2]}, greedy=True)
    assert sweep["k"] == [1, 2] and sweep["best_k"] == {"draft": 2, "ngram": 2}
    assert sweep["tokens_per_s_vanilla"] == 10.0 and sweep["draft"]["2"]["tokens_per_s"] == pytest.approx(20 / 2.2)
    assert sweep["best_speedup"]["ngram"] == pytest.approx(2.0 / 1.6)
    assert sweep["draft"]["1"]["acceptance_length"] == 1.5 and sweep["draft"]["2"]["acceptance_length"] == 2.0
    cost = sweep["cost"]["draft"]
    # τ / speedup: 1.5 / (2 / 2.5) = 1.875 at K=1, 2.0 / (2 / 2.2) = 2.2 at K=2: c = 0.325, v = 1.55
    assert cost["c"] == pytest.approx(0.325) and cost["v"] == pytest.approx(1.55) and cost["k"] == 2
    assert cost["for_target"]["tau"] == pytest.approx(1.3 * 2.2) and cost["for_target"]["reachable"]
    assert cost["for_ngram"]["tau"] == pytest.approx(1.25 * 2.2)
    text = "\n".join(sweep_summary(sweep))
    assert "engine by K (vanilla 10.0 tokens/s, load 1.00):" in text  # one vanilla pass: its own line
    assert sweep["tokens_per_s_vanilla_passes"] == [10.0] and sweep["vanilla_drift"] is None
    assert sweep["vanilla_changed"] is None and sweep["warnings"] == []
    rows = [line.split() for line in text.splitlines() if line.startswith("  2 |")]
    assert rows == [["2", "|", "2.00", "9.1", "0.91", "0.50", "|", "1.75", "12.5", "1.25", "0.50"]], text
    assert "fastest: draft K=2 (0.91x), ngram K=2 (1.25x)" in text
    assert "c 0.325, v 1.550; at K=2 the draft has τ 2.00, needs τ 2.86 (α " in text and "too weak" in text
    assert best_of(sweep) == {"draft": {"k": 2, "speedup": pytest.approx(2 / 2.2)},
                              "ngram": {"k": 2, "speedup": pytest.approx(1.25)}}


SWEEP = {sweep_name("draft", 1): (2.5, 4), sweep_name("draft", 2): (2.2, 8), sweep_name("ngram", 1): (1.9, 4),
         sweep_name("ngram", 2): (1.6, 6)}
KS = {"draft": [1, 2], "ngram": [1, 2]}


def test_every_speedup_divides_by_both_vanilla_passes_combined():
    """Vanilla timed again after the drafters, slower (3 s for the same 20 tokens): every speedup, the fastest K's
    and the cost model's divide by both passes' tokens/s together (40 tokens in 5 s), and the table shows each."""
    sweep = sweep_report(_run(SWEEP, again_s=3.0), KS, greedy=True)
    assert sweep["tokens_per_s_vanilla"] == pytest.approx(8.0)  # total tokens over total seconds, not a mean rate
    assert sweep["tokens_per_s_vanilla_passes"] == pytest.approx([10.0, 20 / 3])
    assert sweep["vanilla_drift"] == pytest.approx(-1 / 3) and sweep["vanilla_changed"] == 0
    assert sweep["load_1m_vanilla_passes"] == [1.0, 3.0] and sweep["load_1m_vanilla"] == pytest.approx(7 / 3)
    row = sweep["draft"]["2"]
    assert row["speedup"] == pytest.approx((20 / 2.2) / 8.0) and row["tokens_per_s_vanilla"] == pytest.approx(8.0)
    assert row["vanilla_drift"] == pytest.approx(-1 / 3)
    assert sweep["best_speedup"]["ngram"] == pytest.approx((20 / 1.6) / 8.0)
    one = sweep_report(_run(SWEEP), KS, greedy=True)  # the first pass alone: 10 tokens/s
    assert row["speedup"] == pytest.approx(one["draft"]["2"]["speedup"] * 10 / 8)
    cost = sweep["cost"]["draft"]  # τ / speedup: 1.5 / ((20 / 2.5) / 8) = 1.5 at K=1, 2.0 / ((20 / 2.2) / 8) = 1.76
    assert cost["c"] == pytest.approx(0.26) and cost["v"] == pytest.approx(1.24) and cost["k"] == 2
    assert cost["c"] == pytest.approx(one["cost"]["draft"]["c"] * 8 / 10)
    text = "\n".join(sweep_summary(sweep))
    assert ("engine by K (vanilla 10.0 / 6.7 tokens/s before / after the drafters, drift -33 %, load 1.00 / 3.00; "
            "speedups over both: 8.0 tokens/s):") in text, text
    rows = [line.split() for line in text.splitlines() if line.startswith("  2 |")]
    assert rows[0][4] == f"{(20 / 2.2) / 8:.2f}", rows


def test_a_drift_between_the_vanilla_passes_above_the_setting_is_a_warning():
    drift = "drift -33%, more than {}%): the machine's speed moved during the measurement"
    warned = sweep_report(_run(SWEEP, again_s=3.0), KS, greedy=True, drift_warn=0.33)
    assert len(warned["warnings"]) == 1 and drift.format(33) in warned["warnings"][0], warned["warnings"]
    assert warned["warnings"][0].startswith("vanilla ran at 10.0 tokens/s before the drafters and 6.7 after them")
    assert "every engine speedup is uncertain by about 33%" in warned["warnings"][0]
    assert "; warning: vanilla ran at 10.0" in sweep_note(warned)  # the run summary's engine line says it
    assert sweep_report(_run(SWEEP, again_s=3.0), KS, greedy=True, drift_warn=0.34)["warnings"] == []
    assert len(sweep_report(_run(SWEEP, again_s=3.0), KS, greedy=True)["warnings"]) == 1  # the default: 10 %
    faster = sweep_report(_run(SWEEP, again_s=1.0), KS, greedy=True)  # faster after: +100 %, warned alike
    assert faster["vanilla_drift"] == pytest.approx(1.0) and "drift +100%" in faster["warnings"][0]
    steady = sweep_report(_run(SWEEP, again_s=2.1), KS, greedy=True)  # -4.8 %: below the default
    assert steady["warnings"] == [] and "drift -5 %" in sweep_summary(steady)[0]
    assert "warning" not in sweep_note(steady)


def test_answers_the_second_vanilla_pass_changed_are_counted_and_warned_about():
    changed = _run(SWEEP, again_s=2.4, again=[[1] * 10, [3] * 14])  # the second prompt: another answer, 14 tokens
    sweep = sweep_report(changed, KS, greedy=True)
    assert sweep["vanilla_changed"] == 1 and sweep["vanilla_drift"] == pytest.approx(0.0)  # its own 24 tokens
    assert sweep["tokens_per_s_vanilla"] == pytest.approx(44 / 4.4)
    assert sweep["warnings"] == ["vanilla's second pass answered 1 of 2 prompts differently from its first "
                                 "(greedy: they should be equal)"], sweep["warnings"]
    assert sweep_report(changed, KS, greedy=False)["warnings"][0].endswith("(sampled)")
    both = sweep_report(_run(SWEEP, again_s=3.6, again=changed.vanilla_again), KS, greedy=True)["warnings"]
    assert [w[:24] for w in both] == ["vanilla ran at 10.0 toke", "vanilla's second pass an"], both


def test_vanilla_timing_per_dataset_and_across_the_json_between_the_processes():
    import json
    from dataclasses import asdict

    run = EngineRun(turns=[{"dataset": "mt"}, {"dataset": "he"}], vanilla=[[1] * 6, [2] * 4],
                    vanilla_s={"mt": 1.0, "he": 2.0}, vanilla_again=[[1] * 6, [2] * 4],
                    vanilla_again_s={"mt": 2.0, "he": 2.0}, load_1m={"vanilla": {"mt": [1.0]}})
    mt, he, both = vanilla_timing(run, ["mt"]), vanilla_timing(run, ["he"]), vanilla_timing(run)
    assert set(mt) == set(VANILLA_KEYS)
    assert mt["tokens_per_s_vanilla_passes"] == [6.0, 3.0] and mt["tokens_per_s_vanilla"] == 4.0
    assert mt["vanilla_drift"] == -0.5 and he["vanilla_drift"] == 0.0 and he["tokens_per_s_vanilla"] == 2.0
    assert both["tokens_per_s_vanilla"] == 20 / 7 and both["load_1m_vanilla_passes"] == [1.0, None]
    assert EngineRun(**json.loads(json.dumps(asdict(run)))) == run
    old = {k: v for k, v in asdict(run).items() if not k.startswith("vanilla_again")}  # a run from before: one pass
    one = vanilla_timing(EngineRun(**old))
    assert one["tokens_per_s_vanilla_passes"] == [10 / 3] and one["tokens_per_s_vanilla"] == 10 / 3
    assert one["vanilla_drift"] is None and one["vanilla_changed"] is None


def test_several_drafts_in_one_sweep_each_get_their_cost_model_beside_ngram():
    """``benchmarks/draft_vocab.py`` serves one draft per vocabulary size in one run: each is judged against the
    same ngram, as the one draft of an eval run is."""
    timings = {sweep_name("draft", 1): (2.5, 4), sweep_name("draft", 2): (2.2, 8),
               sweep_name("ngram", 1): (1.9, 4), sweep_name("ngram", 2): (1.6, 6)}
    one = sweep_report(_run(timings), {"draft": [1, 2], "ngram": [1, 2]}, greedy=True)
    both = sweep_report(_run({**timings, sweep_name("v4k", 1): (2.0, 4), sweep_name("v4k", 2): (2.0, 8)}),
                        {"draft": [1, 2], "v4k": [1, 2], "ngram": [1, 2]}, greedy=True)
    assert both["cost"]["draft"] == one["cost"]["draft"] and both["best_k"]["v4k"] == 1  # a tie: the smaller K
    cost = both["cost"]["v4k"]  # τ / speedup: 1.5 at K=1, 2.0 at K=2: c = 0.5, v = 1.0
    assert cost["c"] == pytest.approx(0.5) and cost["v"] == pytest.approx(1.0)
    assert cost["for_ngram"]["tau"] == pytest.approx(1.25 * 1.5) and both["cost"]["ngram"]["for_ngram"] is None


def test_a_cost_model_from_one_k_says_it_was_not_fitted():
    run = _run({sweep_name("draft", 3): (1.0, 8)})
    sweep = sweep_report(run, {"draft": [3]}, greedy=True)
    assert sweep["best_k"] == {"draft": 3} and sweep["cost"]["draft"]["c"] is None
    assert cost_line(sweep["cost"]["draft"]).startswith("cost model: not fitted")
    assert "ngram" not in "".join(sweep_summary(sweep)).split("fastest")[1]


def test_the_engine_rule_promotes_only_a_draft_faster_than_none_and_than_ngram():
    def verdict(draft, ngram=(5, 1.15)):
        best = {"draft": {"k": 2, "speedup": draft}}
        return engine_verdict({**best, **({"ngram": {"k": ngram[0], "speedup": ngram[1]}} if ngram else {})})

    ok = verdict(1.31)
    assert ok.passed and ok.draft_k == 2 and ok.ngram_k == 5 and "(needs > 1): pass" in ok.reason
    slow = verdict(0.84)  # issue 40's SmolLM2 numbers: slower than no draft and than ngram
    assert not slow.passed
    assert slow.reason == ("engine speedup 0.840x at K=2 vs 1 without a draft (needs > 1): FAIL; vs vLLM's ngram "
                           "1.150x at K=5 (needs >): FAIL")
    below_ngram = verdict(1.10)  # faster than none, slower than ngram
    assert not below_ngram.passed and "(needs > 1): pass" in below_ngram.reason
    assert "(needs >): FAIL" in below_ngram.reason
    assert not verdict(1.15).passed  # equal to ngram: not faster
    assert not verdict(1.0, ngram=(1, 0.9)).passed  # equal to no draft: not faster
    assert verdict(1.01, ngram=(1, 0.9)).passed
    alone = verdict(1.05, ngram=None)  # ngram not measured: above 1 alone, said
    assert alone.passed and alone.ngram_speedup is None and "not measured (engine.ngram=false)" in alone.reason
    assert not verdict(0.95, ngram=None).passed
    assert engine_verdict(None) is None and engine_verdict({}) is None  # no engine: the gate as without one
    unmeasured = engine_verdict({"draft": {"k": None, "speedup": None}, "ngram": {"k": 3, "speedup": 1.1}})
    assert not unmeasured.passed and "not measured" in unmeasured.reason
