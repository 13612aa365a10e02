"""Visibility grids for every training stage (DESIGN.md "Index definitions").

A stage step is described by the query positions it trains and a boolean grid
``visible (B, Q, V, T)``: may query q use state u of version v. Version 0 holds the
target's true states, versions >= 1 the draft's own detached predictions. Both drafts
read states the same way (query p only ever sees states u < p), so one grid serves
Beagle and EAGLE.

* plain: query p sees true states u < p (Beagle §4.1; EAGLE/HASS step 1).
* early (Beagle §4.2, Eq. 4): windows of k from offset eps; query p sees true u < w(p).
* late step i (Beagle §4.2, Eq. 6, l = i): trained queries {p : i(p) = i}; true u < w(p),
  draft buffer (version 1) for w(p) <= u < p.
* align step j (HASS §3.2, App. A.1): state u from version max(0, u - p + j), u < p.
"""

from __future__ import annotations

import torch


def window_start(length: int, k: int, eps: int, device=None) -> torch.Tensor:
    """w(p): 0 for p < eps, else eps + floor((p - eps) / k) * k. Shape (T,)."""
    assert k >= 1 and 0 <= eps < k, f"need k >= 1 and 0 <= eps < k, got k={k} eps={eps}"
    p = torch.arange(length, device=device)
    return torch.where(p < eps, torch.zeros_like(p), eps + torch.div(p - eps, k, rounding_mode="floor") * k)


def window_position(length: int, k: int, eps: int, device=None) -> torch.Tensor:
    """i(p) = p - w(p) + 1 (1-based position inside the window). Shape (T,)."""
    return torch.arange(length, device=device) - window_start(length, k, eps, device) + 1


def _grid(valid: torch.Tensor, rule: torch.Tensor) -> torch.Tensor:
    """Combine a (Q, V, T) rule with state validity (B, T) -> (B, Q, V, T)."""
    return rule[None] & valid[:, None, None, :]


def plain(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All queries; query p sees true states u < p. Returns (query_index (T,), visible (B, T, 1, T))."""
    t = valid.shape[1]
    p = torch.arange(t, device=valid.device)
    rule = (p[None, :] < p[:, None])[:, None, :]  # (T, 1, T)
    return p, _grid(valid, rule)


def early(valid: torch.Tensor, k: int, eps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse block attention: query p sees true states u < w(p)."""
    t = valid.shape[1]
    p = torch.arange(t, device=valid.device)
    w = window_start(t, k, eps, valid.device)
    rule = (p[None, :] < w[:, None])[:, None, :]  # (T, 1, T)
    return p, _grid(valid, rule)


def late_step(valid: torch.Tensor, k: int, eps: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Late-stage simulation step i (1..k): the queries at window position i.

    Version 0 (true) for u < w(p); version 1 (draft buffer) for w(p) <= u < p.
    Returns (query_index (Q,), visible (B, Q, 2, T)).
    """
    assert 1 <= i <= k, f"late step {i} outside 1..{k}"
    t = valid.shape[1]
    pos = window_position(t, k, eps, valid.device)
    q = torch.nonzero(pos == i).flatten()  # (Q,)
    w = window_start(t, k, eps, valid.device)[q]  # (Q,)
    u = torch.arange(t, device=valid.device)
    true = u[None, :] < w[:, None]  # (Q, T)
    draft = (u[None, :] >= w[:, None]) & (u[None, :] < q[:, None])  # (Q, T)
    return q, _grid(valid, torch.stack([true, draft], dim=1))


def align_step(valid: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HASS align step j (1..n): queries p >= j - 1; state u < p from version max(0, u - p + j).

    Returns (query_index (Q,), visible (B, Q, j, T)); versions 1..j-1 are the draft
    states written at steps 1..j-1.
    """
    assert j >= 1, f"align step must be >= 1, got {j}"
    t = valid.shape[1]
    q = torch.arange(j - 1, t, device=valid.device)  # (Q,)
    u = torch.arange(t, device=valid.device)
    version = (u[None, :] - q[:, None] + j).clamp(min=0)  # (Q, T)
    seen = u[None, :] < q[:, None]  # (Q, T)
    v = torch.arange(j, device=valid.device)
    rule = (version[:, None, :] == v[None, :, None]) & seen[:, None, :]  # (Q, j, T)
    return q, _grid(valid, rule)
