"""Per-position training losses (DESIGN.md "Training objectives").

* ``ce``   soft cross-entropy -sum_x P(x) log Q(x) over the full vocabulary (EAGLE/HASS).
* ``topk`` HASS harmonized objective distillation (hass-… §3.1, Eq. 1):
           -sum_{x in topK(P)} P(x) log Q(x).
* ``vloss`` SmoothL1(h_hat, H), the EAGLE feature regression (Beagle App. A.3 weights it 10).

All functions return one value per position; ``weighted_mean`` reduces them over the
trained positions (loss_mask), so a step with no trained position contributes 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def soft_ce(draft_logp: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """(N, V) draft log-probs, (N, V) target logits -> (N,) cross-entropy."""
    target_p = torch.softmax(target_logits.float(), dim=-1)  # (N, V)
    return -(target_p * draft_logp).sum(-1)


def topk_ce(draft_logp: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> torch.Tensor:
    """Top-K distillation: (N, V) draft log-probs, (N, K) target ids and log-probs -> (N,)."""
    picked = draft_logp.gather(-1, topk_ids)  # (N, K)
    return -(topk_logp.float().exp() * picked).sum(-1)


def feature_l1(h_hat: torch.Tensor, h_true: torch.Tensor) -> torch.Tensor:
    """SmoothL1 between predicted and true states, averaged over d: (N, d) -> (N,)."""
    return F.smooth_l1_loss(h_hat.float(), h_true.float(), reduction="none").mean(-1)


def weighted_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum(w * v) / max(sum(w), 1)."""
    weight = weight.to(values.dtype)
    return (values * weight).sum() / weight.sum().clamp(min=1.0)


def add_noise(states: torch.Tensor, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """Gaussian input noise N(0, std^2) on true states (EAGLE; Beagle App. A.3 uses 0.2)."""
    if std <= 0:
        return states
    device = generator.device if generator is not None else states.device
    noise = torch.randn(states.shape, generator=generator, device=device, dtype=torch.float32)
    return states + (std * noise).to(device=states.device, dtype=states.dtype)
