"""Token choice shared by vanilla and speculative decoding ("EAGLE-2: Faster Inference of Language
Models with Dynamic Draft Trees", §2, speculative sampling).

Speculative sampling is lossless only when the target distribution it preserves is the one
vanilla decoding samples from, so both paths call the same ``target_probs``: temperature,
then top-k, then top-p (the order of ``transformers`` ``generate``), then softmax. A
temperature of 0 means greedy (argmax of the raw logits; the warpers cannot change it).

Top-p is nucleus sampling ("The Curious Case of Neural Text Degeneration", §3.1):
``keep_top_p`` is its one implementation, also used by the regenerate stage's sampler.

Randomness always comes from an explicit ``torch.Generator`` (no global RNG state).
"""

from __future__ import annotations

import torch

from specdraft.configs.decode import SamplingConfig


def warp_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k and top-p applied to logits (..., V); filtered entries become -inf."""
    assert not cfg.greedy, "warp_logits is for sampling (temperature > 0)"
    x = logits.float() / cfg.temperature  # (..., V)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = x.topk(cfg.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        x = x.masked_fill(~keep_top_p(x.softmax(-1), cfg.top_p), float("-inf"))  # (..., V)
    return x


def keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p keeps, as a mask (..., V) over ``probs`` (..., V): the smallest set, taken by
    descending probability, whose mass reaches ``top_p``.

    A token stays when the mass of the tokens ranked above it is still below ``top_p``, so the top
    token always stays and a set that reaches ``top_p`` exactly takes no further token (the same
    set as ``transformers``' ``TopPLogitsWarper``). Equal probabilities are ranked by the sort.
    """
    assert 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # (..., V)
    above = sorted_probs.cumsum(-1) - sorted_probs  # (..., V) mass ranked above each token
    keep_sorted = above < top_p  # (..., V)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # (..., V)


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution (..., V) the target samples from under ``cfg`` (temperature > 0)."""
    return warp_logits(logits, cfg).softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id () drawn from a single distribution ``probs`` (V,), left on its device (no host read)."""
    assert probs.dim() == 1, f"sample takes one distribution (V,), got {tuple(probs.shape)}"
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a single distribution ``probs`` (V,)."""
    return int(draw(probs, generator).item())


def choose_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """Next token from one logit row (V,): argmax when greedy, else a sample of ``target_probs``."""
    if cfg.greedy:
        return int(logits.argmax(-1).item())
    return sample(target_probs(logits, cfg), generator)
