"""The nightly deployment on simulated days of traffic (issue 33, "Done means"): one demonstration run, not a test.

A Prefect server and a process worker on 127.0.0.1 (their own ``PREFECT_HOME`` in the work directory, analytics
off), ``prefect work-pool create``, ``prefect --no-prompt deploy --all`` from the repository root (``prefect.yaml``),
then one ``prefect deployment run regenerate-and-train/nightly --params '{"overrides": [...]}' --watch`` a night on
a traffic directory of dated day folders (``docs/operations.md`` "Keeping the draft fresh"), with the nightly
settings: ``data.traffic.*`` (window of one day, ``end`` = that night's day), ``retrain.policy=when_it_pays``,
``monitor.offline=true``, ``train.init_from=champion``, ``gate.enabled=true``; a workdir and an MLflow SQLite
database of its own; the shipped toy target (``configs/toy.yaml``), training in the flow's process
(``train.scaling.num_workers=0``) and short answers so that a night takes minutes on 2 CPU cores.

The days are toy chats (``specdraft.toy.conversations``) split into domains by their first turn's task
(``benchmarks.drift.domain_chats``):

* day 1, domain A (``--domain-a``, numbers): the first night on this traffic trains from scratch; no champion yet;
* day 2, the same traffic again with a few new chats of domain A (``--new-on-day-2``): below
  ``retrain.min_new_share`` and, with the champion's tau on the window at its promotion value, no drift: the night
  is skipped (the offline check sets the champion's baseline on this window);
* day 3, domain B (``--domain-b``, words): the champion's tau on the new window falls (an offline drift alarm when
  the drop passes ``monitor.max_drop``), the night trains warm from the champion (its weights and draft
  vocabulary, the warm schedule, a replay share of days 1-2) and the gate compares candidate and champion on the
  window's held-out slice and on the regression set (the eval sets and days 1-2's held-out slices);
* day 4, chosen by night 3's outcome, to let the gate show the other verdict if the traffic gives it: night 3
  refused -> more domain B traffic (a window of days 3-4: twice the new domain's data); night 3 promoted -> the
  traffic moves again, to domain C (``--domain-c``, facts), with the new champion to protect.

Nothing is forced: every decision is the flow's, read back from what it wrote. Per night: the flow run's state,
wall time, the run summary (from the flow-run log) and its decision lines (traffic, drift, retrain, warm, gate,
register, hand-off), the MLflow tags of the night's runs (``retrain.*``, ``gate.*``, ``offline.*``) and the
parent run's ``offline.*``/``retrain.*`` metrics, the report's path and whether it draws the offline drift series
and the gate's comparisons; at the end the registry's versions, their tags and the champion.

    python -m benchmarks.nightly_days benchmarks/results/nightly_days_cpu.json --work runs/nightly-days [--keep]

writes the JSON and, beside it, a transcript of the decisions (``.txt``). ``--keep`` keeps ``--work`` (the Prefect
server's database, MLflow, the workdir) and reads a night whose flow run completed there back instead of running
it again (``read_back`` in its record); ``--reread`` only recomputes a written JSON's decision lines and outcomes
from its stored summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.drift import domain_chats
from benchmarks.host import write_result
from benchmarks.processes import PREFECT, prefect_deployment

ROOT = Path(__file__).resolve().parents[1]
DAYS = ("2026-11-24", "2026-11-25", "2026-11-26", "2026-11-27")
# the summary's labels of the decisions (pipelines.summary: fresh_rows, render_text)
LABELS = ("register", "champion", "traffic", "warning", "monitor", "ALARM", "drift", "retrain", "warm", "gate",
          "handoff", "rollback", "restart")
TAG_PREFIXES = ("retrain.", "gate.", "offline.", "served.", "specdraft.summary", "specdraft.stage")


def write_day(traffic: Path, day: str, chats: list[list[dict[str, str]]], created: int) -> None:
    """One gateway log of ``chats`` (OpenAI chat rows, a ``created`` timestamp each) under ``traffic/day``."""
    (traffic / day).mkdir(parents=True, exist_ok=True)
    rows = [json.dumps({"messages": chat, "created": created + i}) for i, chat in enumerate(chats)]
    (traffic / day / "gateway-0.jsonl").write_text("\n".join(rows) + "\n")


def prompt_keys(chats: list[list[dict[str, str]]]) -> set[str]:
    from specdraft.freshness.traffic import prompt_hash

    return {prompt_hash(c) for c in chats}


def decision_lines(summary: str) -> list[str]:
    """The summary's decision lines (a wrapped line joined to its label's line)."""
    out: list[str] = []
    for line in summary.splitlines():
        if line.startswith(" " * 10) and out and out[-1] is not None:
            out[-1] += " " + line.strip()
            continue
        label = line.split(" ", 1)[0]  # a label line: the label padded to 9 columns, then text (not the stage table)
        decision = label in LABELS and len(line) > 10 and line[:10] == f"{label:<9} " and line[10] != " "
        out.append(" ".join(line.split()) if decision or line.startswith("==") else None)
    return [line for line in out if line]


def night_runs(client, experiment_id: str, flow_run_id: str) -> dict[str, Any]:
    """The night's MLflow parent run (tagged with the flow run) and its children: tags of the decisions, metrics."""
    parents = client.search_runs([experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    if not parents:
        return {"parent": None}
    parent = parents[0]
    children = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    keep = lambda tags: {k: v for k, v in sorted(tags.items()) if k.startswith(TAG_PREFIXES)}  # noqa: E731
    return {"parent": parent.info.run_id, "parent_tags": keep(parent.data.tags),
            "parent_metrics": {k: round(v, 4) for k, v in sorted(parent.data.metrics.items())
                               if k.startswith(("offline.", "retrain.", "served.", "tau."))},
            "children": {c.data.tags.get("specdraft.stage", c.info.run_name): {
                k: v for k, v in keep(c.data.tags).items() if k != "specdraft.stage"} for c in children},
            "stages": sorted(c.data.tags.get("specdraft.stage", c.info.run_name) for c in children)}


def report_facts(summary: str) -> dict[str, Any]:
    found = re.search(r"^report\s+(\S+\.html)", summary, re.M)
    if not found:
        return {"path": None, "exists": False}
    path = Path(found.group(1))
    if not path.is_file():
        return {"path": str(path), "exists": False}
    html = path.read_text()
    drift = html.split("<h2>Offline drift</h2>")
    return {"path": str(path), "exists": True,
            "drift_series_drawn": len(drift) > 1 and drift[1].lstrip().startswith('<img src="data:image/png;base64,'),
            "has_gate_comparisons": "window: candidate" in html, "has_drift_line": "on this window&#x27;s held-out"
            in html or "on this window's held-out" in html}


def run_night(n: int, night: dict[str, Any], base: list[str], env: dict[str, str], api: str, client,
              experiment: str, timeout: int) -> dict[str, Any]:
    """One night: ``prefect deployment run ... --watch`` (or, with ``--keep``, the completed flow run of a
    previous invocation with the same parameters, read back from the same Prefect server), then what it wrote."""
    overrides = base + [f"data.traffic.end={night['end']}", f"data.traffic.days={night['days']}"]
    record: dict[str, Any] = {"night": n, **night, "overrides": overrides}
    earlier = httpx.post(f"{api}/flow_runs/filter", timeout=10, json={"sort": "START_TIME_ASC"}).json()
    done = [r for r in earlier if r["parameters"].get("overrides") == overrides and r["state_type"] == "COMPLETED"]
    if done:
        flow_run_id = record["flow_run_id"] = done[0]["id"]
        record["read_back"] = "run by an earlier invocation on the same Prefect server (--keep)"
        record["wall_s"] = round(done[0]["total_run_time"], 1)
    else:
        t0 = time.perf_counter()
        watch = subprocess.run(PREFECT + ["deployment", "run", "regenerate-and-train/nightly", "--params",
                                          json.dumps({"overrides": overrides}), "--watch", "--watch-timeout",
                                          str(timeout)],
                               cwd=ROOT, env={**env, "COLUMNS": "400"}, capture_output=True, text=True,
                               timeout=timeout + 60)
        ids = [line.split()[-1] for line in watch.stdout.splitlines() if "UUID" in line]
        record["watch_returncode"] = watch.returncode
        if not ids:
            record["error"] = f"no flow run id in the output:\n{watch.stdout[-2000:]}\n{watch.stderr[-2000:]}"
            record["wall_s"] = round(time.perf_counter() - t0, 1)
            return record
        flow_run_id = record["flow_run_id"] = ids[0]
        deadline = time.time() + timeout  # --watch gave up (the flow runs on): wait for its end here
        while httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]["type"] in (
                "SCHEDULED", "PENDING", "RUNNING") and time.time() < deadline:
            time.sleep(5)
        record["wall_s"] = round(time.perf_counter() - t0, 1)  # the command's, server round trips included
    state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
    record["state"] = state["type"]
    record["state_name"] = state["name"]
    summary, logs = "", []
    for _ in range(12):  # the worker ships its logs in batches: the summary may come a few seconds after the end
        logs = httpx.post(f"{api}/logs/filter", timeout=10, json={
            "logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_DESC", "limit": 200}).json()
        summary = next((log["message"].split("\n", 1)[1] for log in logs
                        if log["message"].startswith("run summary\n")), "")
        if summary or record["state"] != "COMPLETED":
            break
        time.sleep(5)
    record["summary"] = summary
    record["decisions"] = decision_lines(summary)
    record["warnings_logged"] = [log["message"][:600] for log in logs[::-1] if log["level"] >= 30][:20]
    if record["state"] != "COMPLETED":
        record["log_tail"] = [log["message"][-1500:] for log in logs[:8][::-1]]
    exp = client.get_experiment_by_name(experiment)
    record["mlflow"] = night_runs(client, exp.experiment_id, flow_run_id) if exp else {"parent": None}
    record["report"] = report_facts(summary)
    return record


def registry(client, model: str) -> dict[str, Any]:
    versions = client.search_model_versions(f"name='{model}'")
    try:
        champion = client.get_model_version_by_alias(model, "champion").version
    except Exception:  # no alias yet  # noqa: BLE001
        champion = None
    return {"champion": champion, "versions": [
        {"version": v.version, "tags": {k: t for k, t in sorted(v.tags.items())
                                        if k.startswith(("gate.", "offline.", "specdraft.promoted", "promoted"))}}
        for v in sorted(versions, key=lambda v: int(v.version))]}


def outcome(record: dict[str, Any]) -> str:
    """What the night did, read from its summary: skipped, promoted or refused (or the failed state)."""
    if record.get("state") != "COMPLETED":
        return f"flow {record.get('state_name') or record.get('error', 'failed')[:60]}"
    summary = record["summary"]
    if not summary:
        return "no run summary found in the flow-run log"
    headline = summary.splitlines()[0]
    if "night skipped" in headline:
        return "skipped"
    return "not promoted" if "not promoted" in headline else "promoted" if " promoted to " in headline else headline


def transcript(result: dict[str, Any]) -> str:
    out = [f"nightly_days: {len(result['nights'])} nights of `prefect deployment run regenerate-and-train/nightly "
           f"--watch` ({result['host']['machine']}, {result['total_s']:.0f} s in all)", ""]
    for r in result["nights"]:
        out.append(f"night {r['night']} ({r['domain']}, window {r['window']}): {r.get('state')} in {r['wall_s']:.0f} s"
                   f" -> {r['outcome']}")
        out += [f"  {line}" for line in r.get("decisions", [])]
        tags = {**(r.get("mlflow") or {}).get("parent_tags", {})}
        for stage, stage_tags in ((r.get("mlflow") or {}).get("children") or {}).items():
            tags.update({f"{stage}:{k}": v for k, v in stage_tags.items()})
        out += [f"  mlflow  {k} = {v}" for k, v in tags.items() if not k.endswith("specdraft.summary")]
        rep = r.get("report") or {}
        out.append(f"  report  {rep.get('path') or 'none written'}" + (
            f" (offline drift series drawn: {rep['drift_series_drawn']}; gate comparisons: "
            f"{rep['has_gate_comparisons']})" if rep.get("exists") else ""))
        out.append("")
    out.append(f"registry: champion v{result['registry']['champion']}; versions "
               f"{[v['version'] for v in result['registry']['versions']]}")
    return "\n".join(out) + "\n"


def main() -> None:
    # Long on purpose: the demonstration's script, night by night; the nights share the server, worker and records.
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON result path (the transcript: the same path with .txt)")
    ap.add_argument("--work", required=True, help="traffic, workdir, MLflow, Prefect home: replaced, unless --keep "
                    "(no default: a directory this benchmark deletes is named by its caller)")
    ap.add_argument("--chats", type=int, default=112, help="chats a day")
    ap.add_argument("--new-on-day-2", type=int, default=12, help="day 2: new chats of domain A among --chats")
    ap.add_argument("--domain-a", default="numbers")
    ap.add_argument("--domain-b", default="words")
    ap.add_argument("--domain-c", default="facts")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a night's --watch waits")
    ap.add_argument("--nights", type=int, default=4, help="3 or 4")
    ap.add_argument("--keep", action="store_true", help="keep --work (its Prefect server database, MLflow, workdir):"
                    " a night whose flow run completed there is read back, not run again")
    ap.add_argument("--reread", action="store_true", help="only read OUT again: its nights' decision lines and "
                    "outcomes recomputed from their stored summaries, the transcript rewritten")
    args = ap.parse_args()
    if args.reread:
        result = json.loads(Path(args.out).read_text())
        for r in result["nights"]:
            r["decisions"], r["outcome"] = decision_lines(r.get("summary", "")), outcome(r)
        result["reread"] = "decision lines and outcomes recomputed from the stored summaries (--reread)"
        write(result, Path(args.out))
        return

    work = Path(args.work).absolute()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    traffic, runs = work / "traffic", work / "runs"
    work.mkdir(parents=True, exist_ok=True)
    # the days: A; A again with a few new; B; (C or more B: decided after night 3)
    n = args.chats
    day1 = domain_chats(args.domain_a, n, seed=101, exclude=set())
    fresh = domain_chats(args.domain_a, args.new_on_day_2, seed=102, exclude=prompt_keys(day1))
    day2 = day1[: n - args.new_on_day_2] + fresh
    day3 = domain_chats(args.domain_b, n, seed=103, exclude=prompt_keys(day1 + fresh))
    write_day(traffic, DAYS[0], day1, 1763942400)
    write_day(traffic, DAYS[1], day2, 1764028800)
    write_day(traffic, DAYS[2], day3, 1764115200)
    nights = [
        {"day": DAYS[0], "end": DAYS[0], "days": 1, "window": DAYS[0], "domain": args.domain_a,
         "traffic": f"{n} chats of {args.domain_a}"},
        {"day": DAYS[1], "end": DAYS[1], "days": 1, "window": DAYS[1], "domain": args.domain_a,
         "traffic": f"day 1's first {n - args.new_on_day_2} chats again + {args.new_on_day_2} new {args.domain_a}"},
        {"day": DAYS[2], "end": DAYS[2], "days": 1, "window": DAYS[2], "domain": args.domain_b,
         "traffic": f"{n} chats of {args.domain_b}"},
    ]

    mlflow_uri = f"sqlite:///{work / 'mlflow.db'}"
    experiment, model = "nightly-days", "nightly-days-draft"
    base = [
        f"workdir={runs}", "name=nightly-days", "data.prompts=", f"data.traffic.path={traffic}",
        "retrain.policy=when_it_pays", "monitor.offline=true", "train.init_from=champion", "gate.enabled=true",
        f"tracking.uri={mlflow_uri}", f"tracking.experiment={experiment}", f"register.model_name={model}",
        "train.scaling.num_workers=0",  # training in the flow's process: no Ray Train workers to start each night
        "train.epochs=4", "train.reader.max_tokens=2048",  # beagle3 [2, 2] fresh; warm: a quarter, rounded up
        "regenerate.max_new_tokens=48", "eval.settings.decode.max_new_tokens=48", "retries=0",
    ]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    result: dict[str, Any] = {
        "benchmark": "nightly_days", "config": "configs/toy.yaml", "deployment": "regenerate-and-train/nightly",
        "base_overrides": base, "settings": vars(args),
        "host": {"loadavg_at_start": os.getloadavg()},  # write_result adds the host's facts
        "nights": []}
    t_all = time.perf_counter()
    # the server, the deployment and the worker (their logs in work/prefect), stopped when the nights end
    with prefect_deployment(work / "prefect", dict(os.environ), ROOT) as (api, env):
        for i in range(args.nights):
            if i == 3:  # day 4: chosen by night 3's outcome (see the docstring)
                refused = result["nights"][2]["outcome"] != "promoted"
                domain = args.domain_b if refused else args.domain_c
                day4 = domain_chats(domain, n, seed=104, exclude=prompt_keys(day1 + fresh + day3))
                write_day(traffic, DAYS[3], day4, 1764201600)
                nights.append({"day": DAYS[3], "end": DAYS[3], "days": 2 if refused else 1,
                               "window": f"{DAYS[2]}..{DAYS[3]}" if refused else DAYS[3], "domain": domain,
                               "traffic": f"{n} new chats of {domain}",
                               "why": ("night 3 refused: more of the new domain (a window of days 3-4)" if refused
                                       else "night 3 promoted: the traffic moves again, to a third domain")})
            night = nights[i]
            print(f"night {i + 1}: {night['traffic']} (window {night['window']})", flush=True)
            record = run_night(i + 1, night, base, env, api, client, experiment, args.timeout)
            record["outcome"] = outcome(record)
            print(f"night {i + 1}: {record.get('state')} in {record['wall_s']:.0f} s -> {record['outcome']}", flush=True)
            for line in record.get("decisions", []):
                print(f"  {line}", flush=True)
            result["nights"].append(record)
            if record.get("state") != "COMPLETED":
                break
    result["registry"] = registry(client, model)
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    write(result, Path(args.out))


def write(result: dict[str, Any], out: Path) -> None:
    """What the nights showed (from their outcomes and decision lines), the JSON and the transcript beside it."""
    outcomes = [r["outcome"] for r in result["nights"]]
    result["shown"] = {
        "first_night_promoted": bool(outcomes) and outcomes[0] == "promoted",
        "night_without_drift_skipped": len(outcomes) > 1 and outcomes[1] == "skipped",
        "drift_alarm_then_warm_retrain": any(
            any(d.startswith("ALARM") for d in r.get("decisions", [])) and
            any(d.startswith("warm") and "started from" in d for d in r.get("decisions", []))
            for r in result["nights"][2:]),
        "gate_refused_a_candidate": any(o == "not promoted" for o in outcomes[2:]),
        "gate_promoted_a_warm_candidate": any(o == "promoted" for o in outcomes[2:]),
    }
    written = json.loads(write_result(out, result).read_text())  # the host's facts added
    out.with_suffix(".txt").write_text(transcript(written))
    print(json.dumps(result["shown"], indent=1))


if __name__ == "__main__":
    main()
