"""The draft's key/value cache for incremental drafting ("EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees" §4.1: the draft caches its committed entries and appends a round's drafted ones),
in preallocated buffers (gpt-fast style: no per-token concatenation).
"""

from __future__ import annotations

import torch

from specdraft.models.layers import KV


class KVCache:
    """Key/value cache for incremental drafting, in preallocated buffers.

    ``append`` writes entries after the first ``length`` (growing the buffers, by doubling, only when
    ``capacity`` is exceeded), ``crop(n)`` drops everything after the first n (the drafted entries at
    the end of each speculative-decoding round) without touching memory, and ``view`` is the first
    ``length`` entries (views of the buffers: valid until the next ``crop`` + ``append``). Nothing is
    re-concatenated per token: appending m entries copies m entries.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity  # entries allocated at the first append (at least what it brings)
        self.length = 0
        self.k: torch.Tensor | None = None  # (B, Hkv, capacity, Dh)
        self.v: torch.Tensor | None = None  # (B, Hkv, capacity, Dh)

    def reserve(self, length: int) -> None:
        """Room for ``length`` entries (the buffers keep their contents)."""
        if self.k is None or length <= self.k.shape[2]:
            self.capacity = max(self.capacity, length)
            return
        size = max(length, 2 * self.k.shape[2])
        k = self.k.new_empty(*self.k.shape[:2], size, self.k.shape[3])  # (B, Hkv, size, Dh)
        v = self.v.new_empty(*self.v.shape[:2], size, self.v.shape[3])  # (B, Hkv, size, Dh)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def append(self, kv: KV) -> None:
        end = self.length + kv.length
        if torch.is_grad_enabled() and (kv.k.requires_grad or kv.v.requires_grad or self.k is not None and
                                        self.k.requires_grad):  # autograd through the cache: never in place
            old = self.view() if self.length else None
            self.k, self.v = (kv.k, kv.v) if old is None else (torch.cat([old.k, kv.k], 2), torch.cat([old.v, kv.v], 2))
            self.length = end
            return
        if self.k is None:
            size = max(end, self.capacity)
            self.k = kv.k.new_empty(*kv.k.shape[:2], size, kv.k.shape[3])  # (B, Hkv, size, Dh)
            self.v = kv.v.new_empty(*kv.v.shape[:2], size, kv.v.shape[3])  # (B, Hkv, size, Dh)
        self.reserve(end)
        self.k[:, :, self.length : end] = kv.k
        self.v[:, :, self.length : end] = kv.v
        self.length = end

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot crop a cache of {self.length} entries to {length}"
        self.length = length

    def view(self) -> KV:
        assert self.length > 0, "the cache is empty: append states before attending"
        return KV(self.k[:, :, : self.length], self.v[:, :, : self.length])
