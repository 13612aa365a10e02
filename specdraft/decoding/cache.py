"""The target's KV cache and verification mask in preallocated buffers (gpt-fast style static caches,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §4.2: tree attention).

* ``TargetCache`` — a ``transformers`` ``DynamicCache`` whose layers (``CommitLayer``) write into
  buffers of a fixed capacity allocated at their first update, and hand the model views of their
  first ``length`` entries. To the model it is an ordinary dynamic cache (the same mask sizes, the
  same ``get_seq_length``; no ``cache_position`` is read, so it works with every 5.x release); to
  the decoding loop it is static: a verification forward writes root + tree after the prefix, and
  ``commit`` keeps the prefix, the root and the accepted path by moving only the path's entries
  into place (none for a chain, whose accepted path already sits there) instead of re-copying the
  whole cache (``verify.compact_cache`` on a plain ``DynamicCache``: O(context) per round).
* ``VerifyMask`` — the additive verification mask ``[1, 1, N, past + N]`` as a view of one
  preallocated ``(rows, capacity)`` buffer whose prefix columns are always 0 (visible): a round
  writes only its tree block (N x N) and clears the previous one, never the O(N x context) prefix.

Both grow (reallocate, doubling) only when a round needs more than they hold; ``capacity`` is sized
so that a generation never does (prompt + max_new_tokens + the largest tree).
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdraft.placement import host_ids


class CommitLayer(DynamicLayer):
    """A full-attention cache layer over preallocated key/value buffers (B, Hkv, capacity, Dh)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = key_states.new_zeros(*key_states.shape[:2], self.capacity, key_states.shape[3])
        self.value_buffer = value_states.new_zeros(*value_states.shape[:2], self.capacity, value_states.shape[3])
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]
        self.is_initialized = True

    def _reserve(self, length: int) -> None:
        if length <= self.key_buffer.shape[2]:
            return
        size = max(length, 2 * self.key_buffer.shape[2])
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], size, old.shape[3])  # (B, Hkv, size, Dh)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def _expose(self, length: int) -> None:
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new entries (B, Hkv, q, Dh) after the current ones; return all of them (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        self._reserve(end)
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self._expose(end)
        return self.keys, self.values

    def commit(self, past: int, path: list[int], index: torch.Tensor | None) -> None:
        """Keep the ``past`` prefix, the root (at ``past``) and the tree nodes ``path`` (their entries at
        ``past + path[i]``, moved to ``past + 1 + i``); ``index`` = ``past + path`` on the layer's device,
        or None when ``path`` is 1..len(path) (a chain's accepted prefix: already in place)."""
        n = len(path)
        if index is not None:
            for buffer in (self.key_buffer, self.value_buffer):
                buffer[:, :, past + 1 : past + 1 + n] = buffer.index_select(2, index.to(buffer.device))
        self._expose(past + 1 + n)

    def crop(self, tokens_to_remove: int) -> None:
        length = self.keys.shape[-2]
        keep = tokens_to_remove if tokens_to_remove > 0 else length + tokens_to_remove
        self._expose(max(0, min(length, keep)))

    def reset(self) -> None:
        if self.is_initialized:
            self._expose(0)


class TargetCache(DynamicCache):
    """A ``DynamicCache`` of ``CommitLayer``s holding up to ``capacity`` tokens each (see the module docstring)."""

    def __init__(self, capacity: int, num_layers: int = 0):
        super().__init__()
        self.capacity = capacity
        self.layers = [CommitLayer(capacity) for _ in range(num_layers)]
        self.layer_class_to_replicate = partial(CommitLayer, capacity)  # layers the model reaches beyond


def target_cache(model: torch.nn.Module, capacity: int) -> TargetCache:
    """An empty ``TargetCache`` for ``model``, one layer per decoder layer, ``capacity`` tokens each."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return TargetCache(capacity, int(getattr(text, "num_hidden_layers", 0) or 0))


def commit(cache: TargetCache, past: int, path: list[int]) -> None:
    """Keep prefix + root + accepted ``path`` in every layer (``CommitLayer.commit``)."""
    in_place = path == list(range(1, len(path) + 1))
    index = None
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if index is None and not in_place:
            index = host_ids(path, layer.key_buffer.device) + past  # (len(path),)
        layer.commit(past, path, index)


class VerifyMask:
    """The verification mask ``[1, 1, N, past + N]`` (additive, ``dtype``) over one preallocated buffer."""

    def __init__(self, rows: int, capacity: int, dtype: torch.dtype, device: torch.device | str):
        self.buffer = torch.zeros(rows, capacity, dtype=dtype, device=device)  # (rows, capacity)
        self.hidden = torch.finfo(dtype).min
        self.written: tuple[int, int] = (0, 0)  # columns holding the last tree block
        self.window: int | None | str = "unchecked"  # the target's sliding window (``verify.verify_tree`` sets it)

    def for_tree(self, ancestors: torch.Tensor, past: int) -> torch.Tensor:
        """Every node sees the ``past`` cached tokens and its ancestors-or-self (``ancestors`` (N, N) bool)."""
        n = ancestors.shape[0]
        rows, capacity = self.buffer.shape
        if n > rows or past + n > capacity:
            grown = torch.zeros(max(n, rows), max(past + n, 2 * capacity), dtype=self.buffer.dtype,
                                device=self.buffer.device)
            self.buffer, self.written = grown, (0, 0)
        lo, hi = self.written
        self.buffer[:, lo:hi] = 0  # the last block's columns are prefix now (or are rewritten below)
        self.buffer[:n, past : past + n].masked_fill_(~ancestors.to(self.buffer.device), self.hidden)
        self.written = (past, past + n)
        return self.buffer[:n, : past + n][None, None]  # (1, 1, N, past+N)
