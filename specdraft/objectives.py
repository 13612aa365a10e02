"""Training stages as sequences of sub-steps (Beagle §4.2; HASS §3.2 and App. A.1).

``substeps(draft, batch, stage)`` yields one ``SubStep`` per forward the stage needs:

* ``plain``  one step, query p sees true states u < p (EAGLE training; HASS step 1).
* ``early``  one step, inverse block attention with windows of k from offset eps
             (Beagle Eq. 4); every query trained. Beagle only: EAGLE's query input
             is the previous state, which the early mask hides.
* ``late``   s steps in windows of s (Beagle Eq. 6 with l = i, beta_i = s - i + 1); step
             i trains only the queries at window position i and writes their
             predictions, detached and in place, into one draft-state buffer.
* ``align``  n steps (HASS harmonized context alignment); step j trains all queries
             p >= j-1 on states from version max(0, u - p + j), weight decay^(j-1).

The caller back-propagates each sub-step before advancing the generator (the late
buffer is written in place, so memory stays constant in s). Any draft x stage x loss
weights combination is one ``StageConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from specdraft import masks
from specdraft.losses import add_noise, feature_l1, soft_ce, topk_ce, weighted_mean

StageKind = Literal["plain", "early", "late", "align"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossWeights:
    ce: float = 1.0
    topk: float = 0.0
    vloss: float = 0.0
    topk_k: int = 10  # K when the batch carries no stored top-K


@dataclass(frozen=True, kw_only=True, slots=True)
class StageConfig:
    kind: StageKind = "plain"
    epochs: int = 1
    window: int = 5  # early: k
    steps: int = 4  # late: s (windows of s); align: n
    step_decay: float = 1.0  # align: weight of step j is step_decay ** (j - 1)
    noise_std: float = 0.2  # Gaussian noise on the true input states (0 disables)
    loss: LossWeights = field(default_factory=LossWeights)

    def __post_init__(self) -> None:
        assert self.kind in ("plain", "early", "late", "align"), f"unknown stage kind {self.kind!r}"
        assert self.window >= 1 and self.steps >= 1, "window and steps must be >= 1"

    @property
    def period(self) -> int:
        """Window length whose random offset eps is drawn per batch (1 = no offset)."""
        return {"early": self.window, "late": self.steps}.get(self.kind, 1)


@dataclass
class Batch:
    """A padded batch of dumped features. Positions are 0..T-1 per row (right padding)."""

    input_ids: torch.Tensor  # (B, T) int64
    hidden: torch.Tensor  # (B, T, d) true states (what lm_head consumes)
    loss_mask: torch.Tensor  # (B, T) bool: positions whose prediction is trained
    valid: torch.Tensor  # (B, T) bool: non-padding
    topk_ids: torch.Tensor | None = None  # (B, T, K) int64
    topk_logp: torch.Tensor | None = None  # (B, T, K) float: target log-probs of topk_ids

    @property
    def positions(self) -> torch.Tensor:
        b, t = self.input_ids.shape
        return torch.arange(t, device=self.input_ids.device).expand(b, t)  # (B, T)

    def to(self, device: torch.device | str) -> "Batch":
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return Batch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))


@dataclass
class SubStep:
    step: int  # 1-based sub-step index
    weight: float  # beta for this sub-step
    query_index: torch.Tensor  # (Q,)
    h_hat: torch.Tensor  # (B, Q, d)
    logits: torch.Tensor  # (B, Q, V)
    loss: torch.Tensor  # scalar: weighted sum of the enabled parts (before ``weight``)
    parts: dict[str, torch.Tensor]  # ce / topk / vloss, detached
    correct: torch.Tensor  # (B, Q) draft top-1 == target top-1
    trained: torch.Tensor  # (B, Q) positions that carry a loss


def score(draft, batch: Batch, query_index: torch.Tensor, h_hat: torch.Tensor, weights: LossWeights):
    """Losses of predicted states ``h_hat`` (B, Q, d) at ``query_index`` against the target."""
    h_true = batch.hidden[:, query_index]  # (B, Q, d)
    trained = (batch.loss_mask & batch.valid)[:, query_index]  # (B, Q)
    logits = draft.logits(h_hat)  # (B, Q, V)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, Q, V)
    with torch.no_grad():
        target_logits = draft.logits(h_true.to(h_hat.dtype)).float()  # (B, Q, V)
    parts: dict[str, torch.Tensor] = {}
    total = logits.new_zeros((), dtype=torch.float32)
    if weights.ce:
        parts["ce"] = weighted_mean(soft_ce(logp, target_logits), trained)
        total = total + weights.ce * parts["ce"]
    if weights.topk:
        if batch.topk_ids is not None:
            ids, lp = batch.topk_ids[:, query_index], batch.topk_logp[:, query_index]  # (B, Q, K)
        else:
            top = torch.log_softmax(target_logits, -1).topk(weights.topk_k, dim=-1)
            ids, lp = top.indices, top.values  # (B, Q, K)
        parts["topk"] = weighted_mean(topk_ce(logp, ids, lp), trained)
        total = total + weights.topk * parts["topk"]
    if weights.vloss:
        parts["vloss"] = weighted_mean(feature_l1(h_hat, h_true), trained)
        total = total + weights.vloss * parts["vloss"]
    correct = logits.detach().argmax(-1) == target_logits.argmax(-1)  # (B, Q)
    return total, {k: v.detach() for k, v in parts.items()}, logits, correct, trained


def substeps(
    draft,
    batch: Batch,
    stage: StageConfig,
    *,
    offset: int = 0,
    generator: torch.Generator | None = None,
) -> Iterator[SubStep]:
    """Yield the sub-steps of one training batch for ``stage`` (see module docstring).

    ``draft`` may be a wrapper (DDP/FSDP) exposing the draft as ``.module``: forwards go
    through the wrapper (so gradients synchronise), attributes come from the draft.
    """
    core = unwrap(draft)
    arch = core.config.arch
    if stage.kind == "early" and arch != "beagle":
        raise ValueError(
            f"stage 'early' needs a draft whose queries come from tokens only (beagle); {arch!r} feeds "
            "the previous state into each query, which the inverse block mask hides — use 'late' or 'align'"
        )
    assert 0 <= offset < stage.period, f"offset {offset} outside [0, {stage.period})"
    dtype = next(p for p in core.parameters()).dtype
    true = add_noise(batch.hidden.to(dtype), stage.noise_std, generator)  # (B, T, d)
    ids, pos, valid = batch.input_ids, batch.positions, batch.valid

    def step(index: int, weight: float, states: torch.Tensor, q: torch.Tensor, vis: torch.Tensor) -> SubStep:
        h_hat = draft(ids, pos, states, q, vis)  # (B, Q, d)
        loss, parts, logits, correct, trained = score(core, batch, q, h_hat, stage.loss)
        return SubStep(index, weight, q, h_hat, logits, loss, parts, correct, trained)

    if stage.kind in ("plain", "early"):
        q, vis = masks.plain(valid) if stage.kind == "plain" else masks.early(valid, stage.window, offset)
        yield step(1, 1.0, true[None], q, vis)
    elif stage.kind == "late":
        k = stage.steps
        states = torch.stack([true, torch.zeros_like(true)])  # (2, B, T, d): true, draft buffer
        for i in range(1, k + 1):
            q, vis = masks.late_step(valid, k, offset, i)
            sub = step(i, float(k - i + 1), states, q, vis)
            yield sub
            states[1][:, q] = sub.h_hat.detach()  # D_p <- h_hat_p, in place
    else:  # align
        versions = [true]
        for j in range(1, stage.steps + 1):
            q, vis = masks.align_step(valid, j)
            sub = step(j, stage.step_decay ** (j - 1), torch.stack(versions), q, vis)
            yield sub
            if j < stage.steps:
                written = torch.zeros_like(true)
                written[:, q] = sub.h_hat.detach()
                versions.append(written)


def unwrap(model):
    """The draft inside a DDP/FSDP-style wrapper (or the model itself)."""
    return getattr(model, "module", model)


def draw_offset(stage: StageConfig, generator: torch.Generator | None) -> int:
    """Random window offset eps in [0, period) for one batch (a new eps per batch)."""
    return int(torch.randint(stage.period, (1,), generator=generator).item())


def train_batch(draft, batch: Batch, stage: StageConfig, *, generator=None, scale: float = 1.0) -> dict[str, float]:
    """Forward + per-sub-step backward for one batch; returns scalar metrics. No optimizer step."""
    offset = draw_offset(stage, generator)
    metrics: dict[str, float] = {}
    total = 0.0
    for sub in substeps(draft, batch, stage, offset=offset, generator=generator):
        (scale * sub.weight * sub.loss).backward()
        total += sub.weight * float(sub.loss.detach())
        metrics[f"loss_step{sub.step}"] = float(sub.loss.detach())
        for name, value in sub.parts.items():
            metrics[f"{name}_step{sub.step}"] = float(value)
        n = sub.trained.sum().clamp(min=1)
        metrics[f"acc_step{sub.step}"] = float((sub.correct & sub.trained).sum() / n)
    metrics["loss"] = total
    return metrics


def pad_batch(samples: list[dict[str, torch.Tensor]]) -> Batch:
    """Right-pad per-sample tensors into a ``Batch``.

    Each sample has ``input_ids`` (T,), ``hidden`` (T, d), ``loss_mask`` (T,) and
    optionally ``topk_ids`` / ``topk_logp`` (T, K).
    """
    assert samples, "cannot pad an empty list of samples"
    n, t = len(samples), max(s["input_ids"].shape[0] for s in samples)
    d = samples[0]["hidden"].shape[-1]
    ids = torch.zeros(n, t, dtype=torch.int64)
    hidden = torch.zeros(n, t, d, dtype=torch.float32)
    loss_mask = torch.zeros(n, t, dtype=torch.bool)
    valid = torch.zeros(n, t, dtype=torch.bool)
    has_topk = "topk_ids" in samples[0]
    k = samples[0]["topk_ids"].shape[-1] if has_topk else 0
    topk_ids = torch.zeros(n, t, k, dtype=torch.int64) if has_topk else None
    topk_logp = torch.full((n, t, k), -1e4, dtype=torch.float32) if has_topk else None
    for row, s in enumerate(samples):
        m = s["input_ids"].shape[0]
        ids[row, :m] = s["input_ids"]
        hidden[row, :m] = s["hidden"].float()
        loss_mask[row, :m] = s["loss_mask"].bool()
        valid[row, :m] = True
        if has_topk:
            topk_ids[row, :m] = s["topk_ids"]
            topk_logp[row, :m] = s["topk_logp"].float()
    return Batch(ids, hidden, loss_mask, valid, topk_ids, topk_logp)
