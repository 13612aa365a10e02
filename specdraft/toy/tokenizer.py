"""The toy target's tokenizer: byte-level BPE + a minimal chat template.

Trained with the Hugging Face ``tokenizers`` library on the generated messages and
wrapped in ``transformers.PreTrainedTokenizerFast`` so it saves/loads like any hub
tokenizer. Digits are split one per token (small models learn arithmetic more easily),
byte-level pre-tokenization without a prefix space makes ``decode(encode(text)) == text``.

Chat format::

    <|bos|><|system|>\\n{content}<|end|>\\n<|user|>\\n{content}<|end|>\\n<|assistant|>\\n{content}<|end|>\\n

with ``add_generation_prompt`` appending ``<|assistant|>\\n``. ``<|end|>`` is the eos
token (the model stops there); assistant content plus its ``<|end|>`` is wrapped in
``{% generation %}`` so ``return_assistant_tokens_mask=True`` gives the loss mask.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|bos|>"
END = "<|end|>"
PAD = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, END, *ROLE_TOKENS)  # ids 0..5, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + '<|end|>' }}"
    "{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 768) -> PreTrainedTokenizerFast:
    """Byte-level BPE of ``vocab_size`` tokens (specials included) trained on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """``tokenizers.Tokenizer`` -> transformers tokenizer with specials and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )
