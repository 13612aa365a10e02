"""Regenerate: left-padded batched generation, per-row seeds, multi-turn conditioning on the
target's own answers, and the Ray Data stage (resume without duplicates or gaps, determinism).

The target is a tiny random Llama with the toy tokenizer and chat template; its lm_head row for
``<|end|>`` is scaled so answers stop at varied lengths (some hit ``max_new_tokens``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipelines import conversations
from pipelines.conversations import check_messages, read_conversations
from pipelines.generation import (
    RowSampler,
    conversation_seed,
    decoded_answer,
    generate_batch,
    hf_answer_fn,
    prompt_ids,
    regenerate_rows,
    split_at_stop,
    stop_token_ids,
    vllm_answer_fn,
)
from pipelines.regenerate import regenerate, vllm_batch_size, vllm_engine_settings, vllm_environment, vllm_gpus
from pipelines.configs import RegenerateConfig, RunConfig
from pipelines.conversations import done_ids
from specdraft.config import ConfigError, from_dict
from specdraft.store import location
from specdraft.targets.loading import load_target_model, load_tokenizer
from specdraft.toy.conversations import generate_conversations
from specdraft.toy.tokenizer import END, train_tokenizer
from tests.tiny_models import NARROW

MAX_NEW = 12


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    conversations_ = generate_conversations(200, 0)
    tokenizer = train_tokenizer((m["content"] for c in conversations_ for m in c), 320)
    end = tokenizer.convert_tokens_to_ids(END)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        **NARROW, vocab_size=len(tokenizer), max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end, pad_token_id=tokenizer.pad_token_id,
    ))
    with torch.no_grad():
        model.lm_head.weight[end] *= 2.5  # <|end|> often, not always
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end, pad_token_id=tokenizer.pad_token_id,
        do_sample=True, temperature=0.3, top_p=0.5, repetition_penalty=1.3,  # must not leak in
    )
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(target_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_target_model(target_dir), load_tokenizer(target_dir)
    torch.set_num_threads(threads)


def dataset_rows(n: int = 10) -> list[dict]:
    """Multi-turn conversations with dataset answers (which regenerate must drop), some with a system."""
    pool = generate_conversations(max(200, n), 7)
    turns = lambda c: sum(m["role"] == "user" for m in c)  # noqa: E731
    longest = max(range(len(pool)), key=lambda i: (turns(pool[i]) >= 3, -i))  # first with >= 3 user turns
    chosen = pool[: n - 1] + [pool[longest]] if longest >= n - 1 else pool[:n]
    rows = []
    for i, conv in enumerate(chosen):
        if i % 3 == 1 and conv[0]["role"] != "system":
            conv = [{"role": "system", "content": "You are a concise assistant."}, *conv]
        rows.append({"id": f"toy:{i}", "source": "toy", "messages": conv})
    return rows


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"id": r["id"].split(":")[1], "messages": r["messages"]}) + "\n"
                            for r in rows))
    return path


# --- generation, in process ---------------------------------------------------------------------


def test_stop_ids_cover_eos_and_the_template_end_of_turn(loaded):
    model, tokenizer = loaded
    assert stop_token_ids(tokenizer, model.generation_config) == [tokenizer.convert_tokens_to_ids(END)]
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "[UNK]": 3, "hi": 4},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    chatml = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template="{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    )
    assert stop_token_ids(chatml, GenerationConfig(eos_token_id=[0, 7])) == [0, 7, 2]


def test_left_padding_batched_equals_one_by_one_greedy(loaded):
    model, tokenizer = loaded
    prompts = [prompt_ids(tokenizer, r["messages"][:1 + (r["messages"][0]["role"] == "system")])
               for r in dataset_rows(10)]
    assert len({len(p) for p in prompts}) > 3  # really different lengths -> real left padding
    stops = stop_token_ids(tokenizer, model.generation_config)
    batched = generate_batch(model, prompts, max_new_tokens=MAX_NEW, stop_ids=stops, pad_id=0)
    single = [generate_batch(model, [p], max_new_tokens=MAX_NEW, stop_ids=stops, pad_id=0)[0] for p in prompts]
    assert batched == single
    assert {s for _, s in batched} == {True, False}  # some stop on <|end|>, some run to the limit
    for p, (tokens, stopped) in zip(prompts, batched):  # against plain unpadded HF greedy decoding
        ref = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                             repetition_penalty=1.0, eos_token_id=stops, pad_token_id=0)[0, len(p):].tolist()
        assert ref[: len(tokens)] == tokens
        assert (len(ref) > len(tokens) and ref[len(tokens)] in stops) == stopped
        assert len(tokens) == MAX_NEW or stopped


def test_stop_token_ends_the_answer(loaded):
    model, _ = loaded
    prompt = [1, 4, 10, 11, 12, 13, 2, 5]
    free = generate_batch(model, [prompt], max_new_tokens=MAX_NEW, stop_ids=[10_000], pad_id=0)[0]
    assert free[1] is False and len(free[0]) == MAX_NEW
    stop = free[0][2]
    cut = generate_batch(model, [prompt], max_new_tokens=MAX_NEW, stop_ids=[stop], pad_id=0)[0]
    assert cut == (free[0][: free[0].index(stop)], True)


def test_sampling_is_deterministic_per_row_and_seed(loaded):
    model, tokenizer = loaded
    prompts = [prompt_ids(tokenizer, r["messages"][:1]) for r in dataset_rows(6)]
    kw = dict(max_new_tokens=MAX_NEW, stop_ids=[10_000], pad_id=0, temperature=1.0, top_p=0.9)
    seeds = [conversation_seed(0, f"x{i}", 0) for i in range(6)]
    first = generate_batch(model, prompts, seeds=seeds, **kw)
    assert generate_batch(model, prompts, seeds=seeds, **kw) == first
    # a row's answer does not depend on its batch
    assert [generate_batch(model, [p], seeds=[s], **kw)[0] for p, s in zip(prompts, seeds)] == first
    assert generate_batch(model, prompts[::-1], seeds=seeds[::-1], **kw) == first[::-1]
    other = generate_batch(model, prompts, seeds=[s + 1 for s in seeds], **kw)
    assert other != first
    greedy = generate_batch(model, prompts, max_new_tokens=MAX_NEW, stop_ids=[10_000], pad_id=0)
    assert greedy != first
    assert conversation_seed(0, "a", 1) != conversation_seed(0, "a", 0) != conversation_seed(1, "a", 0)


def test_row_sampler_draws_from_the_decoders_top_p_set():
    """The regenerate sampler keeps the decoders' top-p set (``keep_top_p``): at an exact boundary no further token."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])  # (V,) the top two reach 0.75 exactly
    sampler = RowSampler(seeds=list(range(64)), temperature=1.0, top_p=0.75)
    scores = sampler(None, probs.log().expand(64, -1).clone())  # (64, V): -inf but the sampled token
    assert set(scores.argmax(-1).tolist()) == {0, 1}  # were a third token kept, 64 draws would miss it w.p. 0.75**64


def test_multi_turn_answers_are_the_targets_own(loaded):
    model, tokenizer = loaded
    rows = dataset_rows(8)
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    assert any(sum(m["role"] == "user" for m in r["messages"]) >= 3 for r in rows)
    cfg = RegenerateConfig(max_new_tokens=MAX_NEW, batch_size=8)
    stops = stop_token_ids(tokenizer, model.generation_config)
    out, stats = regenerate_rows(rows, tokenizer, hf_answer_fn(model, tokenizer, cfg, stops), cfg, 512)
    assert [r["id"] for r in out] == [r["id"] for r in rows]

    for row, got in zip(rows, out):  # explicit reference: one conversation, one turn at a time
        messages = [m for m in row["messages"] if m["role"] == "system"]
        for user in (m["content"] for m in row["messages"] if m["role"] == "user"):
            messages.append({"role": "user", "content": user})
            ids = prompt_ids(tokenizer, messages)
            new = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 repetition_penalty=1.0, eos_token_id=stops, pad_token_id=0)[0, len(ids):].tolist()
            new = new[: new.index(stops[0])] if stops[0] in new else new
            messages.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
        assert got["messages"] == messages
        assert check_messages(got["messages"], complete=True) is None
        dataset_answers = {m["content"] for m in row["messages"] if m["role"] == "assistant"}
        assert not dataset_answers & {m["content"] for m in got["messages"] if m["role"] == "assistant"}
    assert stats["turns"] == sum(m["role"] == "user" for r in rows for m in r["messages"])
    assert 0 < stats["truncated_turns"] < stats["turns"] and stats["tokens"] > 0


def test_prompts_too_long_for_the_model_are_cut_and_counted(loaded):
    model, tokenizer = loaded
    long_first = {"id": "t:long", "source": "t", "messages": [{"role": "user", "content": "word " * 200}]}
    long_second = {"id": "t:two", "source": "t", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "word " * 200}]}
    cfg = RegenerateConfig(max_new_tokens=MAX_NEW)
    stops = stop_token_ids(tokenizer, model.generation_config)
    out, stats = regenerate_rows([long_first, long_second], tokenizer,
                                 hf_answer_fn(model, tokenizer, cfg, stops), cfg, max_model_len=100)
    assert [r["id"] for r in out] == ["t:two"] and len(out[0]["messages"]) == 2
    assert stats["too_long_ids"] == ["t:long"] and stats["cut_turns"] == 2 and stats["turns"] == 1


# --- output files -----------------------------------------------------------------------------


def test_a_part_killed_mid_write_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    rows = [{"id": "a", "source": "s", "messages": [{"role": "user", "content": "q"}]}]

    def dying_write(table, where):
        where.write(b"PAR1 half a file")  # the part is serialized in memory, then written whole
        raise KeyboardInterrupt

    monkeypatch.setattr(conversations.pq, "write_table", dying_write)
    with pytest.raises(KeyboardInterrupt):
        conversations.write_conversations(tmp_path / "part-x.parquet", rows)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / ".part-y.parquet.tmp-1-abc").write_bytes(b"PAR1 half")  # a writer killed with -9
    assert done_ids(tmp_path) == set() and read_conversations(tmp_path) == []


def test_a_part_killed_mid_write_at_a_url_leaves_nothing(s3_bucket, monkeypatch):
    rows = [{"id": "a", "source": "s", "messages": [{"role": "user", "content": "q"}]}]
    out = f"{s3_bucket}/regenerated"

    def dying_write(table, where):
        where.write(b"PAR1 half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(conversations.pq, "write_table", dying_write)
    with pytest.raises(KeyboardInterrupt):
        conversations.write_conversations(f"{out}/part-x.parquet", rows)
    monkeypatch.undo()
    assert location.list_dir(out) == [] and done_ids(out) == set()
    conversations.write_conversations(f"{out}/part-x.parquet", rows)
    assert location.list_dir(out) == ["part-x.parquet"] and read_conversations(out) == rows


# --- the Ray Data stage ---------------------------------------------------------------------------


def parts(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("part-*.parquet"))


def test_regenerate_resumes_without_duplicates_or_gaps_and_is_deterministic(
    local_ray, target_dir, tmp_path, capsys
):
    rows = dataset_rows(10)
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\nnot json\n')
    inputs = [prompts, tmp_path / "bad.jsonl"]
    cfg = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=3, batch_size=3)

    # a subset first (as if the first run had died after 4 conversations), then the whole set
    resumed = tmp_path / "resumed"
    first = regenerate(target_dir, inputs, resumed, RegenerateConfig(**cfg, limit=4))
    assert first["rows_in"] == 4 and first["rows_out"] == 4 and first["rows_over_limit"] == 6
    assert first["rows_rejected"] == 2 and first["ingest"]["rejects_by_reason"] == {"bad_json": 1, "empty": 1}
    assert len(parts(resumed)) == 2  # batches of 3 + 1
    second = regenerate(target_dir, inputs, resumed, RegenerateConfig(**cfg, concurrency=2))
    assert second["rows_skipped"] == 4 and second["rows_in"] == 6 and second["rows_out"] == 6
    assert second["rows_total"] == 10 and len(parts(resumed)) == 4
    assert second["tokens_generated"] > 0 and second["tokens_per_s"] > 0 and second["dtype"] == "auto"
    assert second["generate_tokens_per_s"] == pytest.approx(second["tokens_generated"] / second["generate_s"], rel=1e-2)
    # the placement: the 6 answered now, by the one local node (the skipped ones by none)
    assert [(n["node"], n["conversations"]) for n in second["nodes"]] == [(ray.get_runtime_context().get_node_id(), 6)]
    assert "[specdraft] regenerate 6/6 conversations tok/s " in capsys.readouterr().err  # progress lines
    third = regenerate(target_dir, inputs, resumed, RegenerateConfig(**cfg))
    assert third["rows_in"] == 0 and third["rows_skipped"] == 10 and len(parts(resumed)) == 4 and third["nodes"] == []

    got = read_conversations(resumed)
    assert sorted(r["id"] for r in got) == sorted(f"prompts:{i}" for i in range(10))  # no dups, no gaps
    assert all(check_messages(r["messages"], complete=True) is None for r in got)
    for part in parts(resumed):
        assert pq.read_schema(part).equals(conversations.SCHEMA, check_metadata=False)

    # the same seed in one go through the CLI, in other batches -> the same answers
    whole = tmp_path / "whole"
    from flows.cli import main

    assert main(["regenerate", "--target", str(target_dir), "--prompts", str(prompts), str(tmp_path / "bad.jsonl"),
                 "--out", str(whole), *(f"{k}={v}" for k, v in cfg.items()), "batch_size=4"]) == 0
    printed = capsys.readouterr().out
    assert "rows in 10" in printed and "rejected 2" in printed and "tokens/s" in printed
    assert {r["id"]: r for r in got} == {r["id"]: r for r in read_conversations(whole)}
    # (other seeds giving other answers is checked in process: test_sampling_is_deterministic...)

    # an output dir only resumes with the same target and generation settings
    with pytest.raises(ValueError, match="another target/config"):
        regenerate(target_dir, prompts, resumed, RegenerateConfig(**{**cfg, "temperature": 0.5}))


def test_vllm_engine_settings_and_the_gpus_a_replica_asks_for():
    """A vllm replica's engine: the hf backend's dtype rule, the stage's max_model_len, no sampling defaults from
    the target's ``generation_config.json``, ``vllm_engine_kwargs`` winning; Ray gives it tensor x pipeline
    parallel GPUs (vLLM's own sharding inside the replica)."""
    cfg = RegenerateConfig(backend="vllm", vllm_engine_kwargs={"tensor_parallel_size": 2})
    gpu = vllm_engine_settings(cfg, 512, use_gpu=True)
    assert gpu["dtype"] == "bfloat16" and gpu["tensor_parallel_size"] == 2 and gpu["max_model_len"] == 512
    assert gpu["generation_config"] == "vllm"  # the target's sampling defaults stay out: the request is the policy
    assert vllm_engine_settings(cfg, 512, use_gpu=False)["dtype"] == "float32"
    assert vllm_engine_settings(RegenerateConfig(dtype="float16", vllm_engine_kwargs={"dtype": "bfloat16"}), 512,
                                use_gpu=False)["dtype"] == "bfloat16"  # engine kwargs win
    assert vllm_gpus(RegenerateConfig()) == 1 and vllm_gpus(cfg) == 2
    assert vllm_gpus(RegenerateConfig(vllm_engine_kwargs={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})) == 4


def test_vllm_env_sets_vllms_own_variables_as_text_and_names_any_other():
    """``regenerate.vllm_env``: vLLM's own variables (a YAML number as text: the environment holds strings), none by
    default; any other name is a ConfigError naming the key."""
    assert vllm_environment(RegenerateConfig()) == {}
    cfg = from_dict(RunConfig, {"regenerate": {"vllm_env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": 0,
                                                             "VLLM_CPU_OMP_THREADS_BIND": "0-1"}}}).regenerate
    assert vllm_environment(cfg) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    for bad in ("OMP_NUM_THREADS", "vllm_cpu_kvcache_space", "VLLM"):
        with pytest.raises(ConfigError) as err:
            from_dict(RunConfig, {"regenerate": {"vllm_env": {"VLLM_CPU_KVCACHE_SPACE": 1, bad: "1"}}})
        assert str(err.value).startswith("regenerate") and f"vllm_env.{bad}: only vLLM's own" in str(err.value)


def test_a_dtype_other_than_auto_joins_the_resume_guard(target_dir, tmp_path):
    """bf16's greedy answers are not fp32's: a directory answered in one dtype refuses another; ``auto`` keeps the
    identity of directories written before the dtype joined it; where vLLM computes (``vllm_env``) is not in it."""
    from pipelines.regenerate import _claim_out_dir, _generation_identity
    from specdraft.targets import Target

    def claim(out, **settings):
        _claim_out_dir(tmp_path / out, _generation_identity(Target.of(target_dir), RegenerateConfig(**settings)))

    auto = _generation_identity(Target.of(target_dir), RegenerateConfig())["settings"]
    assert sorted(auto) == sorted(("backend", "temperature", "top_p", "max_new_tokens", "seed", "max_model_len"))
    claim("auto")
    claim("auto", vllm_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    claim("bf16", dtype="bfloat16")
    claim("bf16", dtype="bfloat16")
    for out, dtype in (("auto", "bfloat16"), ("auto", "float32"), ("bf16", "auto"), ("bf16", "float16")):
        with pytest.raises(ValueError, match="another target/config"):
            claim(out, dtype=dtype)


def test_vllm_batches_give_every_replica_work_and_hold_at_most_a_chunk():
    assert vllm_batch_size(6, RegenerateConfig(vllm_chunk_size=4)) == 4  # one replica: chunks of 4
    assert vllm_batch_size(2000, RegenerateConfig(concurrency=8)) == 250  # 8 batches for 8 engines, not 1
    assert vllm_batch_size(100_000, RegenerateConfig(concurrency=8)) == 4096  # the chunk bounds a part
    assert vllm_batch_size(3, RegenerateConfig(concurrency=8)) == 1


def standin_tokens(prompt: list[int], stop_ids: list[int], seed: int) -> list[int]:
    """What the stand-in engine generates: prompt tokens (so a turn's answer depends on the earlier
    answers in its prompt), one from the row's seed, and a stop token for odd-length prompts."""
    kept = [t for t in prompt[-8:] if t not in stop_ids][:4]
    return kept + [10 + seed % 7] + ([stop_ids[0], 11] if len(prompt) % 2 else [12])


class StandInEngine:
    """``vllm.LLM.generate`` as ``vllm_answer_fn`` uses it: token prompts and one set of sampling parameters each
    in, one output per prompt in their order (``standin_tokens``); it records how many prompts each call had."""

    def __init__(self):
        self.calls: list[int] = []

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(len(prompts))
        outputs = []
        for prompt, p in zip(prompts, params, strict=True):
            assert p.detokenize is False and p.temperature == 0.7 and p.max_tokens == MAX_NEW
            tokens = standin_tokens(list(prompt["prompt_token_ids"]), list(p.stop_token_ids), p.seed)
            outputs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tokens)]))
        return outputs


def test_vllm_answers_with_a_stand_in_engine(target_dir, loaded, tmp_path, monkeypatch):
    """``vllm_answer_fn`` over a stand-in engine, in process: one ``generate`` per turn holding every prompt of it,
    the prompt ids, per-row seeds and stop ids passed, the stop cut, each turn conditioned on the earlier answers.
    The real engine in the stage's replicas: tests/serving/test_regenerate_vllm.py (against the hf backend)."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    from pipelines.ingest import ingest

    _, tokenizer = loaded
    stops = stop_token_ids(tokenizer, GenerationConfig.from_pretrained(target_dir))
    cfg = RegenerateConfig(backend="vllm", temperature=0.7, max_new_tokens=MAX_NEW)
    rows = ingest([write_prompts(tmp_path / "p.jsonl", dataset_rows(4))])[0]
    engine = StandInEngine()
    got, stats = regenerate_rows(rows, tokenizer, vllm_answer_fn(engine, tokenizer, cfg, stops), cfg, 512)

    def reference(prompts_, messages, seeds):
        return [decoded_answer(tokenizer, *split_at_stop(standin_tokens(p, stops, s), stops))
                for p, s in zip(prompts_, seeds)]
    want, _ = regenerate_rows(rows, tokenizer, reference, cfg, 512)
    assert got == want and 0 < stats["truncated_turns"] < stats["turns"]
    turns = [sum(m["role"] == "user" for m in r["messages"]) for r in rows]
    assert engine.calls == [sum(t > k for t in turns) for k in range(max(turns))] and max(turns) >= 2


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vllm is installed: tests/serving/test_regenerate_vllm.py runs the real engine")
def test_vllm_backend_is_a_clear_error_without_vllm(local_ray, target_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", dataset_rows(2))
    with pytest.raises(RuntimeError, match="vllm"):
        regenerate(target_dir, prompts, tmp_path / "out", RegenerateConfig(backend="vllm"))


@pytest.mark.slow  # restarts Ray (its replicas need the endpoint), two runs
def test_regenerate_to_s3_resumes_without_duplicates_or_gaps(s3_ray, s3_bucket, target_dir, loaded, tmp_path):
    """Output at an object-store URL (a real S3 server on 127.0.0.1): parts are single PUTs, resume skips
    what is there, and the answers are the target's own (the same as generating in process)."""
    from pipelines.ingest import ingest

    rows = dataset_rows(10)
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n')
    inputs = [prompts, tmp_path / "bad.jsonl"]
    cfg = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=3, batch_size=3)
    out = f"{s3_bucket}/regenerated/run"
    first = regenerate(target_dir, inputs, out, RegenerateConfig(**cfg, limit=4), progress=False)
    assert first["rows_out"] == 4 and first["out_dir"] == out
    second = regenerate(target_dir, inputs, out, RegenerateConfig(**cfg), progress=False)
    assert second["rows_skipped"] == 4 and second["rows_in"] == 6 and second["rows_total"] == 10
    assert regenerate(target_dir, inputs, out, RegenerateConfig(**cfg), progress=False)["rows_in"] == 0
    names = location.list_dir(out)
    assert sum(n.startswith("part-") for n in names) == 4  # batches of 3 + 1, then 3 + 3
    assert {"regenerate.json", "summary.json", "rejects.jsonl"} <= set(names) and len(names) == 7
    assert json.loads(location.read_text(f"{out}/rejects.jsonl"))["reason"] == "empty"
    got = read_conversations(out)
    assert sorted(r["id"] for r in got) == sorted(f"prompts:{i}" for i in range(10))  # no dups, no gaps

    model, tokenizer = loaded
    run_cfg = RegenerateConfig(**cfg)
    stop_ids = stop_token_ids(tokenizer, model.generation_config)
    ingested, _ = ingest([prompts])
    want, _ = regenerate_rows(ingested, tokenizer, hf_answer_fn(model, tokenizer, run_cfg, stop_ids), run_cfg, 512)
    assert {r["id"]: r for r in got} == {r["id"]: r for r in want}
    with pytest.raises(ValueError, match="another target/config"):
        regenerate(target_dir, prompts, out, RegenerateConfig(**{**cfg, "seed": 4}), progress=False)


def test_a_target_without_chat_template_answers_with_the_fallback(templateless_target):
    tokenizer = load_tokenizer(templateless_target)
    model = load_target_model(templateless_target)
    stops = stop_token_ids(tokenizer, model.generation_config)
    assert tokenizer.eos_token_id in stops
    rows = [{"id": "a", "source": "t", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}]
    answer = hf_answer_fn(model, tokenizer, RegenerateConfig(max_new_tokens=8), stops)
    out, stats = regenerate_rows(rows, tokenizer, answer, RegenerateConfig(max_new_tokens=8), max_model_len=1024)
    assert [m["role"] for m in out[0]["messages"]] == ["user", "assistant"] and stats["too_long_ids"] == []
    assert tokenizer.decode(prompt_ids(tokenizer, rows[0]["messages"])).endswith("### User:\nWhat is 2 + 3?\n\n### Assistant:\n")
