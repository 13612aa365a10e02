"""The training loop over a stage schedule (Beagle §4.2 two-stage schedule; HASS §3).

Single-device and framework-free: distributed wrappers (DDP/FSDP under Ray Train) are
applied by ``pipelines/`` around the same loop, which only asks them for a gradient-sync
switch (``grad_sync``: sync on the last backward of an accumulation group). Precision: fp32
master weights; on CUDA the forward and losses run under bf16 autocast by default, with the
frozen target heads kept in bf16 (``models.set_frozen_dtype``). Optimisation: AdamW betas
(0.9, 0.95) and max grad norm 0.5 as in the papers (Beagle App. A.3; EAGLE); the warmup is
relative to the run's length (the papers' 2000 steps are its cap) and the lr decays by cosine,
so a small store still learns (``learning_warnings`` says when a configuration cannot). The
loop position (stage, epoch, batch, step) is a small
``TrainState`` so a run can checkpoint and resume mid-stage without redoing or skipping
data.

Distributed drafts go through the same code: the checkpoint state is the *full* (unsharded)
weights and optimizer state keyed by parameter name (``torch.distributed.checkpoint.state_dict``,
the same for a plain, DDP or FSDP2 draft, so a checkpoint written under one strategy resumes
under another), gathered with every rank taking part; gradient clipping uses the global norm
over all shards. ``save_checkpoint`` / ``load_checkpoint`` write and read that state as a directory:
the draft's own directory (``save_draft``: config + safetensors) and ``trainer_state.pt`` beside it.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal, Sequence

import torch

from specdraft.configs.train import OptimConfig
from specdraft.loggers import MetricLogger, NullLogger
from specdraft.batch import Batch
from specdraft.models import save_draft
from specdraft.objectives import GradSync, no_grad_sync_needed, train_batch, unwrap
from specdraft.configs.stages import StageConfig

STATE_FILE = "trainer_state.pt"  # a checkpoint's optimizer, scheduler, generators and loop position
DRAFT_DIR = "draft"  # a checkpoint's (and a finished run's) draft directory


WARMUP_CAP = 2000  # Beagle App. A.3 / EAGLE: 2000 warmup steps
MIN_USEFUL_STEPS = 100


def warmup_of(cfg: OptimConfig, total_steps: int) -> int:
    """The run's warmup steps: as configured, else ``warmup_ratio`` of ``total_steps`` capped at WARMUP_CAP."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return min(WARMUP_CAP, math.ceil(cfg.warmup_ratio * total_steps))


def learning_warnings(cfg: OptimConfig, total_steps: int) -> list[str]:
    """Reasons a configuration cannot learn (empty when none): said before training starts."""
    out = []
    warmup = warmup_of(cfg, total_steps)
    if warmup >= total_steps:
        out.append(f"warmup ({warmup} steps) is not shorter than the whole run ({total_steps} optimizer steps): "
                   "the learning rate never reaches its peak — lower optim.warmup_steps (or leave it unset)")
    if total_steps < MIN_USEFUL_STEPS:
        out.append(f"only {total_steps} optimizer steps: a draft needs hundreds — add epochs or data, or lower "
                   "reader.max_tokens / optim.grad_accum")
    if cfg.lr < 1e-5:
        out.append(f"lr {cfg.lr:g} is tiny: nothing will be learned in {total_steps} steps")
    return out


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


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> bf16 mixed precision on CUDA (fp32 master weights), fp32 elsewhere."""
    assert precision in ("auto", "fp32", "bf16"), f"precision must be auto, fp32 or bf16, got {precision!r}"
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def trainable(draft) -> list[torch.nn.Parameter]:
    return [p for p in draft.parameters() if p.requires_grad]


def make_optimizer(draft, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = trainable(draft)
    # one fused kernel per step on CUDA, and on the CPU for plain (unsharded) tensors: torch's CPU default is a
    # loop of ~7 ops per tensor, measured at a third of a beagle3 early-stage step at SmolLM2's shape (23M
    # parameters, 1,024 tokens; benchmarks/train_rate.py)
    plain_cpu = all(p.device.type == "cpu" and not hasattr(p, "device_mesh") for p in params)
    fused = all(p.is_cuda for p in params) or plain_cpu or None
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused
    )


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Linear warmup, then constant / cosine / linear decay to ``min_lr_ratio``."""
    warmup = warmup_of(cfg, total_steps)
    if warmup and step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    frac = min(1.0, (step - warmup) / span)
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients to a global L2 norm of at most ``max_norm``; returns the norm before clipping.

    With FSDP2 the gradients are DTensor shards: ``clip_grad_norm_`` computes the norm of each
    rank's shards and all-reduces it to the global norm before the coefficient is taken (it returns
    a replicated DTensor), so every rank scales its shards by the same factor — the factor an
    unsharded run would use. Replicated (DDP) or single-device gradients are plain tensors.
    """
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    full = getattr(norm, "full_tensor", None)  # a DTensor: replicated already, so no communication
    return full() if full is not None else norm


def _full_state():
    """Gathered (unsharded) tensors on the CPU, kept on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


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
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere
    grad_sync: GradSync = no_grad_sync_needed  # distributed wrapper: sync gradients only where enabled
    loss_chunk: int = 1024  # rows per output-head chunk (memory: chunk x vocab x 12 bytes)

    def __post_init__(self) -> None:
        assert self.schedule, "the stage schedule is empty"
        assert self.batches_per_epoch > 0, "no batches to train on"
        self.optimizer = make_optimizer(self.draft, self.optim)
        self.total_steps = total_steps(self.schedule, self.batches_per_epoch, self.optim.grad_accum)
        self.scheduler = make_scheduler(self.optimizer, self.optim, self.total_steps)
        self.warnings = learning_warnings(self.optim, self.total_steps)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.state = TrainState()

    # -- checkpoint state ---------------------------------------------------------------
    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """The draft's full weights on the CPU (what ``save_draft`` writes), keyed as in the bare draft.

        Collective for a distributed draft: every rank must call it (FSDP2 shards are all-gathered);
        rank 0 gets the tensors, the other ranks an empty dict.
        """
        from torch.distributed.checkpoint import state_dict as dcp  # imported when needed: it is slow to import

        return dcp.get_model_state_dict(self.draft, options=_full_state())

    def state_dict(self) -> dict:
        """Everything a resume needs: full weights, full optimizer state (keyed by parameter name),
        scheduler, this rank's generator and the loop position. Collective, like ``draft_state_dict``."""
        from torch.distributed.checkpoint import state_dict as dcp

        return {
            "draft": self.draft_state_dict(),
            "optimizer": dcp.get_optimizer_state_dict(self.draft, self.optimizer, options=_full_state()),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "loop": self.state.as_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a full state (every rank passes the whole of it; FSDP2 keeps its own shards)."""
        from torch.distributed.checkpoint import state_dict as dcp

        options = dcp.StateDictOptions(full_state_dict=True, strict=True)
        dcp.set_model_state_dict(self.draft, state["draft"], options=options)
        dcp.set_optimizer_state_dict(self.draft, self.optimizer, state["optimizer"], options=options)
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
                    closes = (index + 1) % accum == 0 or index + 1 == len(epoch_batches)  # last of its group
                    metrics = self._micro_step(batch.to(self.device), stage, scale=1.0 / accum, sync=closes)
                    self.state.batch = index + 1
                    if closes:
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

    def _autocast(self):
        device = torch.device(self.device)
        if resolve_precision(self.precision, device) == "bf16":
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _micro_step(self, batch: Batch, stage: StageConfig, scale: float, sync: bool = True) -> dict[str, float]:
        with self._autocast():
            metrics = train_batch(self.draft, batch, stage, generator=self.generator, scale=scale,
                                  grad_sync=self.grad_sync, sync_last=sync, chunk=self.loss_chunk)
        self.state.tokens += int((batch.loss_mask & batch.valid).sum())
        metrics["stage"] = float(self.state.stage)
        return metrics

    def _optimizer_step(self) -> dict[str, float]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]  # sharded ones under FSDP2
        norm = clip_gradients(params, self.optim.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        return {"grad_norm": float(norm), "lr": self.scheduler.get_last_lr()[0]}


def save_checkpoint(trainer: Trainer, directory: Path | None) -> None:
    """Write a checkpoint into ``directory`` (rank 0; the other ranks pass None).

    Collective: every rank calls it, so sharded weights and optimizer state are gathered in full
    (``Trainer.state_dict``), and every rank's generator is kept — ranks draw their own noise and
    window offsets, and a resumed rank continues its own stream.
    """
    state = trainer.state_dict()
    generators = [trainer.generator.get_state()]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        generators = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(generators, trainer.generator.get_state())
    if directory is None:
        return
    save_draft(unwrap(trainer.draft), directory / DRAFT_DIR, weights=state.pop("draft"))  # safetensors
    state["generators"] = generators
    torch.save(state, directory / STATE_FILE)


def load_checkpoint(trainer: Trainer, directory: Path, rank: int = 0, world: int = 1) -> None:
    """Every rank loads the full checkpoint (FSDP2 keeps its own shards of it) and its own generator."""
    from safetensors.torch import load_file

    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    state["draft"] = load_file(str(directory / DRAFT_DIR / "model.safetensors"))  # the draft's own weights
    generators = state.pop("generators", None) or [state["generator"]]
    if len(generators) != world and rank == 0:
        print(f"[specdraft] WARNING: checkpoint written by {len(generators)} workers, resumed by {world}: "
              "the data partition and random streams differ from an uninterrupted run", flush=True)
    state["generator"] = generators[rank % len(generators)]
    trainer.load_state_dict(state)


def distinct_across_ranks(names: Iterable[str]) -> int:
    """How many distinct ``names`` the ranks hold together — the sequences each rank's reader skipped, say (a
    sequence one rank read in one epoch may be another's in the next). Collective when ``torch.distributed``
    is initialised: every rank calls it; without, this rank's own count."""
    local = sorted(set(names))
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return len(local)
    gathered: list[list[str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    return len(set().union(*gathered))


def drop_metrics_after(path: Path, step: int) -> int:
    """Drop the metrics rows of ``path`` (metrics.jsonl) logged after optimizer step ``step`` — a resumed run
    replays those steps and logs them again, so each step keeps one row; returns the rows dropped.

    Rewrites the file in place (same inode: the run's logger appends to it)."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if not _logged_after(line, step)]
    if len(keep) < len(lines):
        with path.open("r+") as fh:
            fh.write("".join(keep))
            fh.truncate()
    return len(lines) - len(keep)


def _logged_after(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:  # a row cut short by the crash
        return True
    return record.get("kind") == "metrics" and int(record.get("step", 0)) > step
