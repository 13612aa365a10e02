"""The tiny Hugging Face model shapes the tests build random targets from (one table, not one per test file).

``FAMILIES``: the architectures a test parametrizes over (config class, model class). ``TINY``: hidden 64,
2 layers, grouped-query attention (4 heads over 2 key/value heads); the vocabulary is the caller's (a fixed
size, or its tokenizer's). ``NARROW``: hidden 32, for a second target of another shape or a faster one.
"""

from __future__ import annotations

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
NARROW = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
