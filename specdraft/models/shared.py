"""The true states' encoding of one batch, computed once for the sub-steps back-propagated on their own.

Beagle's late stage ("Cross-Attention Speculative Decoding" §4.2, Eq. 6) and HASS's alignment ("Learning
Harmonized Representations for Speculative Sampling" §3.2) run s sub-steps over the same batch, each
back-propagated before the next (``objectives.train_batch``). Every sub-step reads the same encoding of
the target's true states (Beagle: their keys/values, fc then k/v over all T positions; EAGLE: the true
slots and their keys/values), which a sub-step's own graph would encode anew each time: s encodings
and s backwards through them per batch.

``SharedEncoding`` encodes them once. The first sub-step's draft forward hands it the encoding
(``Chain.set_true``); it keeps that graph-carrying ``source`` and gives sub-steps 1..s-1 detached
copies that require a gradient, whose gradients it sums in fp32 as each sub-step's backward reaches
them. The last sub-step reads the source itself through ``_Inject``, an identity whose backward adds
that sum to the last sub-step's own gradient: the encoding is back-propagated once, in the last
backward (so a distributed wrapper still synchronises every gradient there). Since the backward of
the encoding is linear in its incoming gradient, the parameters' gradients are those of s separate
backwards, up to the order of the floating-point sums (``tests/specdraft/test_objectives.py`` compares
them with an explicit per-chain loop, ``tests/specdraft/models/test_shared.py`` with the per-sub-step encoding,
``objectives.substeps(share_true=False)``).
"""

from __future__ import annotations

import torch

from specdraft.models.layers import KV


def encoding_tensors(encoding) -> list[torch.Tensor]:
    """The tensors of an encoding: a ``KV``, a tensor, or a tuple of them (EAGLE's (slots, KV))."""
    if isinstance(encoding, KV):
        return [encoding.k, encoding.v]
    if isinstance(encoding, torch.Tensor):
        return [encoding]
    return [t for part in encoding for t in encoding_tensors(part)]


def with_tensors(encoding, tensors: list[torch.Tensor]):
    """``encoding``'s structure filled with ``tensors`` (consumed from the front)."""
    if isinstance(encoding, KV):
        return KV(tensors.pop(0), tensors.pop(0))
    if isinstance(encoding, torch.Tensor):
        return tensors.pop(0)
    return type(encoding)(with_tensors(part, tensors) for part in encoding)


class SharedEncoding:
    """One batch's true-state encoding shared by ``steps`` sub-steps back-propagated one by one."""

    def __init__(self, steps: int):
        self.steps = steps
        self.read = 0  # sub-steps that have read the encoding
        self.source = None  # the encoding with its graph, from the first sub-step's forward
        self.grads: list[torch.Tensor | None] = []  # fp32 sums of the gradients reaching the copies

    def take(self, encoding=None):
        """What the next sub-step reads: the first one passes the ``encoding`` it computed (the others pass
        nothing); a detached copy accumulating its gradient, or, for the last sub-step, the source itself."""
        if self.source is None:
            assert encoding is not None, "the first sub-step encodes the true states"
            self.source = encoding
            self.grads = [None] * len(encoding_tensors(encoding))
        self.read += 1
        assert self.read <= self.steps, f"{self.read} sub-steps read an encoding shared by {self.steps}"
        tensors = encoding_tensors(self.source)
        if self.read == self.steps or not torch.is_grad_enabled():
            if self.read == 1 or not torch.is_grad_enabled():
                return self.source
            return with_tensors(self.source, list(_Inject.apply(self, *tensors)))
        copies = []
        for i, t in enumerate(tensors):
            copy = t.detach().requires_grad_(t.requires_grad)
            if t.requires_grad:
                copy.register_hook(lambda g, i=i: self._add(i, g))
            copies.append(copy)
        return with_tensors(self.source, copies)

    def _add(self, i: int, grad: torch.Tensor) -> None:
        self.grads[i] = grad.float() if self.grads[i] is None else self.grads[i].add_(grad)


class _Inject(torch.autograd.Function):
    """Identity on the encoding's tensors; the backward adds the earlier sub-steps' summed gradients."""

    @staticmethod
    def forward(ctx, shared: SharedEncoding, *tensors):
        ctx.shared = shared
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        summed = ctx.shared.grads
        out = [g if s is None else (s + g.float()).to(g.dtype) for g, s in zip(grads, summed)]
        return (None, *out)
