"""Evaluate stage: Ray Data replicas give the single-process report (timings aside), and the
``specdraft eval`` command writes it.

The target is a tiny random Llama with the toy tokenizer and chat template (its ``<|end|>`` row
scaled so answers stop at varied lengths); the draft is a random Beagle sharing its heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from pipelines.evaluate import evaluate
from pipelines.configs import RayEvalConfig
from specdraft.configs.decode import DecodeConfig
from specdraft.configs.evaluation import EvalSettings
from specdraft.models import build_draft, draft_config_from_target, save_draft
from specdraft.toy.conversations import generate_conversations
from specdraft.toy.tokenizer import END, train_tokenizer
from tests.eval_records import check_tau, records_of

TIMING = {"wall_s", "draft_s", "verify_s", "baseline_wall_s", "tokens_per_s", "baseline_tokens_per_s", "speedup",
          "stage_wall_s", "ray", "wall_s_pld", "draft_s_pld", "verify_s_pld", "tokens_per_s_pld", "speedup_pld",
          "workers", "baselines", "baseline_changed", "pld_changed",
          "load_1m", "load_1m_max", "nodes"}  # how it ran: not what it found


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same as each CPU replica, so both paths run identical kernels
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    tokenizer = train_tokenizer((m["content"] for c in generate_conversations(200, 0) for m in c), 320)
    end = tokenizer.convert_tokens_to_ids(END)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        model.lm_head.weight[end] *= 1.5  # <|end|> sometimes
    model.generation_config = GenerationConfig(eos_token_id=end, pad_token_id=tokenizer.pad_token_id)
    target = tmp_path_factory.mktemp("target")
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    heads = (model.model.embed_tokens.weight, model.lm_head.weight)
    draft = build_draft(draft_config_from_target(config, "beagle"), *heads)
    return target, save_draft(draft, tmp_path_factory.mktemp("draft") / "beagle")


@pytest.fixture(scope="module")
def question_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("questions")
    files = []
    for name, convs in (("alpha", generate_conversations(3, 11)), ("beta", generate_conversations(2, 12))):
        path = root / f"{name}.jsonl"
        rows = [
            {"question_id": i, "category": name, "turns": [m["content"] for m in c if m["role"] == "user"][:2]}
            for i, c in enumerate(convs)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(path)
    return files


def without_timings(obj):
    if isinstance(obj, dict):
        return {k: without_timings(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [without_timings(v) for v in obj]
    return obj


@pytest.mark.parametrize(
    "decode",
    [
        DecodeConfig(mode="tree", depth=3, topk=4, total_tokens=12, max_new_tokens=20),
        DecodeConfig(mode="chain", gamma=3, temperature=0.8, top_p=0.9, max_new_tokens=20),
    ],
    ids=["greedy-tree", "sampled-chain"],
)
def test_ray_path_equals_single_process(local_ray, one_thread, models, question_files, tmp_path, decode):
    target, draft = models
    settings = EvalSettings(decode=decode, seed=3)
    local = evaluate(target, draft, question_files, tmp_path / "local.json", settings, progress=False)
    remote = evaluate(target, draft, question_files, tmp_path / "ray.json", settings, use_ray=True,
                      ray_cfg=RayEvalConfig(replicas=2, num_cpus=1), progress=False)
    assert json.loads((tmp_path / "ray.json").read_text()) == json.loads(json.dumps(remote))
    assert remote["settings"]["ray"]["replicas"] == 2
    questions = sum(len(f.read_text().splitlines()) for f in question_files)
    assert sum(n["questions"] for n in remote["nodes"]) == questions and "nodes" not in local  # each once, by a node
    assert without_timings(remote) == without_timings(local)
    turns = sum(len(json.loads(line)["turns"]) for f in question_files for line in f.read_text().splitlines())
    assert len(local["records"]) == turns and set(local["datasets"]) == {"alpha", "beta"}
    overall = local["overall"]
    tau, floor = check_tau(overall, local["records"]), check_tau(overall, local["records"], "_pld")
    assert overall["tau_over_pld"] == tau / floor
    if decode.temperature == 0:
        assert overall["lossless_checked"] == turns and overall["lossless_mismatches"] == 0
        assert overall["lossless_checked_pld"] == turns and overall["pld_lossless"] is True
    else:
        assert overall["lossless_checked"] == 0 and overall["pld_lossless"] is None


def test_cli_eval_writes_the_report(models, question_files, tmp_path, capsys):
    from flows.cli import main

    target, draft = models
    out = tmp_path / "report.json"
    args = ["eval", "--target", str(target), "--draft", str(draft), "--questions", *map(str, question_files),
            "--out", str(out), "--mode", "tree", "decode.depth=3", "decode.topk=4", "decode.total_tokens=10",
            "decode.max_new_tokens=12", "max_questions=1", "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["settings"]["decode"]["total_tokens"] == 10 and report["settings"]["max_questions"] == 1
    for name in ("alpha", "beta"):
        block = report["datasets"][name]
        assert block["lossless_checked"] == block["num_turns"] >= 1 and block["lossless_mismatches"] == 0
        check_tau(block, records_of(report, name))
        assert block["speedup"] > 0
        assert "1" in block["turns"]
        assert block["pld_lossless"] is True  # the floor ran (depth 3 lookups) and printed beside tau
        assert f"{name}: tau {block['tau']:.2f} vs pld {block['tau_pld']:.2f} (tau/pld {block['tau_over_pld']:.2f})" in printed
        # the speedups, both from times measured in this run, carry the load they were measured under
        assert (f"(speedup {block['speedup']:.2f}, pld {block['speedup_pld']:.2f}; all timed in this run, "
                f"load {block['load_1m']:.2f})") in printed
