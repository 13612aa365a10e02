"""The training loop over a stage schedule (Beagle §4.2 two-stage schedule; HASS §3).

Single-device and framework-free: distributed wrappers (DDP/FSDP under Ray Train) are
applied by ``pipelines/`` around the same loop. Optimisation defaults follow the papers
(Beagle App. A.3; EAGLE): AdamW betas (0.9, 0.95), lr 3e-5 with 2000 warmup steps,
max grad norm 0.5. The loop position (stage, epoch, batch, step) is a small
``TrainState`` so a run can checkpoint and resume mid-stage without redoing or skipping
data.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Sequence

import torch

from specdraft.loggers import MetricLogger, NullLogger
from specdraft.objectives import Batch, StageConfig, train_batch, unwrap


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 2000
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 0.5
    grad_accum: int = 1


@dataclass
class TrainState:
    """Where the loop is: the next batch to train is ``batch`` of ``epoch`` of ``stage``."""

    stage: int = 0
    epoch: int = 0
    batch: int = 0
    step: int = 0  # optimizer steps taken
    tokens: int = 0  # trained tokens seen

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def trainable(draft) -> list[torch.nn.Parameter]:
    return [p for p in draft.parameters() if p.requires_grad]


def make_optimizer(draft, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = trainable(draft)
    fused = all(p.is_cuda for p in params) or None
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused
    )


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warmup, then constant / cosine / linear decay to ``min_lr_ratio``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def make_scheduler(optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))


def total_steps(schedule: list[StageConfig], batches_per_epoch: int, grad_accum: int) -> int:
    return sum(s.epochs for s in schedule) * math.ceil(batches_per_epoch / grad_accum)


@dataclass
class Trainer:
    """Explicit training state: model, optimizer, scheduler, RNG and loop position."""

    draft: torch.nn.Module
    schedule: list[StageConfig]
    optim: OptimConfig
    batches_per_epoch: int  # sizes the LR schedule; epochs may differ slightly
    seed: int = 0
    logger: MetricLogger = field(default_factory=NullLogger)
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:
        assert self.schedule, "the stage schedule is empty"
        assert self.batches_per_epoch > 0, "no batches to train on"
        self.optimizer = make_optimizer(self.draft, self.optim)
        self.total_steps = total_steps(self.schedule, self.batches_per_epoch, self.optim.grad_accum)
        self.scheduler = make_scheduler(self.optimizer, self.optim, self.total_steps)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.state = TrainState()

    # -- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "draft": unwrap(self.draft).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "loop": self.state.as_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        unwrap(self.draft).load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.state = TrainState(**state["loop"])

    # -- the loop -------------------------------------------------------------------------
    def run(
        self,
        batches: Callable[[int, int], Sequence[Batch]],
        on_step: Callable[["Trainer", dict[str, float]], None] | None = None,
        on_epoch_end: Callable[["Trainer"], None] | None = None,
    ) -> TrainState:
        """Train from ``self.state`` to the end of the schedule.

        ``batches(stage_index, epoch)`` returns that epoch's batches in a fixed order as a
        sequence (``len`` + indexing, may load lazily); a resumed epoch starts at the next
        untrained index, so no batch is trained twice or skipped.
        """
        accum = self.optim.grad_accum
        self.draft.train()
        while self.state.stage < len(self.schedule):
            stage = self.schedule[self.state.stage]
            while self.state.epoch < stage.epochs:
                t0, tok0 = time.perf_counter(), self.state.tokens
                epoch_batches = batches(self.state.stage, self.state.epoch)
                for index in range(self.state.batch, len(epoch_batches)):
                    batch = epoch_batches[index]
                    metrics = self._micro_step(batch.to(self.device), stage, scale=1.0 / accum)
                    self.state.batch = index + 1
                    if self.state.batch % accum == 0 or self.state.batch == len(epoch_batches):
                        metrics.update(self._optimizer_step())
                        metrics["tokens_per_s"] = (self.state.tokens - tok0) / max(1e-9, time.perf_counter() - t0)
                        self.logger.log_metrics(metrics, self.state.step)
                        if on_step is not None:
                            on_step(self, metrics)
                self.state.epoch += 1
                self.state.batch = 0
                if on_epoch_end is not None:
                    on_epoch_end(self)
            self.state.stage += 1
            self.state.epoch = 0
        return self.state

    def _micro_step(self, batch: Batch, stage: StageConfig, scale: float) -> dict[str, float]:
        metrics = train_batch(self.draft, batch, stage, generator=self.generator, scale=scale)
        self.state.tokens += int((batch.loss_mask & batch.valid).sum())
        metrics["stage"] = float(self.state.stage)
        return metrics

    def _optimizer_step(self) -> dict[str, float]:
        params = trainable(self.draft)
        norm = torch.nn.utils.clip_grad_norm_(params, self.optim.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        return {"grad_norm": float(norm), "lr": self.scheduler.get_last_lr()[0]}
