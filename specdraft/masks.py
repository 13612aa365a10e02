"""What every training sub-step lets each query see ("Cross-Attention Speculative Decoding" (Beagle)
§4.2; "Learning Harmonized Representations for Speculative Sampling" (HASS) §3.2).

Every stage is a sequence of sub-steps, and every sub-step has the same shape: a set of
trained queries p, a cutoff c(p) below which the query sees the target's *true* states
(u < c(p)), and E drafted states of its own at u = p-E .. p-1, the draft's outputs of
sub-steps 1..E for the same chain (state u comes from sub-step u - p + E + 1). Drafting sees
exactly this: the true prefix up to the chain's root, then its own predictions — the
"diagonal" of earlier-step keys of SpecForge's Alg. 1-2. Both drafts read states this way
(query p only ever sees states u < p), so one description serves Beagle, EAGLE and EAGLE-3.

* plain: all queries; c(p) = p, E = 0 (Beagle §4.1; EAGLE/HASS step 1).
* early (Beagle §4.2, Eq. 4): windows of k from offset eps; c(p) = w(p), E = 0.
* late step i (Beagle §4.2, Eq. 6, l = i): queries {p : i(p) = i}; c(p) = w(p) = p - i + 1,
  E = i - 1 (the drafts written at window positions 1..i-1); weight beta_i = k - i + 1.
* align step j (HASS §3.2, App. A.1) and training-time test step j ("EAGLE-3: Scaling up Inference
  Acceleration of Large Language Models via Training-Time Test" §3):
  queries p >= j-1; c(p) = p - j + 1, E = j - 1 (state u from version u - p + j); weight
  decay^(j-1). The two differ in the objective, not in what a query sees: HASS detaches the
  fed-back states and back-propagates each step, training-time test back-propagates through
  the whole unrolled chain (``objectives.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Step:
    index: int  # 1-based sub-step number
    weight: float  # multiplies this sub-step's loss
    query_index: torch.Tensor  # (Q,) positions computed (and trained where the loss mask allows)
    cutoff: torch.Tensor  # (Q,) true states u < cutoff are visible
    extras: int  # E: own drafted states at u = p-E .. p-1, from sub-steps 1..E

    def versions(self, length: int) -> torch.Tensor:
        """(Q, T) long: the version each query sees state u in (0 true, v = sub-step v, -1 hidden)."""
        u = torch.arange(length, device=self.query_index.device)[None, :]  # (1, T)
        p, c = self.query_index[:, None], self.cutoff[:, None]  # (Q, 1)
        out = torch.full((p.shape[0], length), -1, dtype=torch.long, device=u.device)
        out = torch.where(u < c, torch.zeros_like(out), out)
        drafted = (u >= p - self.extras) & (u < p)
        return torch.where(drafted, u - p + self.extras + 1, out)


def window_start(length: int, k: int, eps: int, device=None) -> torch.Tensor:
    """w(p): 0 for p < eps, else eps + floor((p - eps) / k) * k. Shape (T,)."""
    assert k >= 1 and 0 <= eps < k, f"need k >= 1 and 0 <= eps < k, got k={k} eps={eps}"
    p = torch.arange(length, device=device)
    return torch.where(p < eps, torch.zeros_like(p), eps + torch.div(p - eps, k, rounding_mode="floor") * k)


def window_position(length: int, k: int, eps: int, device=None) -> torch.Tensor:
    """i(p) = p - w(p) + 1 (1-based position inside the window). Shape (T,)."""
    return torch.arange(length, device=device) - window_start(length, k, eps, device) + 1


def plain(length: int, device=None) -> Step:
    """All queries; query p sees true states u < p."""
    p = torch.arange(length, device=device)
    return Step(1, 1.0, p, p, 0)


def early(length: int, k: int, eps: int, device=None) -> Step:
    """Inverse block attention: query p sees true states u < w(p)."""
    p = torch.arange(length, device=device)
    return Step(1, 1.0, p, window_start(length, k, eps, device), 0)


def late_step(length: int, k: int, eps: int, i: int, device=None) -> Step:
    """Late-stage simulation step i (1..k): the queries at window position i, weight k - i + 1."""
    assert 1 <= i <= k, f"late step {i} outside 1..{k}"
    q = torch.nonzero(window_position(length, k, eps, device) == i).flatten()  # (Q,)
    return Step(i, float(k - i + 1), q, q - i + 1, i - 1)


def align_step(length: int, j: int, decay: float = 1.0, device=None) -> Step:
    """HASS align / training-time-test step j (1..n): queries p >= j-1, true states u <= p-j,
    drafted states of steps 1..j-1 at u = p-j+1 .. p-1; weight decay^(j-1)."""
    assert j >= 1, f"align step must be >= 1, got {j}"
    q = torch.arange(j - 1, length, device=device)  # (Q,)
    return Step(j, float(decay ** (j - 1)), q, q - j + 1, j - 1)
