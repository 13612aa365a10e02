"""Speculative and vanilla generation, batch 1 ("EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees" §4; docs/evaluation.md).

One generation loop, ``speculative_decode(target, drafter, prompt_ids, cfg)``, serves every
drafter (a model draft here, training-free prompt lookup in ``prompt_lookup``):
  prefill   the target runs the prompt once into a preallocated ``cache.TargetCache`` (capacity:
            prompt + max_new_tokens + the largest tree), its last logits give the first new token
            (the root of round 1); ``drafter.start`` sees the prompt, the target's features the
            drafter asks for (``aux_layers``) and that token.
  round     ``drafter.propose`` returns a draft tree hanging from the root (a chain, an
            EAGLE-2 dynamic tree, or the root alone: a plain decode step), the target
            verifies root + tree in ONE forward (tree mask as a view of a preallocated buffer,
            tree positions), acceptance (greedy or speculative sampling, on the device) picks a
            path plus one target token (bonus / correction) and reads it to the host — the round's
            one host synchronisation —, the target cache commits prefix + root + path by index
            (only a tree path's entries move), and ``drafter.advance`` commits the emitted tokens
            with their target features.
  stop      EOS (``eos_ids``) or ``max_new_tokens``.

The seam is the ``Drafter`` protocol: plain functions over an explicit state that ``start``
returns (gpt-fast style), no hidden state in the loop. ``speculative_generate(target, draft,
...)`` is the loop with a ``ModelDrafter`` (Beagle / EAGLE draft, ``drafting`` + ``tree``) or, for a
block draft ("DFlash: Block Diffusion for Flash Speculative Decoding"), a ``block.BlockDrafter``.

Counting convention (``Generation``): ``rounds`` = target verification forwards (the
prefill is not one); ``round_tokens[r]`` = tokens round r appended to the output (accepted
drafts + its bonus token, after truncation at EOS / max_new_tokens), so
``len(tokens) == 1 + sum(round_tokens)`` when any round ran and τ = sum(round_tokens) / rounds.
``draft_s`` / ``verify_s`` split each round at the verification forward (CUDA events on a GPU, read
once at the end, so timing adds no synchronisation).

``vanilla_generate`` is the baseline: prefill, then one target forward per token into the same
kind of cache, with the same token choice (``sampling.choose_token``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdraft.decoding.block import BlockDrafter, block_gamma
from specdraft.decoding.cache import VerifyMask, commit, target_cache
from specdraft.decoding.drafting import DraftContext, advance_draft, start_draft
from specdraft.configs.decode import DecodeConfig
from specdraft.decoding.sampling import choose_token
from specdraft.decoding.tree import DraftTree, build_draft_chain, build_draft_tree
from specdraft.decoding.verify import accept_greedy, accept_sampling, target_forward, tree_height, verify_tree
from specdraft.models.layers import decoding_attention
from specdraft.placement import host_ids, input_device

@dataclass
class Generation:
    tokens: list[int]  # new tokens (prompt excluded; an EOS that stopped generation included)
    rounds: int = 0  # target verification forwards (vanilla: decode forwards after the prefill)
    round_tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per round
    depth_tried: list[int] = field(default_factory=list)  # (D,) rounds testing depth i's candidates
    depth_accepted: list[int] = field(default_factory=list)  # (D,) rounds accepting a depth-i token
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    stop: str = "length"  # "eos" | "length"


def eos_token_ids(model: torch.nn.Module | None = None, tokenizer=None) -> frozenset[int]:
    """EOS ids from the model's generation_config / config and the tokenizer."""
    ids: set[int] = set()
    sources = []
    if model is not None:
        sources += [getattr(model, "generation_config", None), getattr(model, "config", None)]
    if tokenizer is not None:
        sources.append(tokenizer)
    for src in sources:
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else list(value))
    return frozenset(int(i) for i in ids)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # every GPU this process sees: a target spread over GPUs ends on the last
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


class RoundClock:
    """Draft / verify time per round without extra synchronisation: ``perf_counter`` on a CPU, CUDA
    events on a GPU (queued with the work, read once by ``totals`` after the final synchronisation)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []  # (start, verify, end) per round
        self.draft_s = self.verify_s = 0.0

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start, verify, end) -> None:
        if self.cuda:
            self.marks.append((start, verify, end))
        else:
            self.draft_s += verify - start
            self.verify_s += end - verify

    def totals(self) -> tuple[float, float]:
        for start, verify, end in self.marks:  # after the generation's final synchronisation
            self.draft_s += start.elapsed_time(verify) / 1000
            self.verify_s += verify.elapsed_time(end) / 1000
        self.marks = []
        return self.draft_s, self.verify_s


def _finish(
    out: list[int], emitted: list[int], cfg: DecodeConfig, eos_ids: frozenset[int]
) -> tuple[list[int], str | None]:
    """``emitted`` cut at the first EOS and at max_new_tokens; the stop reason if generation ends."""
    kept = []
    for t in emitted:
        if len(out) + len(kept) >= cfg.max_new_tokens:
            return kept, "length"
        kept.append(t)
        if t in eos_ids:
            return kept, "eos"
    return kept, ("length" if len(out) + len(kept) >= cfg.max_new_tokens else None)


def _prompt_tensor(prompt_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    assert ids.dim() == 2 and ids.shape[0] == 1 and ids.shape[1] >= 1, (
        f"batch-1 decoding needs a non-empty prompt of shape (P,) or (1, P), got {tuple(ids.shape)}"
    )
    return ids  # (1, P)


class Drafter(Protocol):
    """The drafting side of ``speculative_decode``: plain functions over the state ``start`` returns.

    * ``start(prompt_ids (1, P), features (1, P, F), first_token) -> state``: after the target's
      prefill; ``features`` are what ``aux_layers`` asks of the target for the prompt.
    * ``propose(state, generator) -> DraftTree``: a tree whose root is the last committed token
      (``first_token``, then each round's bonus); a root-only tree makes the round a plain
      decode step. Nodes with ``proposals=None`` are deterministic choices (q = δ_x).
    * ``advance(state, tokens, features (1, m, F))``: commit ``tokens`` = the accepted drafts +
      the next root; ``features`` are the target's at the old root and the accepted drafts.
    * ``max_depth``: the deepest node ``propose`` can return (sizes the α_i counts).
    * ``max_nodes`` (optional): the most nodes a tree holds, root included (sizes the caches; they
      grow when a round needs more).
    * ``aux_layers``: the target features the drafter reads (``verify.target_forward``): () for
      the last hidden state, else the decoder-layer inputs an EAGLE-3 draft concatenates.
    """

    @property
    def max_depth(self) -> int: ...

    @property
    def aux_layers(self) -> tuple[int, ...]: ...

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor, first_token: int) -> Any: ...

    def propose(self, state: Any, generator: torch.Generator | None) -> DraftTree: ...

    def advance(self, state: Any, tokens: list[int], features: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class ModelDrafter:
    """A Beagle / EAGLE / EAGLE-3 draft model: a chain of ``cfg.gamma`` or an EAGLE-2 dynamic tree per round."""

    draft: torch.nn.Module
    cfg: DecodeConfig

    @property
    def max_depth(self) -> int:
        return self.cfg.max_depth

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.draft.config.aux_layers)

    @property
    def max_nodes(self) -> int:
        return self.cfg.max_nodes

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor, first_token: int) -> DraftContext:
        capacity = prompt_ids.shape[1] + self.cfg.max_new_tokens + 2 * self.cfg.max_nodes  # + one round's drafts
        return start_draft(self.draft, prompt_ids, features, first_token, self.cfg.concate, capacity)

    def propose(self, state: DraftContext, generator: torch.Generator | None) -> DraftTree:
        if self.cfg.mode == "chain":
            return build_draft_chain(state, gamma=self.cfg.gamma, sampling=self.cfg.sampling, generator=generator)
        return build_draft_tree(state, depth=self.cfg.depth, topk=self.cfg.topk, total_tokens=self.cfg.total_tokens)

    def advance(self, state: DraftContext, tokens: list[int], features: torch.Tensor) -> None:
        advance_draft(state, tokens, features)


def _capacity(prompt: torch.Tensor, cfg: DecodeConfig, nodes: int) -> int:
    """Target cache entries a generation can need: prompt, new tokens, and one unverified tree."""
    return prompt.shape[1] + cfg.max_new_tokens + nodes + 1


def _decoding_kernels(generate):
    """Run ``generate(target, ...)`` with the attention kernels decoding uses on the target's device
    (``layers.decoding_attention``: no per-shape plans)."""

    @functools.wraps(generate)
    def wrapped(target, *args, **kwargs):
        with decoding_attention(input_device(target)):
            return generate(target, *args, **kwargs)

    return wrapped


@_decoding_kernels
@torch.no_grad()
def speculative_decode(
    target: torch.nn.Module,
    drafter: Drafter,
    prompt_ids,
    cfg: DecodeConfig = DecodeConfig(),
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """Lossless speculative decoding of ``target`` with any ``drafter`` (see the module docstring).

    Only ``cfg``'s sampling settings and ``max_new_tokens`` are read here; how much is drafted
    per round is the drafter's business."""
    device = input_device(target)  # token ids go to the embedding's device (the first GPU of a spread target)
    ids = _prompt_tensor(prompt_ids, device)  # (1, P)
    sampling = cfg.sampling
    depth = drafter.max_depth
    nodes = getattr(drafter, "max_nodes", depth + 1)
    gen = Generation([], depth_tried=[0] * depth, depth_accepted=[0] * depth)
    clock = RoundClock(device)
    _sync(device)
    start = time.perf_counter()
    cache = target_cache(target, _capacity(ids, cfg, nodes))
    mask = VerifyMask(nodes, cache.capacity, next(target.parameters()).dtype, device)
    past = ids.shape[1]
    aux = list(drafter.aux_layers)
    hidden, logits = target_forward(target, ids, torch.arange(past, device=device)[None], cache, aux_layers=aux,
                                    last_logits=True)
    first = choose_token(logits[0, -1], sampling, generator)
    gen.tokens, stop = _finish([], [first], cfg, eos_ids)
    if stop is None:
        state = drafter.start(ids, hidden, first)
    while stop is None:
        t0 = clock.mark()
        tree = drafter.propose(state, generator)
        height = tree_height(tree)
        assert height <= depth, f"drafter proposed depth {height} > max_depth {depth}"
        t1 = clock.mark()
        hidden, logits = verify_tree(target, cache, tree, past, aux, mask)  # (1, N+1, F), (1, N+1, V)
        if sampling.greedy:
            acc = accept_greedy(tree, logits[0], eos_ids)
        else:
            acc = accept_sampling(tree, logits[0], sampling, generator, eos_ids)
        clock.add(t0, t1, clock.mark())  # after acceptance's read: the round's work is done
        path_tokens = acc.path_tokens if acc.path_tokens is not None else tree.tokens[acc.path].tolist()
        emitted = path_tokens + ([acc.next_token] if acc.next_token is not None else [])
        kept, stop = _finish(gen.tokens, emitted, cfg, eos_ids)
        gen.tokens += kept
        gen.rounds += 1
        gen.round_tokens.append(len(kept))
        gen.accepted.append(len(acc.path))
        for d in range(acc.tried):
            gen.depth_tried[d] += 1
        for d in range(len(acc.path)):
            gen.depth_accepted[d] += 1
        if stop is None:
            commit(cache, past, acc.path)
            n = len(acc.path)
            if acc.path == list(range(1, n + 1)):  # a chain's prefix: the features are a slice
                features = hidden[:, : n + 1]  # (1, 1+len(path), F)
            else:
                features = hidden[:, host_ids([0, *acc.path], hidden.device)]  # (1, 1+len(path), F)
            drafter.advance(state, emitted, features)
            past += n + 1
    _sync(device)
    gen.wall_s = time.perf_counter() - start
    gen.draft_s, gen.verify_s = clock.totals()
    gen.stop = stop
    return gen


def drafter_for(draft: torch.nn.Module, cfg: DecodeConfig) -> Drafter:
    """The drafter of a draft model: a block draft drafts one block per round (``block.BlockDrafter``),
    the others a chain or a tree (``ModelDrafter``)."""
    if draft.config.drafts_blocks:
        return BlockDrafter(draft, block_gamma(draft, cfg), cfg.sampling, cfg.max_new_tokens)
    return ModelDrafter(draft, cfg)


def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt_ids,
    cfg: DecodeConfig = DecodeConfig(),
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """Lossless speculative decoding of ``target`` with the draft model ``draft`` (chain or tree per ``cfg``;
    a block draft: one block per round)."""
    return speculative_decode(target, drafter_for(draft, cfg), prompt_ids, cfg, eos_ids, generator)


@_decoding_kernels
@torch.no_grad()
def vanilla_generate(
    target: torch.nn.Module,
    prompt_ids,
    cfg: DecodeConfig = DecodeConfig(),
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """Autoregressive decoding, one target forward per token, with the same token choice and the same
    preallocated cache as speculative decoding."""
    device = input_device(target)  # token ids go to the embedding's device (the first GPU of a spread target)
    ids = _prompt_tensor(prompt_ids, device)  # (1, P)
    sampling = cfg.sampling
    gen = Generation([])
    _sync(device)
    start = time.perf_counter()
    cache = target_cache(target, _capacity(ids, cfg, 1))
    past = ids.shape[1]
    positions = torch.arange(past + cfg.max_new_tokens + 1, device=device)  # (P+M+1,): one slice per step
    _, logits = target_forward(target, ids, positions[:past][None], cache, last_logits=True)
    while True:
        token = choose_token(logits[0, -1], sampling, generator)
        kept, stop = _finish(gen.tokens, [token], cfg, eos_ids)
        gen.tokens += kept
        if stop is not None:
            break
        _, logits = target_forward(target, host_ids([token], device)[None], positions[past : past + 1][None], cache)
        past += 1
        gen.rounds += 1
    _sync(device)
    gen.wall_s = time.perf_counter() - start
    gen.stop = stop
    return gen
