"""Toy tokenizer: byte-level round trip, special tokens, chat template through save/load."""

import pytest
from transformers import AutoTokenizer

from specdraft.toy.conversations import generate_conversations
from specdraft.toy.tokenizer import SPECIAL_TOKENS, train_tokenizer

CONV = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 23 + 45?"},
    {"role": "assistant", "content": "23 + 45 = 68."},
    {"role": "user", "content": "Now double it."},
    {"role": "assistant", "content": "68 * 2 = 136."},
]
RENDERED = (
    "<|bos|><|system|>\nYou are a helpful assistant.<|end|>\n"
    "<|user|>\nWhat is 23 + 45?<|end|>\n<|assistant|>\n23 + 45 = 68.<|end|>\n"
    "<|user|>\nNow double it.<|end|>\n<|assistant|>\n68 * 2 = 136.<|end|>\n"
)


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    convs = generate_conversations(500, seed=0)
    tok = train_tokenizer((m["content"] for c in convs for m in c), vocab_size=400)
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return tok, AutoTokenizer.from_pretrained(path)


def test_vocab_and_special_tokens(saved_tokenizer):
    tok, loaded = saved_tokenizer
    for t in (tok, loaded):
        assert len(t) == 400
        assert t.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
        assert (t.bos_token, t.eos_token, t.pad_token) == ("<|bos|>", "<|end|>", "<|pad|>")
        assert t.eos_token_id == t.convert_tokens_to_ids("<|end|>")
        assert t("<|user|>\nhi<|end|>", add_special_tokens=False)["input_ids"][0] == t.convert_tokens_to_ids("<|user|>")


@pytest.mark.parametrize("text", [
    "What is 23 + 45?", " leading and  double  spaces ", "tabs\tand\nnewlines\n\n",
    "ünïcödé 😀 and 12345678901234", "Sort these words: zebra, Apple.",
])
def test_byte_level_round_trip(saved_tokenizer, text):
    tok, loaded = saved_tokenizer
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == text
    assert all(0 <= i < len(loaded) for i in ids)


def test_digits_are_single_tokens(saved_tokenizer):
    _, loaded = saved_tokenizer
    assert [t for t in loaded.tokenize("1234") if t] == ["1", "2", "3", "4"]


def test_chat_template_render_and_tokenize(saved_tokenizer):
    _, loaded = saved_tokenizer
    assert loaded.apply_chat_template(CONV, tokenize=False) == RENDERED
    prompt = loaded.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == RENDERED.split("<|assistant|>")[0] + "<|assistant|>\n"
    enc = loaded.apply_chat_template(CONV, tokenize=True)
    assert enc["input_ids"] == loaded(RENDERED, add_special_tokens=False)["input_ids"]
    assert enc["input_ids"][0] == loaded.bos_token_id
    assert loaded.decode(enc["input_ids"]) == RENDERED
    ids = loaded.apply_chat_template(CONV, tokenize=True, return_dict=False)
    assert ids == enc["input_ids"]


def test_assistant_mask_covers_answers_and_their_end(saved_tokenizer):
    _, loaded = saved_tokenizer
    enc = loaded.apply_chat_template(CONV, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    assert len(mask) == len(ids)
    learned = loaded.decode([i for i, m in zip(ids, mask) if m])
    assert learned == "23 + 45 = 68.<|end|>68 * 2 = 136.<|end|>"
