"""The run summary (``pipelines.summary``) and the one-page report (``pipelines.report``) from stage records.

The summary: a skipped stage shows no seconds (its DONE file's are the earlier run's), tau stands beside the
floor, a speedup below 1 is explained by the measured cost of a round, the engine's acceptance shows when
measured (a gap is a warning), the register row and everything a person needs to find the results. The
report: opened in a real headless Chromium (Debian's ``chromium``), its plots decode and the page is not blank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from pipelines.records import Dumped, Evaluated, Prepared, PromptFile, Regenerated, Registered, Trained
from pipelines.report import write_run_report
from pipelines.summary import Place, render_text, summarize_run

SERVE = "vllm serve /t --host 127.0.0.1 --speculative-config '{\"method\": \"eagle3\"}'"


def records(tmp_path: Path, *, engine: dict[str, float] | None = None, registered: Registered | None = None,
            engine_warnings: list[str] | None = None, engine_speedup: dict[str, float] | None = None) -> dict:
    """The dict the flow returns: regenerate ran now, features and train were done by an earlier run
    (their DONE files hold that run's 50.8 s and 150.9 s), eval and register ran now."""
    prompt = "/data/toy_prompts.jsonl"
    registered = registered or Registered(
        model_name="toy-draft", version=3, run_id="r3", mean_tau=2.65, champion_version=2, champion_mean_tau=2.41,
        mean_tau_pld=1.37, tau_over_pld=1.93, above_floor=True, promoted=True, alias="champion",
        reason="tau 2.6500 > prompt-lookup floor 1.3700; tau 2.6500 > champion 2.4100",
        exports={"speculators": "/w/export/k/speculators"}, serving_champion=3, serve={"vllm": SERVE}, wall_s=1.25)
    return {
        "prepare": Prepared(target="/t", target_id="tid", prompts=[PromptFile(path=prompt, digest="d")],
                            wall_s=0.04).to_dict(),
        "regenerate": [Regenerated(key="r", prompt=prompt, conversations="/w/r", summary={}, wall_s=12.3).to_dict()],
        "features": [Dumped(key="f", store="/w/f", summary={}, wall_s=50.8, skipped=True).to_dict()],
        "train": Trained(key="t", draft="/w/d", metrics={}, metrics_file=str(tmp_path / "metrics.jsonl"), wall_s=150.9,
                         skipped=True).to_dict(),
        "eval": Evaluated(key="e", eval_key="ek", report=str(tmp_path / "report.json"), tau={"toy": 2.65},
                          mean_tau=2.65, tau_pld={"toy": 1.37}, tau_over_pld={"toy": 1.93}, mean_tau_pld=1.37,
                          engine_tau=engine or {}, engine_warnings=engine_warnings or [],
                          engine_speedup=engine_speedup or {}, wall_s=7.5).to_dict(),
        "register": registered.to_dict(),
        "mlflow_parent_run": "abc123",
    }


EVAL_REPORT = {"datasets": {"toy": {"tau": 2.65, "tau_pld": 1.37, "speedup": 0.17, "alpha": [0.81, 0.62, 0.4, None]}}}
PLACE = Place(workdir="/w", report="/w/reports/night.html", tracking_uri="sqlite:////srv/mlflow.db",
              experiment_id="4", run_id="abc123")


A, B = "a" * 56, "b" * 56  # two Ray node ids


def test_summary_says_which_node_ran_which_part_of_each_stage(tmp_path):
    """The stages' placement (``nodes`` of the regenerate and dump summaries, the train and eval records) is one
    row per stage; a stage without one (run before nodes were recorded, or not on Ray) has none."""
    result = records(tmp_path)
    result["regenerate"][0]["summary"]["nodes"] = [{"node": A, "ip": "10.0.0.1", "conversations": 9},
                                                   {"node": B, "ip": "10.0.0.2", "conversations": 7}]
    result["train"]["nodes"] = [{"node": A, "ip": "10.0.0.1", "ranks": [0]}, {"node": B, "ip": "10.0.0.2", "ranks": [1]}]
    text = render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))
    block = " ".join(text.split("placement (")[1].split("\n\n")[0].split())  # prose is wrapped
    assert block == ("the Ray node that ran each part: id, address, parts) regenerate toy_prompts.jsonl: aaaaaaaaaaaa "
                     "(10.0.0.1) 9 conversations; bbbbbbbbbbbb (10.0.0.2) 7 conversations train aaaaaaaaaaaa "
                     "(10.0.0.1) ranks 0; bbbbbbbbbbbb (10.0.0.2) ranks 1 (an earlier run)"), block  # features, eval: none
    assert "placement" not in render_text(summarize_run("toy", records(tmp_path), PLACE, EVAL_REPORT))


def test_summary_says_what_happened_and_where(tmp_path):
    text = render_text(summarize_run("toy", records(tmp_path), PLACE, EVAL_REPORT))
    lines = text.splitlines()

    def row(pattern: str) -> bool:
        return re.search(f"^{pattern}$", text, re.M) is not None

    # a stage done by an earlier run shows no seconds: not that run's 50.8 or 150.9
    assert row(r"features\s+skipped\s+-\s+toy_prompts\.jsonl")
    assert row(r"train\s+skipped\s+-\s+done by an earlier run.*")
    assert "50.8" not in text and "150.9" not in text
    assert row(r"regenerate\s+done\s+12\.3\s+toy_prompts\.jsonl") and row(r"register\s+done\s+1\.2")
    # tau beside the floor and the speedup (no engine measured: no engine column), a speedup below 1
    # explained by the round's measured cost
    assert row(r"toy\s+2\.65\s+1\.37\s+1\.93\s+0\.17") and row(r"dataset\s+tau\s+floor\s+tau/floor\s+speedup\s+\(.*")
    flat = " ".join(text.split())  # prose is wrapped
    assert "speedup 0.17 < 1 on toy" in flat and "took as long as 15.6 plain decoding steps" in flat  # 2.65 / 0.17
    # a report whose speedup carries the load it was measured under (issue 41) shows it beside the speedup
    loaded = {"datasets": {"toy": {**EVAL_REPORT["datasets"]["toy"], "load_1m": 2.31}}}
    text = render_text(summarize_run("toy", records(tmp_path), PLACE, loaded))
    assert re.search(r"^toy\s+2\.65\s+1\.37\s+1\.93\s+0\.17\s+2\.31$", text, re.M), text
    assert re.search(r"^dataset\s+tau\s+floor\s+tau/floor\s+speedup\s+load\s+\(.*load average", text, re.M)
    from pipelines.report import render_report

    html = render_report(summarize_run("toy", records(tmp_path), PLACE, loaded), training=[], eval_report=None, history=[])
    assert "<th>speedup</th><th>load (1 min)</th>" in html and "2.31" in html
    assert "load (1 min)" not in render_report(summarize_run("toy", records(tmp_path), PLACE, EVAL_REPORT), training=[],
                                               eval_report=None, history=[])
    # the gate's decision, the champion, exports and how to serve it
    assert ("register toy-draft v3: promoted to champion (tau 2.6500 > prompt-lookup floor 1.3700; "
            "tau 2.6500 > champion 2.4100) champion v3") in flat
    assert "champion  v3 holds 'champion' of toy-draft" in lines and f"serve     vllm: {SERVE}" in lines
    assert "exports   speculators /w/export/k/speculators" in lines
    # where the results are
    assert "workdir   /w" in lines
    assert "report    /w/reports/night.html (also the MLflow run's artifact report.html)" in lines
    assert "mlflow    run abc123 (experiment 4) at sqlite:////srv/mlflow.db" in lines
    assert "browse    mlflow ui --backend-store-uri sqlite:////srv/mlflow.db" in lines
    assert "open      http://127.0.0.1:5000/#/experiments/4/runs/abc123" in lines
    assert lines[0] == "== specdraft run 'toy': mean tau 2.65 vs floor 1.37; v3 promoted to champion =="


def test_summary_and_report_show_each_stages_rate_beside_its_limit(tmp_path):
    """Issue 41 item 4: per throughput stage its tokens, wall s, tokens/s, limit tokens/s, ratio and the load during
    it, with how the limit was computed; a stage finished by an earlier run says so instead of a rate; a stage whose
    limit this run did not measure says that."""
    from pipelines.report import render_report

    result = records(tmp_path)  # regenerate ran now (12.3 s); features and train were done by an earlier run
    flops, per_token, tokens = 3.03e11, 2 * 134_515_008, 6110
    result["rates"] = {"run": "now", "matmul": {"cpu/bfloat16/2/2048x576x1536": {
        "device": "cpu", "dtype": "bfloat16", "threads": 2, "shape": [2048, 576, 1536], "flops": flops,
        "seconds": 1.0, "load_1m": 9.87, "run": "now"}}, "stages": {"regenerate/r": {
            "tokens": tokens, "flops_per_token": per_token, "reference": "cpu/bfloat16/2/2048x576x1536", "load_1m": 11.25,
            "counted": "2 x 134.5M target matmul params per generated token (prompt tokens not counted)"}}}
    rate, limit = tokens / 12.3, flops / per_token  # 496.7 tokens/s against 1126.3
    summary = summarize_run("toy", result, PLACE, EVAL_REPORT)
    text = render_text(summary)
    assert re.search(r"^rate\s+tokens\s+wall s\s+tokens/s\s+limit/s\s+ratio\s+load\s+\(limit/s: this run's matmul",
                     text, re.M), text
    assert re.search(rf"^regenerate\s+{tokens}\s+12\.3\s+{rate:.1f}\s+{limit:.1f}\s+{rate / limit:.3f}\s+11\.25"
                     r"\s+toy_prompts\.jsonl$", text, re.M), text
    assert f"{rate:.1f}" == "496.7" and f"{limit:.1f}" == "1126.3" and f"{rate / limit:.3f}" == "0.441"
    flat = " ".join(text.split())
    assert ("limit regenerate: 2 x 134.5M target matmul params per generated token (prompt tokens not counted) at "
            "303.0 GFLOP/s (bfloat16 2048x576x1536 matmul, 2 threads, measured in this run at load 9.9)") in flat
    assert re.search(r"^features\s+skipped: done by an earlier run \(its time is that run's, no rate\)"
                     r"\s+toy_prompts\.jsonl$", text, re.M)
    assert re.search(r"^train\s+skipped: done by an earlier run", text, re.M)
    html = render_report(summary, training=[], eval_report=None, history=[])
    assert ("<th>tokens/s</th><th>limit tokens/s</th><th>ratio</th><th>load during it</th>"
            "<th>how the limit was computed</th>") in html
    assert (f'<td class="num">{rate:.1f}</td><td class="num">{limit:.1f}</td><td class="num">{rate / limit:.3f}</td>'
            '<td class="num">11.25</td>') in html
    # the rates of another run (or none): the stage that ran now says its limit was not measured in this run
    result["rates"] = {}
    text = render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))
    assert re.search(r"^regenerate\s+limit not measured in this run\s+toy_prompts\.jsonl$", text, re.M), text
    assert "limit regenerate:" not in text and "1126.3" not in text


def test_summary_engine_column_tracking_server_and_the_runs_that_register_nothing(tmp_path):
    close = render_text(summarize_run("toy", records(tmp_path, engine={"toy": 2.62}), PLACE, EVAL_REPORT))
    assert re.search(r"^toy\s+2\.65\s+1\.37\s+1\.93\s+0\.17\s+2\.62\s+-$", close, re.M) and "warning" not in close
    gap = "toy: the engine's acceptance length 2.400 differs from ours 2.650 by -9.4% (more than 3%)"  # engine report's
    far = render_text(summarize_run("toy", records(tmp_path, engine={"toy": 2.40}, engine_warnings=[gap]), PLACE,
                                EVAL_REPORT))
    assert f"warning: {gap}: the served draft does not behave as evaluated here" in " ".join(far.split())

    server = replace(PLACE, tracking_uri="http://mlflow.internal:5000/")
    text = render_text(summarize_run("toy", records(tmp_path), server, EVAL_REPORT))
    assert "open      http://mlflow.internal:5000/#/experiments/4/runs/abc123" in text and "mlflow ui" not in text

    again = Registered(model_name="toy-draft", version=3, run_id="r3", mean_tau=2.65, promoted=True, alias="champion",
                       reason="already registered (same trained draft) as v3 by run r3", serving_champion=3, wall_s=0.3)
    text = render_text(summarize_run("toy", records(tmp_path, registered=again), PLACE, EVAL_REPORT))
    assert ("register toy-draft v3 was registered by an earlier run (same trained draft); nothing new to compare"
            in " ".join(text.split()))
    assert "nothing new: v3 already registered ==" in text.splitlines()[0]
    assert "serve     the champion has no exported serving format" in text

    off = Registered(registered=False, reason="tracking disabled")
    text = render_text(summarize_run("toy", records(tmp_path, registered=off), Place(workdir="/w"), None))
    assert re.search(r"^register\s+off\s+-\s+tracking disabled$", text, re.M)
    assert "register  not registered: tracking disabled" in text
    assert "mlflow    tracking disabled (tracking.enabled=false): nothing logged, nothing registered" in text
    assert re.search(r"^toy\s+2\.65\s+1\.37\s+1\.93\s+-$", text, re.M)  # no eval report: no speedup, no note


def test_summary_and_report_name_the_recipe_as_trained(tmp_path):
    """Issue 44: the register and champion rows name the recipe that trained each version (a ``beagle3`` draft's
    architecture is ``beagle``); a champion another recipe trained is named by its own; a version registered before
    recipes were tagged is named by none."""
    from pipelines.report import render_report

    refused = Registered(model_name="toy-draft", version=4, run_id="r4", mean_tau=2.3, promoted=False,
                         alias="champion", reason="tau 2.3000 <= champion 2.4100", recipe="beagle3",
                         serving_champion=3, champion_recipe="eagle3")
    summary = summarize_run("toy", records(tmp_path, registered=refused), PLACE, EVAL_REPORT)
    text = render_text(summary)
    assert "register  toy-draft v4 (recipe beagle3): not promoted (tau 2.3000 <= champion 2.4100)" in text
    assert "champion  v3 (recipe eagle3) holds 'champion' of toy-draft" in text.splitlines()
    html = render_report(summary, training=[], eval_report=None, history=[])
    assert "toy-draft v4 (recipe beagle3): not promoted" in html and "v3 (recipe eagle3) holds" in html
    promoted = replace(refused, promoted=True, serving_champion=4, champion_recipe="beagle3")
    text = render_text(summarize_run("toy", records(tmp_path, registered=promoted), PLACE, EVAL_REPORT))
    assert "champion  v4 (recipe beagle3) holds 'champion' of toy-draft" in text.splitlines()
    untagged = replace(refused, recipe="", champion_recipe="")
    text = render_text(summarize_run("toy", records(tmp_path, registered=untagged), PLACE, EVAL_REPORT))
    assert "recipe" not in text and "champion  v3 holds 'champion' of toy-draft" in text.splitlines()


def test_the_engine_speedup_stands_beside_its_acceptance_in_summary_and_report(tmp_path):
    from pipelines.report import render_report

    result = records(tmp_path, engine={"toy": 1.15}, engine_speedup={"toy": 0.74})
    summary = summarize_run("toy", result, PLACE, EVAL_REPORT)
    text = render_text(summary)
    assert re.search(r"^dataset\s+tau\s+floor\s+tau/floor\s+speedup\s+engine\s+engine x\s+\(.*engine x: its speedup\)$",
                     text, re.M)
    assert re.search(r"^toy\s+2\.65\s+1\.37\s+1\.93\s+0\.17\s+1\.15\s+0\.74$", text, re.M)
    html = render_report(summary, training=[], eval_report=EVAL_REPORT, history=[])
    assert ('<th>engine</th><th>engine speedup</th>' in html
            and '<td class="num">1.15</td><td class="num">0.74</td></tr>' in html)
    # with the engine's K sweep in the report: one note, each drafter's fastest K and the draft's cost model
    cost = {"c": 0.17, "v": 1.0, "k": 2, "tau": 1.5, "target_speedup": 1.3,
            "for_target": {"speedup": 1.3, "tau": 1.742, "alpha": 0.58, "reachable": True}, "for_ngram": None}
    sweep = {"best_k": {"draft": 2, "ngram": 5}, "best_speedup": {"draft": 0.74, "ngram": 1.15},
             "draft": {}, "ngram": {}, "cost": {"draft": cost}}
    swept = render_text(summarize_run("toy", result, PLACE, {**EVAL_REPORT, "engine": {"sweep": sweep}}))
    noted = swept.split("note: engine fastest")[1].split("\n\n")[0]
    note = " ".join(line.strip().removeprefix("note: ") for line in noted.splitlines())
    assert note.startswith(": draft K=2 (0.74x), vLLM ngram K=5 (1.15x); cost model (speedup ≈ τ / (v + K·c)): c "
                           "0.170, v 1.000; at K=2 the draft has τ 1.50, needs τ 1.74 (α 0.58) for a speedup of 1.30x,"
                           " n/a for ngram's; too weak"), note
    assert "engine fastest" not in text  # no sweep in the report: no note
    # no engine measured: neither column, in either
    plain = summarize_run("toy", records(tmp_path), PLACE, EVAL_REPORT)
    assert "engine" not in render_text(plain).split("\n\n")[2] and "dataset" in render_text(plain).split("\n\n")[2]
    assert "engine speedup" not in render_report(plain, training=[], eval_report=EVAL_REPORT, history=[])


def training_rows() -> list[dict]:
    """A two-stage run's metrics.jsonl: stage 0 for steps 1-30, stage 1 (another objective) for 31-40."""
    rows = [{"kind": "params", "time": 0.0, "train.stage_kinds": "early,late"}]
    for step in range(1, 41):
        stage = 0 if step <= 30 else 1
        rows.append({"kind": "metrics", "step": step, "time": float(step), "stage": float(stage),
                     "loss": (6.0 - 0.1 * step) if stage == 0 else (80.0 - step)})
        if step % 10 == 0:
            rows.append({"kind": "metrics", "step": step, "time": float(step), "sim_tau": 1.0 + step / 40})
    return rows


HISTORY = [
    {"version": 1, "created": 1_790_000_000_000, "mean_tau": 2.1, "champion_mean_tau": None, "mean_tau_pld": 1.37,
     "promoted": True},
    {"version": 2, "created": 1_790_086_400_000, "mean_tau": 2.41, "champion_mean_tau": 2.1, "mean_tau_pld": 1.37,
     "promoted": True},
    {"version": 3, "created": 1_790_172_800_000, "mean_tau": 2.3, "champion_mean_tau": 2.41, "mean_tau_pld": 1.37,
     "promoted": False},
    {"version": 4, "created": 1_790_259_200_000, "mean_tau": 2.65, "champion_mean_tau": 2.41, "mean_tau_pld": 1.37,
     "promoted": True, "champion": True},
]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        if os.environ.get("SPECDRAFT_REQUIRE_CHROMIUM"):  # .ci/run installs it: there, its absence is a failure
            pytest.fail("chromium is not installed (apt-get install -y chromium; README test set-up)")
        pytest.skip("chromium is not installed (apt-get install -y chromium; README test set-up)")
    return path


def headless(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Debian's chromium, headless, isolated: no sandbox (root in a container), no GPU, nothing fetched."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    out = subprocess.run([chromium(), *flags, *args], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_report_renders_its_plots_in_a_real_browser(tmp_path):
    from PIL import Image, ImageStat

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in training_rows()))
    result = records(tmp_path, engine={"toy": 2.58})
    summary = summarize_run("toy", result, PLACE, EVAL_REPORT)
    page = write_run_report(tmp_path / "reports" / "night.html", summary, metrics_file=str(metrics),
                        eval_report=EVAL_REPORT, history=HISTORY)
    html = page.read_text()
    assert "src=\"http" not in html and "<link" not in html  # self-contained: nothing fetched
    assert html.count('<img src="data:image/png;base64,') == 4
    assert "mlflow ui --backend-store-uri sqlite:////srv/mlflow.db" in html and "0.17" in html

    # every plot decodes: the browser's naturalWidth of each image, written into the DOM on load
    probe = tmp_path / "probe.html"
    script = ("<script>addEventListener('load', () => { for (const i of document.images) "
              "i.setAttribute('data-natural', i.naturalWidth + 'x' + i.naturalHeight) })</script>")
    probe.write_text(html.replace("</body>", script + "</body>"))
    dom = headless(tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()).stdout
    sizes = re.findall(r'data-natural="(\d+)x(\d+)"', dom)
    assert len(sizes) == 4 and all(int(w) >= 500 and int(h) >= 300 for w, h in sizes), sizes

    # and the page is drawn: a screenshot of it is far from blank
    shot = tmp_path / "report.png"
    headless(tmp_path, "--hide-scrollbars", "--window-size=1100,2000", f"--screenshot={shot}", page.as_uri())
    image = Image.open(shot).convert("RGB")
    assert image.size == (1100, 2000)
    assert len(image.getcolors(1 << 20)) > 200, "a near-blank screenshot"  # plots: many distinct colours
    assert max(ImageStat.Stat(image).stddev) > 30
    if os.environ.get("SPECDRAFT_KEEP_SCREENSHOT"):  # to look at it
        shutil.copy(shot, os.environ["SPECDRAFT_KEEP_SCREENSHOT"])


def test_summary_and_report_count_the_traffic_window(tmp_path):
    from pipelines.report import render_report

    result = records(tmp_path)
    counts = {"read": 16, "rejected": 2, "rejected.bad_json": 1, "rejected.not_utf8": 1, "deduplicated": 1,
              "over_cap": 0, "held_out": 0, "to_regenerate": 8, "reused": 2, "replay_pool": 10, "replayed": 5,
              "replay_reused": 0, "dropped_replay": 5}
    result["prepare"]["traffic"] = {"key": "k", "days": ["2026-11-26", "2026-11-25"], "replay_days": ["2026-11-20"],
                                    "counts": counts, "warnings": ["traffic: day 2026-11-24 has no folder under /l"],
                                    "files": {"rejects": "/w/traffic/k/rejects.jsonl"}}
    summary = summarize_run("toy", result, PLACE, EVAL_REPORT)
    text = render_text(summary)
    assert "16 rows read, 2 rejected (bad_json 1, not_utf8 1), 1 deduplicated" in " ".join(text.split())
    assert "2 reused as logged (not regenerated), 5 replayed" in " ".join(text.split())
    assert "warning   traffic: day 2026-11-24 has no folder under /l" in text
    assert "rejects   /w/traffic/k/rejects.jsonl" in text
    html = render_report(summary, training=[], eval_report=None, history=[])
    assert "2 reused as logged" in html
    assert "traffic" not in render_text(summarize_run("toy", records(tmp_path), PLACE, EVAL_REPORT))


def test_summary_shows_the_alarm_the_gate_and_the_hand_off(tmp_path):
    from specdraft.configs.fresh import GateSettings
    from specdraft.freshness.gate import decide

    gate = decide(GateSettings(enabled=True), window=(2.6, 2.4), regression=(2.3, 2.4), has_champion=True)
    refused = Registered(model_name="toy-draft", version=4, run_id="r4", mean_tau=2.3, promoted=False,
                         alias="champion", reason=gate.reason, serving_champion=3, gate=gate.to_dict())
    result = records(tmp_path, registered=refused)
    result["monitor"] = {"alarm": True, "message": "served acceptance length 2.000 (rate 0.333) over 100 drafts; "
                                                   "at promotion 2.500: DROP 20.0% > monitor.max_drop 10%"}
    text = render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))
    assert "ALARM: served acceptance dropped" in text.splitlines()[0]
    assert "ALARM     served acceptance length 2.000" in text
    assert "gate      window: candidate 2.6000 vs champion 2.4000 (+8.3%, bound +0.0%): pass" in text
    assert "gate      regression: candidate 2.3000 vs champion 2.4000 (-4.2%, bound -2.0%): FAIL" in text
    handed = Registered(model_name="toy-draft", version=5, run_id="r5", mean_tau=2.7, promoted=True,
                        alias="champion", reason="gate passed", serving_champion=5, handoff="/w/exports/current",
                        restart=f"restart the server to load it (vLLM loads its draft at start): {SERVE}")
    text = render_text(summarize_run("toy", records(tmp_path, registered=handed), PLACE, EVAL_REPORT))
    assert "rollback  specdraft rollback --exports /w/exports" in text.splitlines()
    assert f"restart   restart the server to load it (vLLM loads its draft at start): {SERVE}" in text.splitlines()
    assert "served" not in [line.split()[0] for line in text.splitlines() if line.strip()]  # served == champion
    note = "/w/exports/current serves v4 but the registry's champion is v5"  # issue 44: never silent
    apart = Registered(model_name="toy-draft", version=5, run_id="r5", mean_tau=2.7, promoted=True, alias="champion",
                       reason="already registered (same trained draft) as v5 by run r5", serving_champion=5,
                       served_version=4, served_note=note)
    text = render_text(summarize_run("toy", records(tmp_path, registered=apart), PLACE, EVAL_REPORT))
    assert f"served    warning: {note}" in text.splitlines()
    result = records(tmp_path, registered=handed)
    result["warm"] = "champion v2 (models:/d/2): its draft's artifacts cannot be downloaded: trained from scratch"
    text = render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))
    assert f"warm      warning: {result['warm']}" in text.splitlines()


def test_summary_says_the_draft_vocabularys_size_and_coverage_of_the_training_tokens(tmp_path):
    result = records(tmp_path)
    result["train"]["draft"] = str(tmp_path / "train" / "draft")
    (tmp_path / "train").mkdir()
    vocab = tmp_path / "train" / "draft_vocab.json"  # specdraft.run.feature_plan's record of a fresh vocabulary
    vocab.write_text(json.dumps({"size": 192, "vocab_size": 768, "coverage": 0.9731, "counted_tokens": 5000,
                                 "target_ids": list(range(192))}))
    text = render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))
    assert ("vocab     draft vocabulary: 192 of 768 target tokens (train.draft_vocab_size), covering 97.3% of the "
            "5000 predicted tokens of the training data") in " ".join(text.split("\n          "))
    kept = {"size": 192, "coverage": 0.95, "counted_tokens": 4000, "target_ids": [], "init_from": "/w/champion"}
    vocab.write_text(json.dumps(kept))  # a warm start's kept vocabulary: the warm line says its coverage, once
    text = render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))
    assert "draft vocabulary:" not in text and "covering 95.0% of the new predicted tokens" in " ".join(text.split())
    vocab.unlink()  # a draft over the target's whole vocabulary writes none
    assert "vocab " not in render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))


def test_summary_shows_the_offline_drift_check(tmp_path):
    result = records(tmp_path)
    result["drift"] = {"alarm": True, "message": "champion v3 on this window's held-out slice: tau 2.100, at "
                                                 "promotion 2.500 (-16.0%: DROP > monitor.max_drop 10%)"}
    result["retrain"] = {"train": True, "reason": "drift: champion v3 ...", "new_rows": 3, "rows": 90, "drift": True}
    text = render_text(summarize_run("toy", result, PLACE, EVAL_REPORT))
    assert "ALARM: the champion's tau on the new window dropped" in text.splitlines()[0]
    assert "ALARM     champion v3 on this window's held-out slice: tau 2.100" in text
    assert "retrain   drift: champion v3" in text


def test_a_skipped_nights_summary_says_the_champion_handed_off_or_why_not(tmp_path):
    """A night that trains nothing still makes ``current`` the champion (``freshness.serve_champion``) and says so;
    when it cannot, the ``served`` warning; nothing when they agree."""
    from pipelines.summary import render_skipped

    result = records(tmp_path)
    result["retrain"] = {"train": False, "reason": "no drift and 0 of 90 rows new: training skipped", "new_rows": 0,
                         "rows": 90, "drift": False}
    result["handoff"] = {"version": 6, "handoff": "/w/exports/current", "restart": "restart the server",
                         "served_version": 6, "served_note": ""}
    lines = render_skipped("toy", result, PLACE).splitlines()
    assert "handoff   v6 is /w/exports/current (the one before it: previous/)" in lines
    assert not [line for line in lines if line.startswith("served")]
    result["handoff"] = {"served_version": 5, "served_note": "/w/exports/current serves v5 but the registry's "
                                                              "champion is v6, which cannot be handed off: gone"}
    lines = render_skipped("toy", result, PLACE).splitlines()
    assert f"served warning: {result['handoff']['served_note']}" in " ".join(" ".join(lines).split())  # wrapped
    assert not [line for line in lines if line.startswith("handoff")]
    result["handoff"] = {}
    assert not [line for line in render_skipped("toy", result, PLACE).splitlines() if line.startswith(("handoff", "served"))]
