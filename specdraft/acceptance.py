"""Offline acceptance estimate from stored target states (acceptance rates as in "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees" §5; docs/evaluation.md).

Chain drafting is simulated against the stored features with the late-stage machinery
("Cross-Attention Speculative Decoding" (Beagle) §4.2: windows of ``depth`` from every offset,
the draft's own states fed back — exactly what drafting sees, with the data tokens as inputs):
the draft's top-1 at window position i must equal the target's top-1 at that position for every
earlier position of the window to count as accepted. Greedy, so

    alpha_i  = P(top-1 match at depth i | depths 1..i-1 matched)
    sim_tau  = alpha_1 + alpha_1*alpha_2 + ...  (no bonus token)

A window stops counting where the data leaves the trained (assistant) span. With a draft
vocabulary, a position whose target top-1 the draft cannot emit counts as a miss.

A block draft ("DFlash: Block Diffusion for Flash Speculative Decoding" §3) drafts a whole block from
its anchor in one forward, so its chains are blocks anchored at every trained position (``masks.
every_block``), depths 1 .. min(depth, S-1), drafted in groups of ``anchors_per_forward`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft import masks
from specdraft.batch import Batch
from specdraft.objectives import block_substep, features_of, prepare_targets, substeps, unwrap
from specdraft.configs.stages import LossWeights, StageConfig


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
    if unwrap(draft).config.drafts_blocks:
        return block_acceptance(draft, batch, depth)
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


@torch.no_grad()
def block_acceptance(draft, batch: Batch, depth: int, anchors_per_forward: int = 256) -> AcceptanceCounts:
    """Acceptance counts of greedy block drafting over one batch: a block at every trained position,
    depth k accepted when depths 1..k all match the target's top-1 (and stay in the trained span)."""
    core = unwrap(draft)
    counts = AcceptanceCounts.zeros(depth)
    stage = StageConfig(kind="block", noise_std=0.0, loss=LossWeights(ce=1.0))
    targets = prepare_targets(core, batch, stage.loss)
    every = masks.every_block(targets.scored, core.config.block_size)
    feats = features_of(core, batch).to(next(core.parameters()).dtype)  # (B, T, F)
    reach_depth = min(depth, core.config.block_size - 1)
    for lo in range(0, every.anchors.shape[1], anchors_per_forward):
        blocks = masks.Blocks(every.anchors[:, lo : lo + anchors_per_forward], core.config.block_size)
        sub = block_substep(draft, batch, feats, blocks, stage, targets)
        n = blocks.anchors.shape[1]
        ok = (sub.correct & sub.scored).view(-1, n, core.config.block_size - 1)  # (B, N, S-1)
        seen = sub.scored.view(-1, n, core.config.block_size - 1)  # (B, N, S-1)
        alive = blocks.anchors >= 0  # (B, N)
        for k in range(reach_depth):
            reach = alive & seen[:, :, k]
            counts.reached[k] += reach.sum().item()
            alive = reach & ok[:, :, k]
            counts.accepted[k] += alive.sum().item()
    return counts
