"""Synthetic feature-store shards for the store tests (local and object-store)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from specdraft import store

D, K, V = 8, 4, 50


def synthetic_shard(
    idx: int, rng: np.random.Generator, gen: torch.Generator, *, per_shard: int, codec: str = "fp16", d: int = D,
    aux: tuple[int, ...] = (), prefix: str = "s", max_len: int = 24, min_len: int = 2,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every array of shard ``idx`` (``per_shard`` sequences of min_len..max_len-1 tokens, drawn from ``rng``
    and ``gen``), and the float values they encode: ``hidden``, ``aux_hidden``, ``logits``, ``top``. A dump
    stores no sequence shorter than 2 tokens (``chat.tokenize_conversation``); ``min_len=1`` writes some."""
    lengths = rng.integers(min_len, max_len, size=per_shard)
    n = int(lengths.sum())
    hidden = torch.randn(n, d, generator=gen) * 3  # (N, d)
    logits = torch.randn(n, V, generator=gen) * 4  # (N, V)
    top = logits.topk(K, dim=-1)
    arrays = store.encode_hidden(hidden, codec)
    aux_hidden = torch.randn(n, len(aux) * d, generator=gen) * torch.arange(1, len(aux) + 1).repeat_interleave(d)
    if aux:  # (N, L*d), layer l scaled by l + 1
        arrays.update(store.encode_hidden(aux_hidden, codec, name="aux_hidden", parts=len(aux)))
    arrays.update(
        input_ids=rng.integers(0, V, size=n).astype(np.int32),
        loss_mask=rng.integers(0, 2, size=n).astype(np.uint8),
        topk_ids=top.indices.to(torch.int32).numpy(),
        topk_logits=top.values.to(torch.float16).numpy(),
        logsumexp=torch.logsumexp(logits, -1).numpy(),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        sample_ids=np.asarray([f"{prefix}{idx}-{j}" for j in range(per_shard)], dtype=str),
    )
    return arrays, {"hidden": hidden, "aux_hidden": aux_hidden, "logits": logits, "top": top}
