"""Tests for specdraft.target: heads from safetensors, hidden/logit extraction, identity."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from specdraft import target

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
VOCAB = 128
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)


def build_tiny(family: str, tie: bool = False, seed: int = 0):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**TINY, tie_word_embeddings=tie)).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, model, dir) for a single-file save of each family."""
    model = build_tiny(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    model = build_tiny("llama", seed=1)
    path = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(path, max_shard_size="20KB")
    return model, path


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    model = build_tiny("qwen3", tie=True, seed=2)
    path = tmp_path_factory.mktemp("tied")
    model.save_pretrained(path)
    return model, path


def assert_heads_match(heads: target.TargetHeads, model) -> None:
    assert torch.equal(heads.embed, model.get_input_embeddings().weight)
    assert torch.equal(heads.lm_head, model.get_output_embeddings().weight)
    assert heads.embed.shape == (VOCAB, TINY["hidden_size"])


# --- config, tokenizer, model ---------------------------------------------------------------


def test_load_target_config(saved):
    family, _, path = saved
    config = target.load_target_config(path)
    assert config.model_type == family
    assert config.hidden_size == TINY["hidden_size"]


def test_load_tokenizer_keeps_chat_template(tmp_path):
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", "hello", "world"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", chat_template=template
    )
    tok.save_pretrained(tmp_path)
    build_tiny("llama").config.save_pretrained(tmp_path)

    loaded = target.load_tokenizer(tmp_path)
    assert loaded.chat_template == template
    text = loaded.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text == "user hello "
    assert loaded("hello world").input_ids == [4, 5]


def test_load_target_model(saved):
    _, model, path = saved
    loaded = target.load_target_model(path)
    assert not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


# --- heads from safetensors -----------------------------------------------------------------


def test_load_target_heads_single_file(saved):
    _, model, path = saved
    heads = target.load_target_heads(path)
    assert not heads.tied
    assert_heads_match(heads, model)


def test_load_target_heads_sharded_opens_only_needed_shards(sharded, monkeypatch):
    model, path = sharded
    index = json.loads((path / target.INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 2, "sharded save should produce several shards"

    opened = []
    real_safe_open = target.safe_open

    def recording_safe_open(file, *args, **kwargs):
        opened.append(file)
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(target, "safe_open", recording_safe_open)
    heads = target.load_target_heads(path)
    assert_heads_match(heads, model)
    needed = {str(path / index[k]) for k in ("model.embed_tokens.weight", "lm_head.weight")}
    assert set(opened) == needed


def test_load_target_heads_tied(tied):
    model, path = tied
    heads = target.load_target_heads(path)
    assert heads.tied
    assert heads.lm_head is heads.embed
    assert_heads_match(heads, model)


def test_load_target_heads_without_lm_head_tensor_is_tied(saved, tmp_path):
    """A checkpoint storing no lm_head counts as tied even when the config does not say so."""
    _, model, _ = saved
    model.config.save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": model.get_input_embeddings().weight.detach()},
              str(tmp_path / "model.safetensors"))
    heads = target.load_target_heads(tmp_path, dtype=torch.bfloat16)
    assert heads.tied and heads.embed.dtype == torch.bfloat16
    assert torch.equal(heads.lm_head, model.get_input_embeddings().weight.to(torch.bfloat16))


def test_load_target_heads_prefixed_keys(saved, tmp_path):
    _, model, _ = saved
    model.config.save_pretrained(tmp_path)
    save_file(
        {
            "model.language_model.embed_tokens.weight": model.get_input_embeddings().weight.detach(),
            "model.lm_head.weight": model.get_output_embeddings().weight.detach(),
        },
        str(tmp_path / "model.safetensors"),
    )
    assert_heads_match(target.load_target_heads(tmp_path), model)


def test_load_target_heads_errors(saved, tmp_path):
    _, model, _ = saved
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        target.load_target_heads(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        target.load_target_heads(tmp_path)

    model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        target.load_target_heads(tmp_path)

    save_file({"wrong.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="candidate keys.*wrong.weight"):
        target.load_target_heads(tmp_path)


def test_missing_shard_is_a_clear_error(sharded, tmp_path):
    _, path = sharded
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    index = json.loads((tmp_path / target.INDEX_FILE).read_text())["weight_map"]
    (tmp_path / index["lm_head.weight"]).unlink()
    with pytest.raises(FileNotFoundError, match="lm_head.weight"):
        target.load_target_heads(tmp_path)


# --- hidden states and logits ---------------------------------------------------------------


def test_target_states_match_model_logits(saved):
    _, model, _ = saved
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 9))
    hidden, logits = target.target_states(model, ids)
    assert hidden.shape == (3, 9, TINY["hidden_size"])
    assert logits.shape == (3, 9, VOCAB)
    assert not hidden.requires_grad and not logits.requires_grad
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        torch.testing.assert_close(logits, out.logits, rtol=0, atol=0)
        torch.testing.assert_close(model.get_output_embeddings()(hidden), logits, rtol=0, atol=0)
        # the last hidden state is post-norm: it is what the lm_head consumes
        torch.testing.assert_close(hidden, out.hidden_states[-1], rtol=0, atol=0)


def test_target_states_tied(tied):
    model, _ = tied
    ids = torch.randint(0, VOCAB, (2, 6))
    hidden, logits = target.target_states(model, ids)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden @ model.get_input_embeddings().weight.T, logits)


def test_target_states_left_padding(saved):
    _, model, _ = saved
    torch.manual_seed(4)
    lengths = [7, 3, 5]
    width = max(lengths)
    rows = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1

    hidden, logits = target.target_states(model, ids, mask)
    for i, row in enumerate(rows):
        ref_hidden, ref_logits = target.target_states(model, row[None])
        valid = slice(width - len(row), width)
        torch.testing.assert_close(hidden[i, valid], ref_hidden[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits[i, valid], ref_logits[0], rtol=0, atol=1e-5)
        assert torch.all(hidden[i, : width - len(row)] == 0)


def test_target_states_rejects_bad_shapes(saved):
    _, model, _ = saved
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        target.target_states(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match"):
        target.target_states(model, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4))


def test_positions_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    assert torch.equal(target.positions_from_mask(mask), expected)


# --- identity -------------------------------------------------------------------------------


def test_target_id_is_stable_and_tracks_content(sharded, tmp_path):
    _, path = sharded
    first = target.target_id(path)
    assert first == target.target_id(path)
    assert first.startswith(path.name + "@")

    copy = tmp_path / path.name
    copy.mkdir()
    for file in path.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert target.target_id(copy) == first

    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config["rms_norm_eps"] != 1e-5 else 1e-6
    (copy / "config.json").write_text(json.dumps(config))
    assert target.target_id(copy) != first


def test_target_id_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        target.target_id(tmp_path / "missing")
