"""Device and kernel choices a setting may name (the attention kernels, GPUs per Ray actor), checked without torch."""

from __future__ import annotations

from specdraft.config import ConfigError

ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
# kernels that take a custom 4D additive mask (tree verification needs one; flash-attention cannot)
MASK_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def spread_gpus(num_gpus: float, key: str = "gpus per actor") -> int:
    """How many GPUs the target is spread over for a Ray request of ``num_gpus`` per actor.

    A fraction (0 < n <= 1) shares one GPU with other actors: 1. A whole number N > 1: the
    actor holds N GPUs and its target is split over all of them. Anything else is a ``ConfigError`` naming ``key``.
    """
    if not (num_gpus > 0 and (num_gpus <= 1 or float(num_gpus).is_integer())):
        raise ConfigError(f"{key}={num_gpus}: GPUs per actor must be a fraction <= 1 (a shared GPU) or a whole number "
                          f"(the target is spread over that many)")
    return max(1, int(num_gpus))


def check_attn_implementation(value: str, key: str = "attn_implementation") -> None:
    if value not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"{key}: unknown attention kernel {value!r}; known: {list(ATTN_IMPLEMENTATIONS)}")
