"""Tests for ``specdraft.targets.Target``: the directory checked once, what is read of it cached on the value."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdraft.targets import Target
from specdraft.targets.identity import target_fingerprint, target_id, target_record, weights_fingerprint
from specdraft.targets.loading import load_target_config, load_target_heads, tokenizer_facts
from tests import tiny_models

WORDS = ["<unk>", "<s>", "</s>", "<pad>", "user", "hello", "world"]


@pytest.fixture
def target_dir(tmp_path):
    """A tiny Llama with a word-level tokenizer (chat template, eos, pad) in ``tmp_path/target``."""
    torch.manual_seed(0)
    path = tmp_path / "target"
    LlamaForCausalLM(LlamaConfig(**{**tiny_models.TINY, "vocab_size": len(WORDS)})).save_pretrained(path)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", pad_token="<pad>",
                            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(path)
    return path


def test_the_directory_is_checked_when_the_value_is_made(tmp_path, target_dir):
    with pytest.raises(FileNotFoundError, match="is not a local directory"):
        Target(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        Target(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_target_config(tmp_path / "empty")  # a path given to a function: checked the same way
    target = Target(os.path.relpath(target_dir))  # a relative path: resolved, so a worker elsewhere reads it
    assert target.path == target_dir.resolve() and str(target) == os.fspath(target) == str(target_dir.resolve())


def test_of_keeps_a_target_and_equality_is_by_path(target_dir):
    target = Target(target_dir)
    assert Target.of(target) is target
    assert Target.of(str(target_dir)) == target and hash(Target.of(target_dir)) == hash(target)
    target_fingerprint(target)  # a filled cache does not make it another value
    assert target == Target(target_dir) and len({target, Target(target_dir)}) == 1


def test_config_and_fingerprint_are_read_once_per_value(target_dir):
    target = Target(target_dir)
    assert load_target_config(target) is load_target_config(target)
    assert load_target_config(target_dir) is not load_target_config(target_dir)  # a path: a new value each call
    first = target_fingerprint(target)
    name = target_id(target)
    config = json.loads((target_dir / "config.json").read_text())
    (target_dir / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert target_fingerprint(target) == first and target_id(target) == name  # the run's value: read once
    fresh = Target(target_dir)  # a new value reads the directory again
    assert target_fingerprint(fresh) != first and target_id(fresh) != name
    assert weights_fingerprint(fresh) == weights_fingerprint(target)  # the weights did not change
    assert target_record(fresh) == {"target_id": target_id(fresh), "target_fingerprint": target_fingerprint(fresh)}


def test_tokenizer_facts(target_dir, tmp_path):
    facts = tokenizer_facts(target_dir)
    assert facts.vocab_size == len(WORDS) and facts.eos_token_ids == {WORDS.index("</s>")}
    assert facts.pad_token_id == WORDS.index("<pad>") and facts.chat_template
    target = Target(target_dir)
    assert tokenizer_facts(target) is tokenizer_facts(target)
    config = json.loads((target_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (target_dir / "chat_template.jinja").unlink(missing_ok=True)
    assert not tokenizer_facts(target_dir).chat_template  # ships none: load_tokenizer would add the fallback
    assert tokenizer_facts(target).chat_template  # the value's facts: read once


def test_a_pickled_target_keeps_its_cache(target_dir):
    target = Target(target_dir)
    fingerprint, vocab = target_fingerprint(target), load_target_config(target).vocab_size
    copy = pickle.loads(pickle.dumps(target))  # what a Ray worker receives
    (target_dir / "config.json").unlink()  # the copy reads nothing again
    assert copy == target and target_fingerprint(copy) == fingerprint
    assert load_target_config(copy).vocab_size == vocab
    with pytest.raises(FileNotFoundError):
        load_target_heads(target_dir)  # a path is checked again
