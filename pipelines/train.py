"""Train a draft on Ray Train from a feature store (Beagle §4.2 two-stage; HASS §3).

A ``TorchTrainer`` runs ``train_loop_per_worker`` on each worker: build the draft from the
target's embedding/lm_head, read this rank's partition of the store, and run the stage
schedule with ``specdraft.training.Trainer`` (DDP via ``ray.train.torch.prepare_model``:
gloo on CPU, nccl on GPU; FSDP optional). Every ``checkpoint_every`` optimizer steps and
at every epoch end a checkpoint (draft dir + optimizer/scheduler/RNG/loop position) is
reported; a rerun with the same output directory, or a worker failure, resumes from the
latest one mid-stage. Validation runs the simulated chain acceptance on held-out
sequences (alpha_i, sim_tau) after each epoch. Rank 0 logs to the configured logger.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from specdraft.acceptance import AcceptanceCounts, simulated_acceptance
from specdraft.config import flatten, from_dict, to_dict
from specdraft.loggers import JsonlLogger, MultiLogger, NullLogger
from specdraft.models import build_draft, draft_config_from_target, load_draft, save_draft
from specdraft.objectives import LossWeights, StageConfig, unwrap
from specdraft.store import FeatureDataset, ReaderConfig
from specdraft.target import load_target_config, load_target_heads, target_id
from specdraft.training import OptimConfig, Trainer

STATE_FILE = "trainer_state.pt"
DRAFT_DIR = "draft"

_PAPER_LOSS = LossWeights(ce=1.0, vloss=10.0)  # Beagle App. A.3: vloss coefficient 10
RECIPES: dict[str, tuple[str, list[StageConfig]]] = {
    "beagle": ("beagle", [
        StageConfig(kind="early", epochs=10, window=5, noise_std=0.2, loss=_PAPER_LOSS),
        StageConfig(kind="late", epochs=10, steps=4, noise_std=0.2, loss=_PAPER_LOSS),
    ]),
    "beagle-early": ("beagle", [StageConfig(kind="early", epochs=10, window=5, noise_std=0.2, loss=_PAPER_LOSS)]),
    "beagle-topk": ("beagle", [
        StageConfig(kind="early", epochs=10, window=5, noise_std=0.2, loss=LossWeights(ce=1.0, topk=1.0, vloss=10.0)),
        StageConfig(kind="late", epochs=10, steps=4, noise_std=0.2, loss=LossWeights(ce=1.0, topk=1.0, vloss=10.0)),
    ]),
    "eagle": ("eagle", [StageConfig(kind="plain", epochs=20, noise_std=0.2, loss=_PAPER_LOSS)]),
    "hass": ("eagle", [
        StageConfig(kind="align", epochs=20, steps=3, noise_std=0.2, loss=LossWeights(ce=1.0, topk=1.0, vloss=10.0)),
    ]),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalingSection:
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    strategy: Literal["ddp", "fsdp"] = "ddp"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    recipe: str = "beagle"
    arch: Literal["beagle", "eagle"] | None = None  # None: the recipe's draft
    stages: list[StageConfig] | None = None  # None: the recipe's stages
    epochs: list[int] | None = None  # per-stage epoch override (same length as the stages)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reader: ReaderConfig = field(default_factory=lambda: ReaderConfig(val_fraction=0.05))
    intermediate_size: int | None = None  # draft MLP width (None: the target's)
    seed: int = 0
    checkpoint_every: int = 500  # optimizer steps between checkpoints (epoch ends always checkpoint)
    keep_checkpoints: int = 2
    sim_depth: int = 5
    val_max_batches: int = 64
    log_every: int = 20
    max_failures: int = 0
    scaling: ScalingSection = field(default_factory=ScalingSection)

    def __post_init__(self) -> None:
        assert self.recipe in RECIPES or self.stages, f"unknown recipe {self.recipe!r}; known: {sorted(RECIPES)}"

    def resolved(self) -> tuple[str, list[StageConfig]]:
        arch, stages = RECIPES.get(self.recipe, ("beagle", []))
        arch = self.arch or arch
        stages = list(self.stages) if self.stages else list(stages)
        if self.epochs is not None:
            assert len(self.epochs) == len(stages), f"epochs {self.epochs} must give one count per stage ({len(stages)})"
            stages = [replace(s, epochs=e) for s, e in zip(stages, self.epochs)]
        return arch, stages


class EpochBatches:
    """An epoch's batches of one rank as a lazy sequence (loads only what is trained)."""

    def __init__(self, dataset: FeatureDataset, epoch: int):
        self.dataset, self.plan = dataset, dataset.batches(epoch)

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int):
        return self.dataset.load(self.plan[i])


def validate_draft(draft, dataset: FeatureDataset | None, depth: int, max_batches: int, device) -> AcceptanceCounts:
    """Simulated acceptance over (up to ``max_batches`` of) this rank's held-out batches."""
    counts = AcceptanceCounts.zeros(depth)
    if dataset is None:
        return counts
    core = unwrap(draft)
    core.eval()
    for seqs in dataset.batches(0)[:max_batches]:
        counts.add(simulated_acceptance(core, dataset.load(seqs).to(device), depth))
    core.train()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        both = torch.stack([counts.accepted, counts.reached]).to(device)
        torch.distributed.all_reduce(both)
        counts = AcceptanceCounts(both[0].cpu(), both[1].cpu())
    return counts


def _save_checkpoint(trainer: Trainer, directory: Path) -> None:
    save_draft(unwrap(trainer.draft), directory / DRAFT_DIR)
    state = trainer.state_dict()
    state.pop("draft")  # weights travel as safetensors in DRAFT_DIR
    torch.save(state, directory / STATE_FILE)


def _load_checkpoint(trainer: Trainer, directory: Path) -> None:
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    state["draft"] = load_draft(directory / DRAFT_DIR).state_dict()
    trainer.load_state_dict(state)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker body (also runnable without Ray when ``ray.train`` has no session)."""
    import ray.train
    import ray.train.torch

    cfg: TrainConfig = from_dict(TrainConfig, config["train"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(cfg.seed)
    arch, stages = cfg.resolved()

    target = config["target"]
    heads = load_target_heads(target)
    dcfg = draft_config_from_target(load_target_config(target), arch, intermediate_size=cfg.intermediate_size,
                                    target_id=config.get("target_id", ""))
    draft = build_draft(dcfg, heads.embed, heads.lm_head)
    model = ray.train.torch.prepare_model(draft, parallel_strategy=cfg.scaling.strategy) if world > 1 else draft.to(device)

    train_ds = FeatureDataset(config["stores"], cfg.reader, split="train", rank=rank, world_size=world)
    val_ds = (FeatureDataset(config["stores"], cfg.reader, split="val", rank=rank, world_size=world)
              if cfg.reader.val_fraction > 0 else None)
    per_epoch = len(train_ds.batches(0))
    assert per_epoch > 0, f"rank {rank} got no training batches from {config['stores']}"

    logger = _rank0_logger(config) if rank == 0 else NullLogger()
    trainer = Trainer(model, stages, cfg.optim, per_epoch, seed=cfg.seed + 1000 * rank, logger=logger, device=device)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            _load_checkpoint(trainer, Path(d))
        if rank == 0:
            print(f"[specdraft] resumed at {trainer.state.as_dict()}", flush=True)
    elif rank == 0:
        trainer.logger.log_params({**flatten(cfg, "train"), "train.arch_resolved": arch,
                                   "train.world_size": world, "train.batches_per_epoch": per_epoch})

    epoch_offsets = [sum(s.epochs for s in stages[:i]) for i in range(len(stages))]
    started = time.perf_counter()

    def report(metrics: dict[str, float], with_checkpoint: bool) -> None:
        metrics = {**metrics, **{f"state_{k}": v for k, v in trainer.state.as_dict().items()}}
        if not with_checkpoint:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as tmp:
            if rank == 0:
                _save_checkpoint(trainer, Path(tmp))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None)

    def on_step(tr: Trainer, metrics: dict[str, float]) -> None:
        step = tr.state.step
        if rank == 0 and step % cfg.log_every == 0:
            done = step / max(1, tr.total_steps)
            eta = (time.perf_counter() - started) / max(done, 1e-9) * (1 - done)
            print(f"[specdraft] step {step}/{tr.total_steps} stage {tr.state.stage} loss {metrics['loss']:.4f} "
                  f"tok/s {metrics['tokens_per_s']:.0f} eta {eta:.0f}s", flush=True)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            report({"loss": metrics["loss"]}, with_checkpoint=True)

    def on_epoch_end(tr: Trainer) -> None:
        counts = validate_draft(tr.draft, val_ds, cfg.sim_depth, cfg.val_max_batches, device)
        metrics = {"sim_tau": counts.sim_tau, **{f"alpha_{i + 1}": a for i, a in enumerate(counts.alpha)}}
        tr.logger.log_metrics(metrics, tr.state.step)
        report(metrics, with_checkpoint=True)

    def batches(stage: int, epoch: int) -> EpochBatches:
        return EpochBatches(train_ds, epoch_offsets[stage] + epoch)

    fail_at = int(config.get("fail_at_step") or 0)  # fault injection (tests, failure drills)
    if fail_at:
        inner = on_step

        def on_step(tr, metrics, inner=inner):  # noqa: F811
            inner(tr, metrics)
            if tr.state.step == fail_at and not Path(config["out"], ".failed-once").exists():
                Path(config["out"], ".failed-once").touch()
                raise RuntimeError(f"injected failure at step {fail_at}")

    trainer.run(batches, on_step=on_step, on_epoch_end=on_epoch_end)
    if rank == 0:
        save_draft(unwrap(trainer.draft), Path(config["out"]) / DRAFT_DIR)
        trainer.logger.close()
    ray.train.report({"done": 1.0, **{f"state_{k}": v for k, v in trainer.state.as_dict().items()}})


def _rank0_logger(config: dict[str, Any]):
    loggers = [JsonlLogger(Path(config["out"]) / "metrics.jsonl")]
    tracking = config.get("tracking")
    if tracking:
        from pipelines.tracking import MlflowLogger

        loggers.append(MlflowLogger(tracking["uri"], run_id=tracking["run_id"]))
    return MultiLogger(*loggers)


def run_training(
    cfg: TrainConfig,
    stores: list[str | Path],
    target: str | Path,
    out: str | Path,
    *,
    tracking: dict[str, str] | None = None,
    ray_address: str | None = None,
    fail_at_step: int | None = None,
) -> dict[str, Any]:
    """Run (or resume) a training job; returns the draft path and the final metrics.

    ``tracking``: ``{"uri": ..., "run_id": ...}`` of an existing MLflow run that rank 0
    logs into. Rerunning with the same ``out`` resumes from its latest checkpoint.
    ``fail_at_step`` raises once at that optimizer step (a failure drill for resume tests).
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    sc = cfg.scaling
    resources = {"CPU": sc.cpus_per_worker, **({"GPU": sc.gpus_per_worker} if sc.use_gpu else {})}
    config = {
        "train": to_dict(cfg),
        "stores": [str(Path(s).resolve()) for s in stores],
        "target": str(Path(target).resolve()),
        "target_id": target_id(target),
        "out": str(out),
        "tracking": tracking,
        "fail_at_step": fail_at_step,
    }
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if sc.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=sc.num_workers, use_gpu=sc.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name="train",
            storage_path=str(out / "ray"),
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
        ),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    draft_dir = out / DRAFT_DIR
    if not (draft_dir / "model.safetensors").is_file():
        raise RuntimeError(f"training finished without writing {draft_dir}")
    summary = {"draft": str(draft_dir), "metrics": dict(result.metrics or {}),
               "checkpoint": result.checkpoint.path if result.checkpoint else None}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


