"""``regenerate.mode`` (pipelines/shipped.py, issue 40 Deliver 1): which rows a mixed run regenerates (fixed by
seed and prompt, about ``share`` of them), what a shipped row keeps and what it rejects, the settings refused,
the stage writing shipped rows with no target loaded, resuming them, and one mixed run on the toy target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.configs import RegenerateConfig, RunConfig
from pipelines.conversations import check_messages, prompt_digest, read_conversations
from pipelines.regenerate import regenerate
from pipelines.shipped import plan_rows, regenerates, share_draw
from specdraft.config import ConfigError, from_dict
from tests.pipelines.test_regenerate import MAX_NEW, dataset_rows, target_dir, write_prompts  # noqa: F401


def _rows(n: int) -> list[dict]:
    return [{"id": f"s:{i}", "source": "s", "messages": [{"role": "user", "content": f"question {i}"},
                                                        {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(n)]


def _chosen(rows: list[dict], **cfg) -> set[str]:
    return {r["id"] for r in plan_rows(rows, RegenerateConfig(**cfg)).regenerate}


# --- which rows, in process ------------------------------------------------------------------------------


def test_mixed_regenerates_about_share_of_the_rows_fixed_by_seed_and_prompt():
    rows = _rows(2000)
    quarter = _chosen(rows, mode="mixed", share=0.25, seed=0)
    assert 0.25 * 2000 - 70 < len(quarter) < 0.25 * 2000 + 70  # ±3.6 σ of Binomial(2000, 0.25)
    assert _chosen(rows, mode="mixed", share=0.25, seed=0) == quarter  # deterministic
    assert _chosen(rows[::-1], mode="mixed", share=0.25, seed=0) == quarter  # not by position
    assert _chosen(rows[:500], mode="mixed", share=0.25, seed=0) == {r["id"] for r in rows[:500]} & quarter  # grown set
    other_seed = _chosen(rows, mode="mixed", share=0.25, seed=1)
    assert other_seed != quarter and 430 < len(other_seed) < 570
    half = _chosen(rows, mode="mixed", share=0.5, seed=0)
    assert quarter < half and 930 < len(half) < 1070  # a larger share adds rows, drops none
    assert len(_chosen(rows, mode="mixed", share=0.001, seed=0)) < 10
    assert _chosen(rows, mode="target") == {r["id"] for r in rows} and not _chosen(rows, mode="shipped")
    # the draw is the prompt's: another answer to the same prompt is chosen alike
    row = rows[0]
    other = {**row, "messages": [row["messages"][0], {"role": "assistant", "content": "else"}]}
    cfg = RegenerateConfig(mode="mixed", share=0.5)
    assert regenerates(row["messages"], cfg) == regenerates(other["messages"], cfg)
    assert share_draw(0, prompt_digest(row["messages"])) == share_draw(0, prompt_digest(other["messages"]))


def test_shipped_rows_keep_their_answers_and_a_row_without_one_is_a_counted_reject():
    u = lambda t: {"role": "user", "content": t}  # noqa: E731
    a = lambda t: {"role": "assistant", "content": t}  # noqa: E731
    system = {"role": "system", "content": "be brief"}
    rows = [{"id": "x:whole", "source": "x", "messages": [u("q"), a("r")]},
            {"id": "x:tail", "source": "x", "messages": [u("q1"), a("r1"), u("q2")]},  # last turn unanswered
            {"id": "x:none", "source": "x", "messages": [u("only a question")]},
            {"id": "x:two", "source": "x", "messages": [u("q"), u("another")]},  # a question file's turns
            {"id": "x:sys", "source": "x", "messages": [system, u("q1"), a("r1"), u("q2"), a("r2")]}]
    plan = plan_rows(rows, RegenerateConfig(mode="shipped"))
    assert not plan.regenerate
    assert {r["id"]: r["messages"] for r in plan.shipped} == {
        "x:whole": [u("q"), a("r")], "x:tail": [u("q1"), a("r1")], "x:sys": rows[4]["messages"]}
    assert plan.cut_turns == 1
    assert [(r["id"], r["reason"]) for r in plan.rejects] == [("x:none", "no_answer"), ("x:two", "no_answer")]
    assert plan.rejects[0]["excerpt"] == "only a question" and plan.rejects[0]["source"] == "x"
    assert all(check_messages(r["messages"], complete=True) is None for r in plan.shipped)  # what the dump reads
    assert len(plan.regenerate) + len(plan.shipped) + len(plan.rejects) == len(rows)
    assert not plan_rows(rows, RegenerateConfig()).rejects  # target mode answers every prompt


@pytest.mark.parametrize("settings, key", [
    ({"mode": "mixed"}, "share=None"),
    ({"mode": "mixed", "share": 0}, "share=0"),
    ({"mode": "mixed", "share": 1}, "share=1"),
    ({"mode": "mixed", "share": 1.5}, "share=1.5"),
    ({"mode": "mixed", "share": -0.1}, "share=-0.1"),
    ({"mode": "shipped", "share": 0.3}, "share=0.3: only mode=mixed"),
    ({"share": 0.3}, "share=0.3: only mode=mixed"),
    ({"mode": "regenerated"}, "regenerate.mode: 'regenerated' is not one of"),
])
def test_bad_modes_and_shares_are_config_errors_naming_the_key(settings, key):
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, {"regenerate": settings})
    assert str(err.value).startswith("regenerate") and key in str(err.value)


def test_good_modes_load_and_data_regenerate_false_names_its_replacement():
    assert from_dict(RunConfig, {"regenerate": {"mode": "mixed", "share": 0.25}}).regenerate.share == 0.25
    assert from_dict(RunConfig, {"regenerate": {"mode": "mixed", "share": 0.999}}).regenerate.mode == "mixed"
    assert from_dict(RunConfig, {"regenerate": {"mode": "shipped"}}).regenerate.share is None
    with pytest.raises(ConfigError, match="data.regenerate=false: replaced by regenerate.mode=shipped"):
        from_dict(RunConfig, {"data": {"regenerate": False}})


def test_the_mode_joins_the_stage_key_only_when_it_is_not_target():
    from pipelines.shipped import mode_settings
    from specdraft.config import config_hash, to_dict

    target = mode_settings(RegenerateConfig())
    assert "mode" not in target and "share" not in target  # the keys written before the modes still match
    assert target == {k: v for k, v in to_dict(RegenerateConfig()).items() if k not in ("mode", "share", "vllm_env")}
    bound = RegenerateConfig(vllm_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})  # the cores, not the answers
    assert config_hash(mode_settings(bound)) == config_hash(target)
    assert config_hash(mode_settings(RegenerateConfig(dtype="bfloat16"))) != config_hash(target)
    keys = {config_hash(mode_settings(RegenerateConfig(**c))) for c in (
        {}, {"mode": "shipped"}, {"mode": "mixed", "share": 0.25}, {"mode": "mixed", "share": 0.5})}
    assert len(keys) == 4


# --- the stage -----------------------------------------------------------------------------------------------


@pytest.fixture
def unloadable_target(tmp_path) -> Path:
    """A target directory that fingerprints but cannot load: shipped mode must never load it."""
    path = tmp_path / "target"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return path


def test_shipped_mode_writes_the_rows_as_they_ship_without_a_target_and_resumes(unloadable_target, tmp_path):
    rows = dataset_rows(6)
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    with prompts.open("a") as f:  # a question with no answer, and a line that is no row
        f.write(json.dumps({"id": "q", "messages": [{"role": "user", "content": "unanswered"}]}) + "\nnot json\n")
    out = tmp_path / "out"
    first = regenerate(unloadable_target, prompts, out, RegenerateConfig(mode="shipped"), progress=False)
    assert (first["rows_shipped"], first["rows_regenerated"], first["rows_no_answer"]) == (6, 0, 1)
    assert first["rows_rejected"] == 2 and first["rejects_by_reason"] == {"bad_json": 1, "no_answer": 1}
    assert first["rows_ingested"] == first["rows_planned_shipped"] + first["rows_no_answer"] == 7
    assert first["tokens_generated"] == 0 and first["rows_total"] == 6
    got = {r["id"]: r["messages"] for r in read_conversations(out)}
    assert got == {f"prompts:{r['id'].split(':')[1]}": r["messages"] for r in rows}  # the dataset's own answers
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == ["bad_json", "no_answer"]
    assert next(r for r in rejects if r["reason"] == "no_answer")["id"] == "prompts:q"

    again = regenerate(unloadable_target, prompts, out, RegenerateConfig(mode="shipped"), progress=False)
    assert (again["rows_in"], again["rows_skipped"], again["rows_total"]) == (0, 6, 6)
    # an answer edited under the same id is written again, once
    edited = [{**r, "messages": r["messages"][:-1] + [{"role": "assistant", "content": "edited"}]}
              if i == 0 else r for i, r in enumerate(rows)]
    write_prompts(prompts, edited)
    third = regenerate(unloadable_target, prompts, out, RegenerateConfig(mode="shipped"), progress=False)
    assert (third["rows_changed"], third["rows_shipped"], third["rows_total"]) == (1, 1, 6)
    assert {r["id"]: r["messages"][-1]["content"] for r in read_conversations(out)}["prompts:0"] == "edited"
    assert len(read_conversations(out)) == 6
    with pytest.raises(ValueError, match="another target/config"):  # the mode is part of what a dir holds
        regenerate(unloadable_target, prompts, out, RegenerateConfig(mode="mixed", share=0.5), progress=False)


def test_shipped_mode_on_questions_only_is_one_line_exit_2(target_dir, tmp_path, capsys):  # noqa: F811
    from flows.cli import main

    questions = tmp_path / "mt.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [f"q{i}"]}) + "\n" for i in range(3)))
    code = main(["regenerate", "--target", str(target_dir), "--prompts", str(questions),
                 "--out", str(tmp_path / "out"), "mode=shipped"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "regenerate.mode=shipped keeps the conversations' own answers and none of the 3 has one" in err
    answered = write_prompts(tmp_path / "answered.jsonl", dataset_rows(3))
    assert main(["regenerate", "--target", str(target_dir), "--prompts", str(answered), str(questions),
                 "--out", str(tmp_path / "mixed-in"), "mode=shipped"]) == 0
    assert "; mode shipped: 0 regenerated, 3 kept as shipped, 3 rejected with no answer to keep" in \
        capsys.readouterr().out
    allowed = regenerate(target_dir, questions, tmp_path / "allowed",
                         RegenerateConfig(mode="shipped", allow_empty=True), progress=False)
    assert (allowed["rows_out"], allowed["rows_no_answer"]) == (0, 3)


@pytest.mark.slow  # 10-25 s here: Ray Data's replica for the drawn rows (the split itself is tested in process above)
def test_mixed_mode_regenerates_the_drawn_rows_and_ships_the_rest(local_ray, target_dir, tmp_path):  # noqa: F811
    rows = dataset_rows(8)
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    cfg = RegenerateConfig(mode="mixed", share=0.5, seed=1, max_new_tokens=MAX_NEW, batch_size=8)
    out = tmp_path / "out"
    summary = regenerate(target_dir, prompts, out, cfg, progress=False)
    drawn = {f"prompts:{r['id'].split(':')[1]}" for r in rows if regenerates(r["messages"], cfg)}
    assert 0 < len(drawn) < len(rows)  # (seed 1 draws a real mix of these 8)
    assert (summary["rows_regenerated"], summary["rows_shipped"]) == (len(drawn), len(rows) - len(drawn))
    assert summary["tokens_generated"] > 0
    dataset = {f"prompts:{r['id'].split(':')[1]}": r["messages"] for r in rows}
    got = {r["id"]: r["messages"] for r in read_conversations(out)}
    assert set(got) == set(dataset)
    for conv_id, messages in got.items():
        assert check_messages(messages, complete=True) is None
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        shipped = [m["content"] for m in dataset[conv_id] if m["role"] == "assistant"]
        assert (answers != shipped) == (conv_id in drawn), conv_id  # the drawn ones are the target's
    again = regenerate(target_dir, prompts, out, cfg, progress=False)
    assert (again["rows_in"], again["rows_skipped"], again["tokens_generated"]) == (0, len(rows), 0)
