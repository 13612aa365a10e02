"""Speculative and vanilla generation, batch 1 (papers/eagle2-… §4; DESIGN.md "Evaluation").

``speculative_generate(target, draft, prompt_ids, cfg)``:
  prefill   the target runs the prompt once (a ``DynamicCache``), its last logits give the
            first new token (the root of round 1); the draft caches the true states.
  round     the draft builds a chain (γ tokens) or an EAGLE-2 dynamic tree from the root,
            the target verifies root + tree in ONE forward (tree mask, tree positions),
            acceptance (greedy or speculative sampling) picks a path plus one target token
            (bonus / correction), the target cache is compacted to prefix + root + path,
            and the draft appends the newly verified true states (reset to true states).
  stop      EOS (``eos_ids``) or ``max_new_tokens``.

Counting convention (``Generation``): ``rounds`` = target verification forwards (the
prefill is not one); ``round_tokens[r]`` = tokens round r appended to the output (accepted
drafts + its bonus token, after truncation at EOS / max_new_tokens), so
``len(tokens) == 1 + sum(round_tokens)`` when any round ran and τ = sum(round_tokens) / rounds.

``vanilla_generate`` is the baseline: prefill, then one target forward per token with the
same ``DynamicCache`` path and the same token choice (``sampling.choose_token``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from specdraft.decoding.drafting import advance_draft, start_draft
from specdraft.decoding.sampling import SamplingConfig, choose_token
from specdraft.decoding.tree import DraftTree, build_draft_chain, build_draft_tree
from specdraft.decoding.verify import accept_greedy, accept_sampling, compact_cache, target_forward, verify_tree

Mode = Literal["chain", "tree"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeConfig:
    mode: Mode = "tree"
    gamma: int = 5  # chain: draft tokens per round
    depth: int = 6  # tree: drafted levels
    topk: int = 10  # tree: children per expanded node and nodes expanded per level
    total_tokens: int = 60  # tree: drafted nodes kept after reranking (root excluded)
    concate: bool = True  # Beagle: append drafted states to the draft cache
    temperature: float = 0.0
    top_k: int = 0  # sampling warper (0 = off)
    top_p: float = 1.0  # sampling warper (1 = off)
    max_new_tokens: int = 256

    def __post_init__(self) -> None:
        assert self.mode in ("chain", "tree"), f"mode must be 'chain' or 'tree', got {self.mode!r}"
        assert self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"
        SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @property
    def max_depth(self) -> int:
        return self.gamma if self.mode == "chain" else self.depth


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
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


@torch.no_grad()
def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompt_ids,
    cfg: DecodeConfig = DecodeConfig(),
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """Lossless speculative decoding of ``target`` with ``draft`` (see the module docstring)."""
    device = next(target.parameters()).device
    ids = _prompt_tensor(prompt_ids, device)  # (1, P)
    sampling = cfg.sampling
    gen = Generation([], depth_tried=[0] * cfg.max_depth, depth_accepted=[0] * cfg.max_depth)
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache()
    past = ids.shape[1]
    hidden, logits = target_forward(target, ids, torch.arange(past, device=device)[None], cache)
    first = choose_token(logits[0, -1], sampling, generator)
    gen.tokens, stop = _finish([], [first], cfg, eos_ids)
    if stop is None:
        ctx = start_draft(draft, ids, hidden, first, cfg.concate)
    while stop is None:
        t0 = time.perf_counter()
        tree = _draft(ctx, cfg, sampling, generator)
        _sync(device)
        t1 = time.perf_counter()
        hidden, logits = verify_tree(target, cache, tree, past)  # (1, N+1, d), (1, N+1, V)
        if sampling.greedy:
            acc = accept_greedy(tree, logits[0], eos_ids)
        else:
            acc = accept_sampling(tree, logits[0], sampling, generator, eos_ids)
        _sync(device)
        gen.draft_s += t1 - t0
        gen.verify_s += time.perf_counter() - t1
        path_tokens = tree.tokens[acc.path].tolist()
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
            compact_cache(cache, past, acc.path)
            keep = torch.tensor([0, *acc.path], device=device)
            advance_draft(ctx, emitted, hidden[:, keep])
            past += len(acc.path) + 1
    _sync(device)
    gen.wall_s = time.perf_counter() - start
    gen.stop = stop
    return gen


def _draft(ctx, cfg: DecodeConfig, sampling: SamplingConfig, generator) -> DraftTree:
    if cfg.mode == "chain":
        return build_draft_chain(ctx, gamma=cfg.gamma, sampling=sampling, generator=generator)
    return build_draft_tree(ctx, depth=cfg.depth, topk=cfg.topk, total_tokens=cfg.total_tokens)


@torch.no_grad()
def vanilla_generate(
    target: torch.nn.Module,
    prompt_ids,
    cfg: DecodeConfig = DecodeConfig(),
    eos_ids: frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """Autoregressive decoding, one target forward per token, with the same token choice."""
    device = next(target.parameters()).device
    ids = _prompt_tensor(prompt_ids, device)  # (1, P)
    sampling = cfg.sampling
    gen = Generation([])
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache()
    past = ids.shape[1]
    _, logits = target_forward(target, ids, torch.arange(past, device=device)[None], cache)
    while True:
        token = choose_token(logits[0, -1], sampling, generator)
        kept, stop = _finish(gen.tokens, [token], cfg, eos_ids)
        gen.tokens += kept
        if stop is not None:
            break
        _, logits = target_forward(target, ids.new_tensor([[token]]), torch.tensor([[past]], device=device), cache)
        past += 1
        gen.rounds += 1
    _sync(device)
    gen.wall_s = time.perf_counter() - start
    gen.stop = stop
    return gen
