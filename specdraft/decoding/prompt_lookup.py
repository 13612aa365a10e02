"""Prompt-lookup decoding (PLD): a training-free drafter that copies from the context.

Prompt lookup (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; ``transformers``'
``PromptLookupCandidateGenerator``) drafts by n-gram matching over the prompt plus the tokens
generated so far. Every round:
* the *suffix n-gram* is the last n committed tokens (the last one is the round's root), for
  n = ``max_ngram`` down to ``min_ngram``; the longest n with an earlier occurrence wins;
* of its earlier occurrences (ending before the last position; overlap with the suffix is
  allowed) the most recent one is used: recent context predicts the next tokens best;
* the proposal is the γ tokens that followed that occurrence, as a deterministic chain
  (q = δ_x, ``DraftTree.proposals = None``). When the occurrence is so recent that its
  continuation runs into the current suffix (distance P = last - end < γ, a repeating
  pattern), the copy goes on LZ77-style — token j is the continuation's token j mod P — so
  a repeat still proposes γ tokens instead of P;
* no occurrence of even a ``min_ngram``-gram: the round proposes nothing (root-only tree,
  a plain decode step that still counts as a round in τ).

Verification, acceptance (greedy, or lossless speculative sampling with q = δ_x), cache
compaction and counting are ``speculative.speculative_decode``'s — the same loop a model
draft runs through — so τ_PLD is counted exactly like a draft's τ. It is the floor every
evaluation reports: a trained draft that does not beat copying is not worth serving.

Defaults: ``max_ngram`` 3, ``min_ngram`` 1 (Saxena's reference settings; ``transformers``
uses 2..1). Longer suffixes rarely pick a different occurrence in chat text, and a 1-gram
match still beats proposing nothing: a wrong proposal costs extra positions in the same
verification forward, never an extra forward. ``gamma`` defaults to the draft's deepest
proposal (chain γ, or the tree depth), so PLD can at best match the draft's longest path.

The search is vectorised over the whole context: O(max_ngram · L) elementwise compares per
round, in numpy on a CPU copy of the token ids (no device syncs; numpy's per-call overhead is
~10x below torch's at these sizes, which dominates up to tens of thousands of tokens). The
context lives in a growing preallocated buffer, not re-concatenated every round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdraft.configs.decode import DecodeConfig, PromptLookupConfig
from specdraft.decoding.speculative import Generation, speculative_decode
from specdraft.decoding.tree import DraftTree, chain_of_tokens


def find_match(context: np.ndarray, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, int] | None:
    """(n, end) of the longest suffix n-gram of ``context`` (L,) with an earlier occurrence
    (max_ngram >= n >= min_ngram) and the end index of its most recent one; None if no match."""
    assert context.ndim == 1, f"context must be (L,), got {context.shape}"
    last = context.size - 1
    if last < 1:
        return None
    hit = context[:last] == context[last]  # (L-1,): hit[e] = a 1-gram occurrence ends at e < last
    found = None
    for n in range(1, min(max_ngram, last) + 1):
        if n > 1:  # extend every surviving occurrence one token to the left
            hit[: n - 1] = False
            hit[n - 1 :] &= context[: last - n + 1] == context[last - n + 1]  # (L-n,)
        ends = np.flatnonzero(hit)  # (M,)
        if ends.size == 0:
            break
        if n >= min_ngram:
            found = (n, int(ends[-1]))
    return found


def continuation(context: np.ndarray, end: int, gamma: int) -> np.ndarray:
    """The ``gamma`` tokens (gamma,) after position ``end`` of ``context`` (L,), copied on with
    period P = L - 1 - end once they run past the end of the context."""
    period = context.size - 1 - end
    assert period >= 1 and gamma >= 1, f"end {end} must precede the last position; gamma {gamma} must be >= 1"
    return context[end + 1 + np.arange(gamma) % period]  # (gamma,)


def lookup_proposal(context: np.ndarray, gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> np.ndarray:
    """The PLD proposal (k,) for ``context`` (L,) token ids: k = gamma after a match, else k = 0."""
    match = find_match(context, max_ngram, min_ngram)
    if match is None:
        return context[:0]
    return continuation(context, match[1], gamma)


@dataclass
class LookupState:
    """The committed tokens (prompt + generated, the root last) in a growing buffer."""

    buffer: np.ndarray  # (capacity,) int64
    length: int
    device: torch.device  # where the draft trees go (the target's device)

    @property
    def context(self) -> np.ndarray:
        return self.buffer[: self.length]  # (L,)

    def append(self, tokens: list[int]) -> None:
        need = self.length + len(tokens)
        if need > self.buffer.size:
            grown = np.zeros(max(need, 2 * self.buffer.size), dtype=np.int64)
            grown[: self.length] = self.context
            self.buffer = grown
        self.buffer[self.length : need] = tokens
        self.length = need


@dataclass(frozen=True, slots=True)
class PromptLookupDrafter:
    """The ``speculative.Drafter`` of prompt lookup (see the module docstring); ignores target features."""

    gamma: int
    max_ngram: int = 3
    min_ngram: int = 1

    @property
    def max_depth(self) -> int:
        return self.gamma

    @property
    def max_nodes(self) -> int:
        return self.gamma + 1

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return ()  # the last hidden state: free, and unused

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor, first_token: int) -> LookupState:
        assert prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1, f"batch 1 only, got {tuple(prompt_ids.shape)}"
        prompt = prompt_ids[0].tolist()  # (P,)
        state = LookupState(np.zeros(2 * len(prompt) + 256, dtype=np.int64), 0, prompt_ids.device)
        state.append([*prompt, int(first_token)])
        return state

    def propose(self, state: LookupState, generator: torch.Generator | None = None) -> DraftTree:
        context = state.context  # (L,)
        proposal = lookup_proposal(context, self.gamma, self.max_ngram, self.min_ngram)  # (k,)
        return chain_of_tokens(int(context[-1]), proposal, state.device)  # structure cached per k

    def advance(self, state: LookupState, tokens: list[int], features: torch.Tensor) -> None:
        state.append(tokens)


def prompt_lookup_drafter(pld: PromptLookupConfig, decode: DecodeConfig) -> PromptLookupDrafter:
    return PromptLookupDrafter(pld.resolved_gamma(decode), pld.max_ngram, pld.min_ngram)


def prompt_lookup_generate(
    target: torch.nn.Module,
    prompt_ids,
    cfg: DecodeConfig = DecodeConfig(),
    pld: PromptLookupConfig = PromptLookupConfig(),
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """Lossless speculative decoding of ``target`` drafted by prompt lookup (``cfg``: sampling and
    max_new_tokens; ``pld``: gamma and n-gram range)."""
    return speculative_decode(target, prompt_lookup_drafter(pld, cfg), prompt_ids, cfg, eos_ids, generator)
