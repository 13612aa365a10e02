"""Everything that decides a toy target build (``specdraft/toy/build.py``): data, tokenizer, a small Llama, its training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyTargetConfig:
    """Everything that determines a toy target build.

    The defaults train in about 75 s on one CPU core (2-core laptop) and reach a loss of about
    0.13 on assistant tokens (held-out 0.14; two heads of 32: vLLM's CPU attention serves no smaller head); about two thirds of greedy answers to held-out prompts are
    exactly right (facts and formats are learned, multi-digit arithmetic and sorting mostly
    are not). A narrower, shallower model wins at this budget: it gets more optimizer steps,
    and copying from the prompt (counting ranges, repeating words) only appears after
    ~1000 steps; hidden 128 x 4 layers reaches ~35% exact in the same time.
    """

    seed: int = 0
    # data + tokenizer
    data: Literal["chat", "word_problems"] = "chat"  # conversation family (DATA_FAMILIES)
    num_conversations: int = 12000
    vocab_size: int = 768
    # model (Llama, GQA, untied lm_head)
    hidden_size: int = 64  # model width d
    num_layers: int = 3
    num_heads: int = 2  # head_dim 32: the smallest head size vLLM's CPU attention serves
    num_kv_heads: int = 1
    intermediate_size: int = 192
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    # training
    max_seq_len: int = 192  # training sequences are truncated to this many tokens
    train_steps: int = 1400
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    assistant_only_loss: bool = True  # loss on assistant tokens (+ their <|end|>) only
    max_train_seconds: float | None = None  # stop early on wall time (breaks determinism)
    # torch CPU threads during the build. Weights depend on it bitwise; 1 is also the fastest
    # choice on a busy 2-core machine (2 threads spin on each other: 5-20x slower per step).
    num_threads: int = 1
    num_eval_conversations: int = 256  # held-out loss, seed + 1
