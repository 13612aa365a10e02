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
* block ("DFlash: Block Diffusion for Flash Speculative Decoding" §4.2): a block draft fills, in one
  forward, blocks of S positions from anchors sampled per sequence; block depth k of anchor a is the
  query p = a + k - 1 with cutoff a (align step k's visibility), every depth of a block at once
  (``Blocks``: its positions also see each other, not other blocks).
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


# --- block drafts ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Blocks:
    """Blocks of a block draft ("DFlash: Block Diffusion for Flash Speculative Decoding" §4.2): block n
    of row b starts at its anchor a = ``anchors[b, n]`` (-1: no block) and covers positions a .. a+S-1
    (S = ``size``): the anchor token, then S-1 masks. Every position of a block sees the target's true
    states u < a (the context, as drafting from root a sees it) and, with ``self_attention``, every
    position of its own block (bidirectional); blocks never see each other.

    Block position k >= 1 predicts the token at a + k: in the shared state-index convention that is
    the target row q = a + k - 1 (the state whose distribution predicts that token), so block depth
    k is drafting depth k from root a — the query of ``align_step(k)`` at p = q, cutoff a."""

    anchors: torch.Tensor  # (B, N) long, -1 where a row has fewer blocks
    size: int  # S: positions per block

    @property
    def positions(self) -> torch.Tensor:
        """(B, N, S) positions of every block position (a + k; a missing block at 0 .. S-1)."""
        return self.anchors.clamp(min=0)[..., None] + torch.arange(self.size, device=self.anchors.device)

    def context_visible(self, length: int) -> torch.Tensor:
        """(B, N*S, T) bool: context state u is visible to every position of block n iff u < anchor."""
        bsz, n = self.anchors.shape
        u = torch.arange(length, device=self.anchors.device)
        cut = self.anchors[..., None, None].expand(bsz, n, self.size, 1)  # (B, N, S, 1)
        return (u < cut).reshape(bsz, n * self.size, length)  # a missing block (-1) sees nothing

    def rows(self) -> torch.Tensor:
        """(B, N, S-1) target rows q = a + k - 1 predicted at depths k = 1 .. S-1 (-1 for a missing block)."""
        q = self.anchors[..., None] + torch.arange(self.size - 1, device=self.anchors.device)  # (B, N, S-1)
        return torch.where(self.anchors[..., None] >= 0, q, torch.full_like(q, -1))

    def depth_weights(self, decay: float) -> torch.Tensor:
        """(S-1,) decay^(k-1) for depths k = 1 .. S-1 (DFlash Eq. 4: exp(-(k-1)/gamma) = decay^(k-1))."""
        k = torch.arange(self.size - 1, device=self.anchors.device, dtype=torch.float64)
        return (decay**k).float()


def sample_blocks(candidates: torch.Tensor, size: int, count: int, generator: torch.Generator | None = None) -> Blocks:
    """Up to ``count`` anchors per row drawn uniformly without replacement from ``candidates`` (B, T)
    bool (the positions whose depth-1 row is trained), sorted; rows with fewer candidates keep them
    all and pad with -1 (DFlash App. A.1: a fixed number of blocks per sequence, anchors redrawn every
    step)."""
    assert count >= 1 and size >= 2, f"need count >= 1 and size >= 2, got {count}, {size}"
    bsz, t = candidates.shape
    gen_device = generator.device if generator is not None else candidates.device
    keys = torch.rand(bsz, t, generator=generator, device=gen_device).to(candidates.device)  # (B, T)
    keys = torch.where(candidates, keys, torch.full_like(keys, 2.0))  # non-candidates sort last
    n = max(1, min(count, int(candidates.sum(1).max())))
    picked = keys.topk(n, dim=1, largest=False)  # (B, N)
    anchors = torch.where(picked.values < 2.0, picked.indices, torch.full_like(picked.indices, -1))
    order = torch.where(anchors >= 0, anchors, torch.full_like(anchors, t)).sort(dim=1).indices
    return Blocks(anchors.gather(1, order), size)


def every_block(candidates: torch.Tensor, size: int) -> Blocks:
    """One block at every candidate position (B, T) bool, in order (-1 padded): simulated acceptance."""
    bsz, t = candidates.shape
    n = max(1, int(candidates.sum(1).max()))
    pos = torch.where(candidates, torch.arange(t, device=candidates.device)[None], torch.full_like(candidates, t,
                                                                                                 dtype=torch.long))
    anchors = pos.sort(dim=1).values[:, :n]  # (B, N)
    return Blocks(torch.where(anchors < t, anchors, torch.full_like(anchors, -1)), size)
