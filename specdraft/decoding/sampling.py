"""Token choice shared by vanilla and speculative decoding (papers/eagle2-… §2, "speculative sampling").

Speculative sampling is lossless only when the target distribution it preserves is the one
vanilla decoding samples from, so both paths call the same ``target_probs``: temperature,
then top-k, then top-p (the order of ``transformers`` ``generate``), then softmax. A
temperature of 0 means greedy (argmax of the raw logits; the warpers cannot change it).

Randomness always comes from an explicit ``torch.Generator`` (no global RNG state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        assert self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"
        assert self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"
        assert 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k and top-p applied to logits (..., V); filtered entries become -inf."""
    assert not cfg.greedy, "warp_logits is for sampling (temperature > 0)"
    x = logits.float() / cfg.temperature  # (..., V)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = x.topk(cfg.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)  # (..., V)
        cum = sorted_x.softmax(-1).cumsum(-1)  # (..., V)
        # drop a token when the mass strictly before it already reaches top_p (the top token stays)
        drop_sorted = (cum - sorted_x.softmax(-1)) >= cfg.top_p  # (..., V)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution (..., V) the target samples from under ``cfg`` (temperature > 0)."""
    return warp_logits(logits, cfg).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a single distribution ``probs`` (V,)."""
    assert probs.dim() == 1, f"sample takes one distribution (V,), got {tuple(probs.shape)}"
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(generator: torch.Generator | None, device: torch.device | str = "cpu") -> float:
    """One U[0, 1) draw from ``generator``."""
    return float(torch.rand((), generator=generator, device=device).item())


def choose_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """Next token from one logit row (V,): argmax when greedy, else a sample of ``target_probs``."""
    if cfg.greedy:
        return int(logits.argmax(-1).item())
    return sample(target_probs(logits, cfg), generator)
