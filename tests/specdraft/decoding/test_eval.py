"""Question-set evaluation: MT-Bench-format files, multi-turn prompts, per-dataset / per-turn report."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from specdraft.configs.decode import DecodeConfig, PromptLookupConfig
from specdraft.configs.evaluation import EvalSettings
from specdraft.evaluation import replicas
from specdraft.evaluation.questions import dataset_name, load_question_sets, read_questions, render_prompt
from specdraft.evaluation.report import build_report
from specdraft.evaluation.run import run_eval
from specdraft.decoding.metrics import first_mismatch, summarize
from specdraft.models import build_draft, draft_config_from_target, save_draft
from specdraft.targets.loading import load_target_config, load_target_heads
from tests.eval_records import check_tau, records_of

QUESTIONS = [
    {"question_id": 81, "category": "math", "turns": ["What is 3 plus 4?", "And times 2?"]},
    {"question_id": 82, "category": "chat", "turns": ["Hello there."]},
]


@pytest.fixture(scope="module")
def question_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("questions")
    (root / "mt_bench").mkdir()
    a = root / "mt_bench" / "question.jsonl"
    a.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    b = root / "toyset.json"
    b.write_text(json.dumps([{"question_id": "t1", "category": "x", "turns": ["Count to five."]}]))
    return [a, b]


@pytest.fixture(scope="module")
def draft_dir(toy_target_dir, tmp_path_factory):
    heads = load_target_heads(toy_target_dir)
    torch.manual_seed(0)
    cfg = draft_config_from_target(load_target_config(toy_target_dir), "beagle")
    draft = build_draft(cfg, heads.embed, heads.lm_head)
    return save_draft(draft, tmp_path_factory.mktemp("draft") / "beagle")


def test_question_files(question_files, tmp_path):
    assert [dataset_name(f) for f in question_files] == ["mt_bench", "toyset"]
    qs = load_question_sets(question_files)
    assert [q["index"] for q in qs] == [0, 1, 2]
    assert [q["dataset"] for q in qs] == ["mt_bench", "mt_bench", "toyset"]
    assert len(load_question_sets(question_files, max_questions=1)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        read_questions(bad)


def record(**kw):
    base = dict(dataset="d", index=0, question_id=1, category="c", turn=1, rounds=0, round_tokens=0, new_tokens=0,
                wall_s=1.0, baseline_new_tokens=0, baseline_wall_s=1.0, depth_tried=[], depth_accepted=[],
                lossless=True, first_mismatch=None)
    return {**base, **kw}


def test_summary_definitions():
    rows = [
        record(rounds=4, round_tokens=10, new_tokens=11, depth_tried=[4, 3, 1], depth_accepted=[3, 1, 0],
               wall_s=2.0, baseline_new_tokens=11, baseline_wall_s=4.0),
        record(turn=2, rounds=1, round_tokens=2, new_tokens=3, depth_tried=[1, 1], depth_accepted=[1, 0],
               wall_s=1.0, baseline_new_tokens=3, baseline_wall_s=2.0, lossless=False, first_mismatch=2),
    ]
    s = summarize(rows)
    assert s["tau"] == 12 / 5 and s["alpha"] == [4 / 5, 1 / 4, 0.0]
    assert s["tokens_per_s"] == 14 / 3 and s["baseline_tokens_per_s"] == 14 / 6 and s["speedup"] == 2.0
    assert s["lossless_checked"] == 2 and s["lossless_mismatches"] == 1
    assert s["first_mismatches"] == [{"question_id": 1, "turn": 2, "position": 2}]
    assert s["tau_pld"] is None and s["tau_over_pld"] is None and s["pld_lossless"] is None  # no floor measured
    assert s["load_1m"] is None and s["load_1m_max"] is None  # no load sampled
    loaded = summarize([{**rows[0], "load_1m": 1.5}, {**rows[1], "load_1m": 2.5}, {**rows[1], "load_1m": None}])
    assert (loaded["load_1m"], loaded["load_1m_max"]) == (2.0, 2.5)  # the mean and the highest of those sampled
    report = build_report(rows, {})
    assert set(report["datasets"]["d"]["turns"]) == {"1", "2"}
    assert first_mismatch([1, 2, 3], [1, 2]) == 2 and first_mismatch([1], [1]) is None


def with_pld(row, **kw):
    fields = dict(rounds=0, round_tokens=0, new_tokens=0, wall_s=1.0, depth_tried=[], depth_accepted=[],
                  lossless=True, first_mismatch=None)
    return {**row, **{f"{k}_pld": v for k, v in {**fields, **kw}.items()}}


def test_summary_of_the_prompt_lookup_floor():
    rows = [
        with_pld(record(rounds=4, round_tokens=10, new_tokens=11, wall_s=2.0, baseline_new_tokens=11,
                        baseline_wall_s=4.0),
                 rounds=8, round_tokens=10, new_tokens=11, depth_tried=[5, 2], depth_accepted=[2, 1], wall_s=1.0),
        with_pld(record(turn=2, rounds=1, round_tokens=2, new_tokens=3, wall_s=1.0, baseline_new_tokens=3,
                        baseline_wall_s=2.0),
                 rounds=2, round_tokens=2, new_tokens=3, depth_tried=[2], depth_accepted=[0], wall_s=1.0,
                 lossless=False, first_mismatch=1),
    ]
    s = summarize(rows)
    assert s["tau"] == 12 / 5 and s["tau_pld"] == 12 / 10 and s["tau_over_pld"] == 2.0
    assert s["alpha_pld"] == [2 / 7, 1 / 2] and s["rounds_pld"] == 10 and s["new_tokens_pld"] == 14
    assert s["tokens_per_s_pld"] == 14 / 2 and s["speedup_pld"] == 3.0 and s["speedup"] == 2.0
    assert s["lossless_checked_pld"] == 2 and s["lossless_mismatches_pld"] == 1 and s["pld_lossless"] is False
    assert s["first_mismatches_pld"] == [{"question_id": 1, "turn": 2, "position": 1}]
    assert s["lossless_mismatches"] == 0  # the draft's own check is separate
    assert summarize(rows[:1])["pld_lossless"] is True
    with pytest.raises(AssertionError, match="prompt-lookup"):
        summarize([rows[0], record()])


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(mode="tree", depth=3, topk=4, total_tokens=12, max_new_tokens=24),
        DecodeConfig(mode="chain", gamma=3, max_new_tokens=24),
    ],
    ids=["tree", "chain"],
)
def test_run_eval_report(toy_target_dir, draft_dir, question_files, decode):
    report = run_eval(toy_target_dir, draft_dir, question_files, EvalSettings(decode=decode), progress=False)
    assert report["settings"]["decode"]["mode"] == decode.mode
    assert set(report["datasets"]) == {"mt_bench", "toyset"}
    mt = report["datasets"]["mt_bench"]
    for key in ("tau", "alpha", "rounds", "new_tokens", "tokens_per_s", "baseline_tokens_per_s", "speedup",
                "lossless_checked", "lossless_mismatches"):
        assert key in mt, key
    assert mt["lossless_checked"] == 3 and mt["lossless_mismatches"] == 0
    assert report["overall"]["lossless_mismatches"] == 0
    assert set(mt["turns"]) == {"1", "2"} and mt["turns"]["2"]["num_turns"] == 1
    assert len(mt["alpha"]) == decode.max_depth
    # tau and the floor (prompt lookup on the same turns, chain gamma = the draft's max depth, lossless too) are
    # what each block's records imply
    blocks = ((mt, records_of(report, "mt_bench")), (report["overall"], records_of(report)),
              (mt["turns"]["2"], records_of(report, "mt_bench", 2)))
    for block, records in blocks:
        tau, floor = check_tau(block, records), check_tau(block, records, "_pld")
        assert block["pld_lossless"] is True and block["lossless_checked_pld"] == len(records)
        assert block["tau_over_pld"] == pytest.approx(tau / floor)
    assert len(mt["alpha_pld"]) == decode.max_depth and report["settings"]["pld"]["enabled"] is True
    recs = report["records"]
    assert [(r["question_id"], r["turn"]) for r in recs] == [(81, 1), (81, 2), (82, 1), ("t1", 1)]
    assert all(r["tokens_sha_pld"] == r["tokens_sha"] for r in recs)  # greedy: the same answer every way
    assert recs[1]["prompt_tokens"] > recs[0]["prompt_tokens"] + recs[0]["new_tokens"] - 2  # history included
    json.dumps(report)  # JSON-able


def test_the_floor_can_be_switched_off_and_eval_says_its_progress(toy_target_dir, draft_dir, question_files, capsys):
    settings = EvalSettings(decode=DecodeConfig(mode="chain", gamma=2, max_new_tokens=8),
                            pld=PromptLookupConfig(enabled=False), max_questions=1, baselines="off", workers=1)
    report = run_eval(toy_target_dir, draft_dir, question_files, settings, progress=True)
    check_tau(report["overall"], report["records"])
    assert report["overall"]["tau_pld"] is None
    assert report["overall"]["tau_over_pld"] is None and "rounds_pld" not in report["records"][0]
    # progress as training says it (specdraft.progress): a line before the models load, one at the first
    # question and one at the last (2 questions, well under 30 s apart), with tokens/s and the ETA
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[specdraft] eval: 2 questions on 1 worker(s) (cpu), loading target + draft"
    assert [line.split(" tok/s ")[0] for line in lines[1:]] == ["[specdraft] eval 1/2 questions",
                                                                "[specdraft] eval 2/2 questions"]
    rates = [float(line.split(" tok/s ")[1].split()[0]) for line in lines[1:]]
    assert all(rate > 0 for rate in rates) and lines[2].endswith(" eta 0s")
    run_eval(toy_target_dir, draft_dir, question_files, settings, progress=False)
    assert capsys.readouterr().out == ""  # --quiet: nothing


def test_a_target_without_chat_template_is_prompted_with_the_fallback(templateless_target):
    from specdraft.targets.loading import load_tokenizer

    tokenizer = load_tokenizer(templateless_target)
    ids = render_prompt(tokenizer, [{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids) == f"{tokenizer.bos_token}### User:\nHi\n\n### Assistant:\n"


TIMINGS = {"wall_s", "draft_s", "verify_s", "baseline_wall_s", "tokens_per_s", "baseline_tokens_per_s", "speedup",
           "wall_s_pld", "draft_s_pld", "verify_s_pld", "tokens_per_s_pld", "speedup_pld", "workers", "baselines",
           "placement", "baseline_changed", "pld_changed",
           "load_1m", "load_1m_max"}


def without(obj, keys=TIMINGS):
    if isinstance(obj, dict):
        return {k: without(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [without(v, keys) for v in obj]
    return obj


@pytest.fixture
def serial_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count: both paths run identical kernels
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("parent", ["as-it-is", "threaded"])
def test_questions_in_parallel_give_the_serial_records(toy_target_dir, draft_dir, question_files, serial_threads,
                                                       parent):
    """Workers forked from this process when it has one thread, else from a forkserver that imported the evaluation
    once (a flow's process has threads: Prefect's, Ray's); both give the records of one worker."""
    decode = DecodeConfig(mode="tree", depth=3, topk=3, total_tokens=8, temperature=0.7, max_new_tokens=12)
    serial = run_eval(toy_target_dir, draft_dir, question_files,
                      EvalSettings(decode=decode, workers=1, baselines="off", seed=5), progress=False)
    done = threading.Event()
    other = threading.Thread(target=done.wait, daemon=True)
    if parent == "threaded":
        other.start()
    try:
        plan = replicas.plan_workers(EvalSettings(decode=decode, workers=2), 4)
        method = replicas._context(plan).get_start_method()
        assert method == ("forkserver" if threading.active_count() > 1 else "fork")
        spread = run_eval(toy_target_dir, draft_dir, question_files,
                          EvalSettings(decode=decode, workers=2, baselines="off", seed=5), progress=False)
    finally:
        done.set()
    assert serial["settings"]["workers"]["workers"] == 1 and spread["settings"]["workers"]["workers"] == 2
    assert spread["settings"]["workers"]["threads"] == 1
    assert without(spread) == without(serial)  # sampled: the seeds follow the question, not the worker
    assert len(serial["records"]) == 4 and serial["overall"]["rounds"] > 0


def test_the_cache_keeps_tokens_never_times_and_every_run_times_all_three(toy_target_dir, draft_dir, question_files,
                                                                       tmp_path, serial_threads):
    """Issue 41: vanilla and the floor are timed in every evaluation, beside the draft, turn by turn in rotating
    order; the cache keeps their tokens and counts (compared with the next evaluation's), never a time."""
    heads = load_target_heads(toy_target_dir)
    torch.manual_seed(1)
    other = save_draft(build_draft(draft_config_from_target(load_target_config(toy_target_dir), "eagle"),
                                   heads.embed, heads.lm_head), tmp_path / "eagle")
    settings = EvalSettings(decode=DecodeConfig(mode="chain", gamma=3, max_new_tokens=12), workers=1,
                            baselines=str(tmp_path / "cache"))
    first = run_eval(toy_target_dir, draft_dir, question_files, settings, progress=False)
    assert {k: first["settings"]["baselines"]["vanilla"][k] for k in ("written", "compared", "changed")} == {
        "written": 4, "compared": 0, "changed": 0}
    assert all(r["baseline_changed"] is None and r["pld_changed"] is None for r in first["records"])
    # interleaved: each turn ran the three decoders one after the other, the order rotating turn by turn
    orders = [r["order"] for r in first["records"]]
    assert all(sorted(o) == ["draft", "pld", "vanilla"] and o in (["draft", "vanilla", "pld"],
               ["vanilla", "pld", "draft"], ["pld", "draft", "vanilla"]) for o in orders), orders
    assert {o[0] for o in orders} == {"draft", "vanilla", "pld"}  # each one leads some turn
    assert all(isinstance(r["load_1m"], float) for r in first["records"]) and first["overall"]["load_1m"] >= 0
    # the files hold tokens and counts, no time; an old file's times (or one slipped in) are never read
    paths = {kind: first["settings"]["baselines"][kind]["file"] for kind in ("vanilla", "pld")}
    for kind, path in paths.items():
        data = json.loads(open(path).read())
        assert not [k for turn in data["turns"].values() for k in (turn.get("fields") or turn) if k.endswith("_s")
                    or "_s_" in k], kind
        for turn in data["turns"].values():
            turn.update({"wall_s": 1e-9, "baseline_wall_s": 1e-9})
            if kind == "pld":
                turn["fields"].update({"wall_s_pld": 1e-9})
        open(path, "w").write(json.dumps(data))
    second = run_eval(toy_target_dir, other, question_files, settings, progress=False)
    used = second["settings"]["baselines"]
    assert used["vanilla"]["compared"] == used["pld"]["compared"] == 4 and used["vanilla"]["written"] == 0
    assert used["vanilla"]["changed"] == used["pld"]["changed"] == 0 and used["vanilla"]["measured_at"] is not None
    assert all(r["baseline_changed"] is False and r["pld_changed"] is False for r in second["records"])
    for r in second["records"]:  # the times are this run's: the planted 1e-9 s is nowhere
        assert r["baseline_wall_s"] > 1e-6 and r["wall_s_pld"] > 1e-6 and r["wall_s"] > 1e-6
    for block in (second["overall"], second["datasets"]["mt_bench"]):
        assert block["speedup"] == pytest.approx(block["tokens_per_s"] / block["baseline_tokens_per_s"])
        assert block["baseline_tokens_per_s"] < 1e6 and block["speedup_pld"] < 1e3
    for a, b in zip(first["records"], second["records"]):  # the same vanilla answers and floor counts
        assert (a["baseline_new_tokens"], a["rounds_pld"], a["tokens_sha_pld"]) == (
            b["baseline_new_tokens"], b["rounds_pld"], b["tokens_sha_pld"])
        assert a["prompt_tokens"] == b["prompt_tokens"]
    assert second["overall"]["lossless_checked"] == 4 and second["overall"]["lossless_mismatches"] == 0
    # other settings (here the floor's gamma, via the chain length) get their own floor file, the same vanilla
    third = run_eval(toy_target_dir, other, question_files,
                     EvalSettings(decode=DecodeConfig(mode="chain", gamma=2, max_new_tokens=12), workers=1,
                                  baselines=str(tmp_path / "cache")), progress=False)
    assert third["settings"]["baselines"]["vanilla"]["compared"] == 4
    assert third["settings"]["baselines"]["pld"]["written"] == 4 and third["settings"]["baselines"]["pld"]["compared"] == 0
    # a cached answer that differs is counted and replaced; a turn whose prompt no longer renders the same is stale
    data = json.loads(open(paths["vanilla"]).read())
    data["turns"]["0:1"]["prompt"] = "something else"
    data["turns"]["1:1"]["tokens"] = data["turns"]["1:1"]["tokens"][:-1]
    open(paths["vanilla"], "w").write(json.dumps(data))
    fourth = run_eval(toy_target_dir, other, question_files, settings, progress=False)
    got = fourth["settings"]["baselines"]["vanilla"]
    assert (got["stale"], got["compared"], got["changed"], got["written"]) == (1, 3, 1, 2)
    assert [r["baseline_changed"] for r in fourth["records"]] == [None, False, True, False]
    rewritten = json.loads(open(paths["vanilla"]).read())["turns"]
    assert len(rewritten["1:1"]["tokens"]) == fourth["records"][2]["baseline_new_tokens"]  # this run's answer
    assert rewritten["0:1"]["prompt"] != "something else"
