"""render_with_loss_mask: exactly the assistant content + its end-of-turn token, for any template.

Each template is checked on a locally built byte-level BPE tokenizer by decoding the masked
tokens run by run and comparing them with what the assistant said plus the end-of-turn
marker; the toy template is also checked against HF's ``{% generation %}`` assistant mask.
"""

from __future__ import annotations

import warnings

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdraft.chat import (FALLBACK_CHAT_TEMPLATE, RenderError, assistant_spans, ensure_chat_template,
                           render_with_loss_mask, tokenize_conversation)
from specdraft.toy.tokenizer import wrap_tokenizer

CHATML_TEMPLATE = (  # Qwen2.5-style: a default system prompt when none is given
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (  # Meta-Llama-3-Instruct's template (content is trimmed)
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
QWEN3_TEMPLATE = (  # Qwen3's history rewriting: only an answer after the last user turn gets a think block
    "{%- set ns = namespace(last_query_index=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' or message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if loop.index0 > ns.last_query_index and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
MISTRAL_TEMPLATE = (  # Mistral-7B-Instruct-v0.1: no assistant header, eos closes the turn
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

CORPUS = [
    "Hello there! How are you today?", "I am fine, thank you.", "What is 2 + 3? The answer is 5.",
    "def add(a, b):\n    return a + b\n", "You are a helpful assistant.", "Tell me a story about a cat.",
    "Once upon a time, a cat sat on a mat.", "system user assistant", "Sure, here it is:\n\n- one\n- two",
]


def _bpe(specials: list[str], **kwargs) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)


def toy_tokenizer() -> PreTrainedTokenizerFast:
    from specdraft.toy.tokenizer import SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return wrap_tokenizer(tok)


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    return _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|endoftext|>",
                pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                chat_template=CHATML_TEMPLATE)


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _bpe(specials, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",  # base-model eos:
                additional_special_tokens=specials[2:], chat_template=LLAMA3_TEMPLATE)  # <|eot_id|> is found anyway


def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    return _bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], eos_token="<|im_end|>",
                pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                chat_template=QWEN3_TEMPLATE)


def mistral_tokenizer() -> PreTrainedTokenizerFast:
    return _bpe(["<unk>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                chat_template=MISTRAL_TEMPLATE)


def base_tokenizer() -> PreTrainedTokenizerFast:
    """A base model's tokenizer: bos and eos, no chat template."""
    return _bpe(["<s>", "</s>"], bos_token="<s>", eos_token="</s>")


def fallback_tokenizer() -> PreTrainedTokenizerFast:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ensure_chat_template(base_tokenizer())


# name -> (tokenizer factory, end-of-turn marker, content as the template renders it, has system)
TEMPLATES = {
    "fallback": (fallback_tokenizer, "</s>", lambda c: c, True),
    "toy": (toy_tokenizer, "<|end|>", lambda c: c, True),
    "chatml": (chatml_tokenizer, "<|im_end|>", lambda c: c, True),
    "llama3": (llama3_tokenizer, "<|eot_id|>", str.strip, True),
    "mistral": (mistral_tokenizer, "</s>", lambda c: c, False),
    "qwen3": (qwen3_tokenizer, "<|im_end|>", lambda c: c, True),
}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template(request):
    factory, eot, rendered, has_system = TEMPLATES[request.param]
    return request.param, factory(), eot, rendered, has_system


def conversation(assistant: list[str], system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system is not None else []
    for i, answer in enumerate(assistant):
        messages += [{"role": "user", "content": f"Question number {i}? Tell me a story."},
                     {"role": "assistant", "content": answer}]
    return messages


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def assert_exact_mask(tokenizer, messages, eot, rendered):
    out = render_with_loss_mask(tokenizer, messages)
    expected = [rendered(m["content"]) + eot for m in messages if m["role"] == "assistant"]
    assert masked_runs(tokenizer, out.input_ids, out.loss_mask) == expected
    # the ids are the tokenization of the full rendered conversation
    assert out.text == tokenizer.apply_chat_template(messages, tokenize=False)
    assert out.input_ids == tokenizer(out.text, add_special_tokens=False)["input_ids"]
    return out


CASES = {
    "one_turn": (["Once upon a time, a cat sat on a mat."], None),
    "multi_turn": (["I am fine, thank you.", "The answer is 5.", "def add(a, b):\n    return a + b"], None),
    "system": (["Sure, here it is:\n\n- one\n- two", "Hello there!"], "You are a helpful assistant."),
    "same_answer_twice": (["ok", "ok"], None),
    "answer_repeats_the_prompt": (["Question number 0? Tell me a story."], None),
    "role_word_as_answer": (["assistant", "user"], None),
    "single_char": (["a", "5"], None),
    "unicode": (["héllo wörld — ✓ 猫", "emoji 🐈 too"], None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_is_assistant_content_plus_end_of_turn(template, case):
    name, tokenizer, eot, rendered, has_system = template
    answers, system = CASES[case]
    if system is not None and not has_system:
        pytest.skip(f"{name} template has no system role")
    assert_exact_mask(tokenizer, conversation(answers, system), eot, rendered)


@pytest.mark.parametrize("answer", ["", " ", "\n", "  padded  ", "\nleading newline", "trailing newline\n"])
def test_empty_ish_and_whitespace_content(template, answer):
    name, tokenizer, eot, rendered, _ = template
    messages = conversation([answer, "I am fine, thank you."])
    out = render_with_loss_mask(tokenizer, messages)
    runs = masked_runs(tokenizer, out.input_ids, out.loss_mask)
    assert len(runs) == 2
    assert runs[1] == "I am fine, thank you." + eot
    # whitespace may merge with neighbouring template text into one token; the marker is always
    # in, the content always is, and nothing from the user turn or the next header leaks in
    assert runs[0].endswith(eot)
    assert rendered(answer) in runs[0]
    assert "Question" not in runs[0] and len(runs[0]) <= len(rendered(answer) + eot) + 2


def test_conversation_ending_with_a_user_turn_has_no_open_span(template):
    name, tokenizer, eot, rendered, _ = template
    messages = conversation(["I am fine, thank you."]) + [{"role": "user", "content": "And then?"}]
    out = render_with_loss_mask(tokenizer, messages)
    assert masked_runs(tokenizer, out.input_ids, out.loss_mask) == ["I am fine, thank you." + eot]


def test_answer_containing_the_end_marker_text(template):
    name, tokenizer, eot, rendered, _ = template
    answer = f"the marker is {eot} and more"
    out = assert_exact_mask(tokenizer, conversation([answer, "done"]), eot, rendered)
    assert sum(out.loss_mask) > 0


def test_max_length_truncates_ids_and_mask_together(template):
    _, tokenizer, eot, rendered, _ = template
    messages = conversation(["I am fine, thank you.", "The answer is 5."])
    full = render_with_loss_mask(tokenizer, messages)
    short = render_with_loss_mask(tokenizer, messages, max_length=len(full.input_ids) - 3)
    assert short.input_ids == full.input_ids[:-3] and short.loss_mask == full.loss_mask[:-3]


def test_a_conversation_cut_right_after_its_first_assistant_token_trains_nothing(template):
    """Position p trains the prediction of token p+1: a sequence whose only assistant token is its last (cut by
    max_length, or a one-token sequence) has nothing to train and is rejected as ``no_loss_tokens``, not stored."""
    _, tokenizer, _, _, _ = template
    messages = conversation(["I am fine, thank you."])
    full = render_with_loss_mask(tokenizer, messages)
    first = full.loss_mask.index(1)
    cut = tokenize_conversation(tokenizer, messages, max_length=first + 1)
    assert cut.rejected == "no_loss_tokens" and cut.truncated and cut.input_ids == []
    kept = tokenize_conversation(tokenizer, messages, max_length=first + 2)  # one trained position: kept
    assert kept.rejected is None and kept.loss_mask == full.loss_mask[: first + 2]


def test_toy_template_agrees_with_hf_generation_mask():
    tokenizer = toy_tokenizer()
    for answers, system in CASES.values():
        messages = conversation(answers, system)
        ours = render_with_loss_mask(tokenizer, messages)
        hf = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
        assert ours.input_ids == hf["input_ids"]
        assert ours.loss_mask == hf["assistant_masks"]


def test_spans_are_character_exact_for_chatml():
    tokenizer = chatml_tokenizer()
    messages = conversation(["I am fine.", "Five."], system="Be brief.")
    text, spans = assistant_spans(tokenizer, messages)
    assert [text[s:e] for s, e in spans] == ["I am fine.<|im_end|>", "Five.<|im_end|>"]


def test_prefix_unstable_template_is_an_error():
    tokenizer = chatml_tokenizer()
    # renders only the last assistant message: a prefix is not a prefix of the whole
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'user' or loop.last %}"
        "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with pytest.raises(RenderError, match="prefix"):
        render_with_loss_mask(tokenizer, conversation(["one", "two"]))


def test_history_rewriting_template_falls_back_to_search():
    tokenizer = qwen3_tokenizer()
    messages = conversation(["I am fine, thank you.", "The answer is 5."], system="Be brief.")
    prefix = tokenizer.apply_chat_template(messages[:3], tokenize=False)
    assert not tokenizer.apply_chat_template(messages, tokenize=False).startswith(prefix)  # rewrites history
    out = assert_exact_mask(tokenizer, messages, "<|im_end|>", lambda c: c)
    assert "<think>" in out.text  # the last answer's empty think block is template text: not masked


def test_a_tokenizer_without_template_gets_the_plain_text_fallback_and_one_warning(tmp_path):
    from specdraft.targets.loading import load_tokenizer

    base = base_tokenizer()
    assert not base.chat_template
    base.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # load_tokenizer reads model directories
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        tokenizers = [load_tokenizer(tmp_path), load_tokenizer(tmp_path)]
    assert [str(w.message) for w in caught if "no chat template" in str(w.message)] == [
        f"the tokenizer of {tmp_path} has no chat template: using specdraft's plain-text fallback "
        "('### User:' / '### Assistant:' headers, eos closes an assistant turn)"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    for tok in tokenizers:
        assert tok.chat_template == FALLBACK_CHAT_TEMPLATE
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
            "<s>### System:\nBe brief.\n\n### User:\nHi?\n\n### Assistant:\nHello.</s>\n\n"
            "### User:\nBye?\n\n### Assistant:\n")
    # a template the tokenizer ships is kept
    assert ensure_chat_template(chatml_tokenizer()).chat_template == CHATML_TEMPLATE
