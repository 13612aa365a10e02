"""Toy target build: a loadable HF directory, deterministic, reused, never half-written."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import specdraft.toy.build as build_mod
from specdraft.config import from_dict
from specdraft.config import to_dict
from specdraft.outputs import OutputError
from specdraft.toy.build import (
    BUILD_FORMAT,
    PREBUILT_DIR,
    REQUIRED_FILES,
    build_toy_target,
    compare_with_prebuilt,
    file_digests,
    is_complete_build,
    prebuilt_config,
    read_build_record,
)
from specdraft.configs.toy import ToyTargetConfig

# Small enough to train in seconds, long enough that the model learns to end its turns.
TINY = ToyTargetConfig(
    num_conversations=800, vocab_size=320, hidden_size=64, num_layers=2, num_heads=2,
    num_kv_heads=1, intermediate_size=128, max_seq_len=128, train_steps=300, batch_size=16,
    lr=5e-3, warmup_steps=5, num_eval_conversations=32, num_threads=1,
)
SHORT = dataclasses.replace(TINY, num_conversations=200, train_steps=3, num_eval_conversations=8)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return build_toy_target(tmp_path_factory.mktemp("tiny") / "target", TINY, progress=False)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_directory_is_a_complete_hf_model(tiny_target):
    assert all((tiny_target / name).is_file() for name in REQUIRED_FILES)
    assert is_complete_build(tiny_target, TINY)
    record = read_build_record(tiny_target)
    assert from_dict(ToyTargetConfig, record["config"]) == TINY
    assert record["steps"] == TINY.train_steps
    assert record["final_loss"] < 1.5 and record["eval_loss"] < 2.0  # it learned something
    assert record["wall_time_s"] > 0
    config = json.loads((tiny_target / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    gen = json.loads((tiny_target / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|end|>") == tok.eos_token_id
    assert gen["pad_token_id"] == tok.pad_token_id and gen["do_sample"] is False


def test_loads_and_generation_stops_at_end_of_turn(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    end = tok.convert_tokens_to_ids("<|end|>")
    stopped = 0
    prompts = ["Thank you!", "What sound does a cow make?", "Hello!", "Spell the word cat.",
               "What is 2 + 3?", "List the numbers from 3 to 7."]
    replies = []
    for text in prompts:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt")
        assert tok.decode(enc["input_ids"][0]).endswith("<|end|>\n<|assistant|>\n")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=40)  # greedy from generation_config
        new = out[0, enc["input_ids"].shape[1]:].tolist()
        if end in new:
            assert new.index(end) == len(new) - 1  # nothing generated after <|end|>
            stopped += 1
        replies.append(tok.decode(new, skip_special_tokens=True))
    assert stopped >= len(prompts) - 1, replies
    assert replies[0].startswith("You are welcome!"), replies


def test_same_seed_gives_identical_bytes(tmp_path):
    a = build_toy_target(tmp_path / "a", SHORT, progress=False)
    b = build_toy_target(tmp_path / "b", SHORT, progress=False)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build_toy_target(tmp_path / "c", dataclasses.replace(SHORT, seed=1), progress=False)
    ta, tc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert ta.keys() == tc.keys() and "lm_head.weight" in ta
    assert not torch.equal(ta["lm_head.weight"], tc["lm_head.weight"])


def test_complete_build_is_reused_and_other_config_rebuilt(tiny_target, monkeypatch, tmp_path):
    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a complete build")

    stamp = (tiny_target / "model.safetensors").stat().st_mtime_ns
    with monkeypatch.context() as m:
        m.setattr(build_mod, "_build_into", fail)
        assert build_toy_target(tiny_target, TINY, progress=False) == tiny_target
    assert (tiny_target / "model.safetensors").stat().st_mtime_ns == stamp

    out = build_toy_target(tmp_path / "t", SHORT, progress=False)
    other = dataclasses.replace(SHORT, seed=5)
    assert not is_complete_build(out, other)
    assert build_toy_target(out, other, progress=False) == out
    assert read_build_record(out)["config"]["seed"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no temp or old dirs left


def test_interrupted_build_leaves_nothing_that_looks_complete(monkeypatch, tmp_path):
    out = tmp_path / "target"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(build_mod, "train_model", interrupted)
        with pytest.raises(KeyboardInterrupt):
            build_toy_target(out, SHORT, progress=False)
    assert not out.exists() and list(tmp_path.iterdir()) == []

    # A killed build (no cleanup ran) leaves its temp dir; even a full one is not the target.
    done = build_toy_target(tmp_path / "done", SHORT, progress=False)
    stale = tmp_path / f".target.tmp-{_dead_pid()}-deadbeef"
    done.rename(stale)
    assert not is_complete_build(out, SHORT)
    built = build_toy_target(out, SHORT, progress=False)
    assert is_complete_build(built, SHORT) and not stale.exists()


def test_partial_or_foreign_directory_is_not_complete(tmp_path):
    out = tmp_path / "target"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    assert not is_complete_build(out) and not is_complete_build(out, SHORT)
    with pytest.raises(OutputError, match="--overwrite"):
        build_toy_target(out, SHORT, progress=False)


def test_word_problem_family_and_records_written_before_the_field(tmp_path):
    problems = dataclasses.replace(SHORT, data="word_problems")
    out = build_toy_target(tmp_path / "wp", problems, progress=False)
    assert read_build_record(out)["config"]["data"] == "word_problems"
    assert is_complete_build(out, problems) and not is_complete_build(out, SHORT)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("#### 42")["input_ids"]) == "#### 42"
    assert "####" in "".join(tok.convert_ids_to_tokens(range(len(tok))))  # learned from the answers' last line

    # a chat build recorded before `data` existed is still the chat build, not a word-problem one
    chat = build_toy_target(tmp_path / "chat", SHORT, progress=False)
    record = read_build_record(chat)
    del record["config"]["data"]
    (chat / build_mod.RECORD_FILE).write_text(json.dumps(record))
    assert is_complete_build(chat, SHORT) and not is_complete_build(chat, problems)


def test_time_budget_stops_training(tmp_path):
    cfg = dataclasses.replace(SHORT, train_steps=1000, max_train_seconds=0.0)
    record = read_build_record(build_toy_target(tmp_path / "t", cfg, progress=False))
    assert record["steps"] == 1


def test_causal_lm_loss_matches_hf_loss():
    from specdraft.toy.build import causal_lm_loss, make_model
    from specdraft.toy.tokenizer import train_tokenizer

    tok = train_tokenizer(["What is 2 + 3?", "2 + 3 = 5."] * 20, vocab_size=300)
    torch.manual_seed(0)
    model = make_model(SHORT, tok)
    input_ids = torch.randint(0, len(tok), (3, 11))  # [B, T]
    labels = input_ids.clone()
    labels[:, :4] = -100
    labels[2, 7:] = -100
    with torch.no_grad():
        ours = causal_lm_loss(model, input_ids, labels)
        theirs = model(input_ids=input_ids, labels=labels).loss
    torch.testing.assert_close(ours, theirs)


def test_config_loads_from_yaml_and_rejects_unknown_keys(tmp_path):
    from specdraft.config import ConfigError, load

    path = tmp_path / "toy.yaml"
    path.write_text("seed: 3\ntrain_steps: 50\nmax_train_seconds: 30\n")
    cfg = load(ToyTargetConfig, path, ["lr=0.001"])
    assert (cfg.seed, cfg.train_steps, cfg.max_train_seconds, cfg.lr) == (3, 50, 30.0, 0.001)
    assert cfg.hidden_size == ToyTargetConfig().hidden_size
    path.write_text("hidden: 64\n")
    with pytest.raises(ConfigError):
        load(ToyTargetConfig, path)


# --- the prebuilt default target shipped in the package


def test_the_shipped_prebuilt_target_is_intact_and_of_the_default_config():
    manifest = json.loads((PREBUILT_DIR / "manifest.json").read_text())
    assert file_digests(PREBUILT_DIR) == manifest["files"]  # sha256 of every shipped file
    assert set(REQUIRED_FILES) <= set(manifest["files"])
    # a changed default config (or build) without a new prebuilt would silently train again
    assert from_dict(ToyTargetConfig, prebuilt_config()) == ToyTargetConfig()  # fields added since: defaults
    assert read_build_record(PREBUILT_DIR)["build_format"] == BUILD_FORMAT
    assert sum(p.stat().st_size for p in PREBUILT_DIR.iterdir()) < 2_000_000  # small package data


def test_the_default_config_is_copied_from_the_prebuilt_target(monkeypatch, tmp_path):
    def fail(*args, **kwargs):
        raise AssertionError("trained instead of copying the prebuilt target")

    monkeypatch.setattr(build_mod, "_build_into", fail)
    out = build_toy_target(tmp_path / "t", ToyTargetConfig(), progress=False, prebuilt=True)
    assert is_complete_build(out, ToyTargetConfig())
    diff = compare_with_prebuilt(out)
    assert diff["same_config"] and all(diff["identical_files"].values()) and diff["max_abs_weight_diff"] == 0.0
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                    tokenize=False).startswith("<|bos|><|user|>")


def test_other_configs_and_a_damaged_prebuilt_are_trained(monkeypatch, tmp_path):
    out = build_toy_target(tmp_path / "short", SHORT, progress=False, prebuilt=True)  # not the shipped config
    assert read_build_record(out)["config"] == to_dict(SHORT)
    assert compare_with_prebuilt(out)["same_config"] is False

    damaged = tmp_path / "prebuilt"
    damaged.mkdir()
    for f in PREBUILT_DIR.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    (damaged / "config.json").write_text((damaged / "config.json").read_text().replace("64", "65", 1))
    monkeypatch.setattr(build_mod, "PREBUILT_DIR", damaged)
    assert prebuilt_config() is None

    class Trains(Exception):
        pass

    def train(tmp, cfg, progress):
        raise Trains(cfg)

    monkeypatch.setattr(build_mod, "_build_into", train)
    with pytest.raises(Trains):
        build_toy_target(tmp_path / "t", ToyTargetConfig(), progress=False, prebuilt=True)


def test_the_shipped_tokenizer_is_what_the_build_trains_from_the_seed(tmp_path):
    """The reproducible part of the build that is quick: conversations + BPE from seed 0."""
    from specdraft.toy.conversations import generate_conversations
    from specdraft.toy.tokenizer import train_tokenizer

    cfg = ToyTargetConfig()
    conversations = generate_conversations(cfg.num_conversations, cfg.seed)
    train_tokenizer((m["content"] for c in conversations for m in c), cfg.vocab_size).save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (PREBUILT_DIR / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_rebuilding_from_scratch_reproduces_the_shipped_target(tmp_path):
    """``specdraft toy-target`` (no --prebuilt) retrains the default: the same bytes on the same torch
    build and CPU. Another CPU's float kernels round differently in the last bits, and 1,400 AdamW steps
    carry that into the weights (0.21 apart on an AMD EPYC rebuild of the Intel-built shipped target):
    there the rebuild must train as well — held-out loss within 5 % of the shipped build's."""
    out = build_toy_target(tmp_path / "t", ToyTargetConfig(), progress=False)
    diff = compare_with_prebuilt(out)
    assert diff["same_config"]
    assert all(ok for name, ok in diff["identical_files"].items() if name != "model.safetensors"), diff
    assert diff["max_abs_weight_diff"] is not None, diff
    ours, shipped = read_build_record(out)["eval_loss"], read_build_record(PREBUILT_DIR)["eval_loss"]
    assert diff["max_abs_weight_diff"] <= 1e-3 or abs(ours - shipped) <= 0.05 * shipped, (diff, ours, shipped)
