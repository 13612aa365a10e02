"""The flow on a traffic directory (issue 33): night 1 reads a window of two dated days (a malformed line, a
duplicate, answers logged by the served model reused) and, with no champion, promotes and hands the draft off
to exports/current; night 2 adds a day, and the gate compares candidate and champion on the new window's
held-out slice and on the eval sets (the regression set) — its comparisons in the record and the summary — and
trains warm from the champion (its vocabulary maps byte-identical) on the warm schedule (fewer epochs), with night
1's held-out slice in the regression set and the offline drift series in the report. Slow: two toy flow runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.regenerate_and_train import regenerate_and_train
from specdraft.toy.conversations import generate_prompts
from tests.flows.test_flow import overrides

pytestmark = pytest.mark.slow


def write_day(root: Path, day: str, seed: int, served: int = 0) -> None:
    """24 toy prompts; the first ``served`` carry a logged answer of the served model; one malformed line."""
    lines = []
    for i, messages in enumerate(generate_prompts(24, seed=seed)):
        row = {"messages": messages, "created": 1764201600 + i}
        if i < served:
            row["response"] = {"model": "toy", "choices": [{"message": {"role": "assistant",
                                                                        "content": "The answer is 4."}}]}
        lines.append(json.dumps(row))
    lines += ["{truncated", lines[-1]]  # a malformed line and a duplicate
    (root / day).mkdir(parents=True, exist_ok=True)
    (root / day / "gateway.jsonl").write_text("\n".join(lines) + "\n")


def test_two_nights_on_traffic(local_ray, tiny_toy_target, tmp_path):
    traffic, questions = tmp_path / "traffic", tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "toy", "turns": [
        m["content"] for m in c if m["role"] == "user"]}) + "\n" for i, c in enumerate(generate_prompts(3, seed=22))))
    write_day(traffic, "2026-11-24", seed=31, served=6)
    write_day(traffic, "2026-11-25", seed=32)
    config = str(Path(__file__).resolve().parents[2] / "configs" / "toy.yaml")
    args = [a for a in overrides(tmp_path, tiny_toy_target, Path("unused"), questions) if not a.startswith("data.")]
    args += ["data.prompts=[]", f"data.traffic.path={traffic}", "data.traffic.days=2", "data.traffic.served_model=toy",
             "data.traffic.held_out=0.1", "data.traffic.replay=0.0", "gate.enabled=true", "gate.margin=0.0", "retries=0"]
    first = regenerate_and_train(config=config, overrides=args)
    counts = first["prepare"]["traffic"]["counts"]
    assert counts["rejected"] == 2 and counts["deduplicated"] == 2 and counts["reused"] + counts["held_out"] >= 6
    assert len(first["regenerate"]) == 2  # prompts.jsonl regenerated, reused.jsonl ingested
    register = first["register"]
    assert register["promoted"] and register["gate"]["reason"] == "no champion yet: nothing to protect"
    current = Path(register["handoff"])
    assert json.loads((current / "handoff.json").read_text())["version"] == register["version"]
    assert "rows read" in first["summary"] and "restart" in first["summary"]

    write_day(traffic, "2026-11-26", seed=33)
    second = regenerate_and_train(config=config, overrides=args + ["train.seed=1", "train.init_from=champion",
                                                                   "train.init_min_coverage=0.0", "monitor.offline=true"])
    assert second["prepare"]["traffic"]["days"] == ["2026-11-26", "2026-11-25"]
    drift = second["drift"]  # the champion on night 2's window before training: the first reading is its baseline
    assert drift["champion_version"] == register["version"] and drift["window_tau"] == drift["baseline"] > 0
    assert not drift["alarm"] and "drift     champion v" in second["summary"]
    gate = second["register"]["gate"]
    assert [c["slice"] for c in gate["comparisons"]] == ["window", "regression"]
    assert gate["comparisons"][0]["champion"] == drift["window_tau"]
    held_out = second["prepare"]["traffic"]["files"]["held_out"]
    on_window = [p for p in (tmp_path / "work" / "eval").glob("*/report.json")
                 if json.loads(p.read_text())["settings"]["questions"] == [held_out]]
    assert len(on_window) == 2  # the candidate, and the champion once: the drift check's measurement is the gate's
    assert all(c["champion"] is not None and c["candidate"] is not None for c in gate["comparisons"])
    assert second["register"]["promoted"] == gate["promote"]
    assert "gate      window: candidate" in second["summary"]
    if gate["promote"]:
        assert (current.parent / "previous" / "handoff.json").is_file()
    # warm: the champion's vocabulary maps, byte for byte
    from safetensors.torch import load_file

    champion = load_file(str(Path(first["train"]["draft"]) / "model.safetensors"))
    warm = load_file(str(Path(second["train"]["draft"]) / "model.safetensors"))
    for name in ("heads.d2t", "heads.t2d"):
        assert warm[name].numpy().tobytes() == champion[name].numpy().tobytes()
    plan = json.loads((Path(second["train"]["draft"]).parent / "draft_vocab.json").read_text())
    assert plan["init_from"].endswith(f"champion/v{register['version']}") and "warm      started from" in second["summary"]
    # warm: fewer epochs, a quarter of each stage's, said in schedule.json and the summary's warm line
    fresh_schedule, warm_schedule = (json.loads((Path(run["train"]["draft"]).parent / "schedule.json").read_text())
                                     for run in (first, second))
    assert fresh_schedule["start"] == "fresh" and warm_schedule["start"] == "warm"
    assert warm_schedule["epochs"] == [-(-e // 4) for e in fresh_schedule["epochs"]]
    assert f"schedule: epochs {warm_schedule['epochs']}" in " ".join(second["summary"].split())
    # the regression set: the eval set and night 1's held-out slice (less night 2's own held-out questions)
    heldout = tmp_path / "work" / "traffic" / "heldout"
    assert sorted(p.name for p in heldout.iterdir()) == ["2026-11-25.jsonl", "2026-11-26.jsonl"]
    regression = second["prepare"]["traffic"]["regression"]
    assert first["prepare"]["traffic"]["regression"]["questions"] == 0 and regression["windows"] == ["2026-11-25"]
    assert f"+ {regression['questions']} questions from 1 earlier window's" in " ".join(second["summary"].split())
    # the offline drift series drawn in the report
    html = Path(second["report"]).read_text()
    assert html.split("<h2>Offline drift</h2>")[1].lstrip().startswith('<img src="data:image/png;base64,')
    # a night killed during its hand-off (issue 44 item 5): current/ is not the champion. Its rerun ends with
    # current/ serving the champion — this night's draft (already registered: the rerun completes its hand-off), or
    # the champion's downloaded from the registry — and no `served` warning. The rerun is night 2's run again, its
    # warm start named by the directory night 2 started from (init_from=champion would name the version night 2
    # promoted: a new training input, a third training and its evaluations that this check does not need)
    import shutil

    shutil.rmtree(current.parent / "current")
    night2 = ["train.seed=1", f"train.init_from={plan['init_from']}", "train.init_min_coverage=0.0", "monitor.offline=true"]
    rerun = regenerate_and_train(config=config, overrides=args + night2)
    assert rerun["train"]["skipped"] and rerun["train"]["draft"] == second["train"]["draft"]
    assert rerun["register"]["served_note"] == ""
    champion = rerun["register"]["serving_champion"]
    assert json.loads((current / "handoff.json").read_text())["version"] == champion == rerun["register"]["served_version"]
    assert "served    warning" not in rerun["summary"]
