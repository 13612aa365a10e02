"""Offline acceptance estimate from stored target states (acceptance rates as in "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees" §5; README "Evaluation and the prompt-lookup
floor").

Chain drafting is simulated against the stored features with the late-stage machinery
("Cross-Attention Speculative Decoding" (Beagle) §4.2: windows of ``depth`` from every offset,
the draft's own states fed back — exactly what drafting sees, with the data tokens as inputs):
the draft's top-1 at window position i must equal the target's top-1 at that position for every
earlier position of the window to count as accepted. Greedy, so

    alpha_i  = P(top-1 match at depth i | depths 1..i-1 matched)
    sim_tau  = alpha_1 + alpha_1*alpha_2 + ...  (no bonus token)

A window stops counting where the data leaves the trained (assistant) span. With a draft
vocabulary, a position whose target top-1 the draft cannot emit counts as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.batch import Batch
from specdraft.objectives import LossWeights, StageConfig, prepare_targets, substeps, unwrap


@dataclass
class AcceptanceCounts:
    """Per-depth counts, summable across batches and workers."""

    accepted: torch.Tensor  # (depth,) chains that matched through depth i
    reached: torch.Tensor  # (depth,) chains that reached depth i

    @classmethod
    def zeros(cls, depth: int) -> "AcceptanceCounts":
        return cls(torch.zeros(depth, dtype=torch.float64), torch.zeros(depth, dtype=torch.float64))

    def add(self, other: "AcceptanceCounts") -> None:
        self.accepted += other.accepted
        self.reached += other.reached

    @property
    def alpha(self) -> list[float]:
        return (self.accepted / self.reached.clamp(min=1)).tolist()

    @property
    def sim_tau(self) -> float:
        return sim_tau(self.alpha)


def sim_tau(alpha: list[float]) -> float:
    """alpha_1 + alpha_1*alpha_2 + ... ."""
    total, run = 0.0, 1.0
    for a in alpha:
        run *= a
        total += run
    return total


@torch.no_grad()
def simulated_acceptance(draft, batch: Batch, depth: int, offsets: list[int] | None = None) -> AcceptanceCounts:
    """Acceptance counts of greedy chain drafting of ``depth`` tokens over one batch."""
    counts = AcceptanceCounts.zeros(depth)
    stage = StageConfig(kind="late", steps=depth, noise_std=0.0, loss=LossWeights(ce=1.0))
    targets = prepare_targets(unwrap(draft), batch, stage.loss)
    for offset in range(depth) if offsets is None else offsets:
        alive = targets.scored.clone()  # (B, T) indexed by window start: chain still accepted
        for sub in substeps(draft, batch, stage, offset=offset, targets=targets):
            q = sub.query_index  # (Q,) positions at window depth i
            start = q - (sub.step - 1)  # (Q,) their window starts
            reach = alive[:, start] & sub.scored  # (B, Q)
            ok = reach & sub.correct  # (B, Q)
            counts.reached[sub.step - 1] += reach.sum().item()
            counts.accepted[sub.step - 1] += ok.sum().item()
            alive[:, start] = ok
    return counts
