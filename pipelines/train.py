"""Train a draft on Ray Train: the adapter between the driver, Ray Train's workers and MLflow.

``run_training`` (the driver) checks the config, decides the feature plan once (``feature_plan``: aux
layers and draft vocabulary) and starts a ``TorchTrainer`` whose workers (gloo on CPU, nccl on GPU)
run ``train_loop_per_worker``: the run set up by the core (``specdraft.run.build_run``: the draft from the
target's heads, DDP or FSDP2 per ``train.scaling.strategy`` (``specdraft.parallel``), this rank's partition of
the features, the stage schedule's ``Trainer`` — Beagle §4.2; HASS §3) and trained by its loop (``Run.fit``),
with Ray's checkpoints and reports as its hooks (``RayReports``). Every ``checkpoint_every`` optimizer steps and
at every epoch end a checkpoint (draft, optimizer, scheduler, every rank's RNG, loop position;
``specdraft.training.save_checkpoint``), gathered by all ranks and written by rank 0, is reported; a rerun into
the same output directory, or a worker failure, resumes from the latest one mid-stage, whatever the strategy.
``features: online`` (SpecForge's online mode): each worker computes every batch's features with the frozen target,
tokenized as a dump would (``specdraft.online``; ``train.online.aux_layers`` for EAGLE-3, default ``eagle3``).
Validation: simulated chain acceptance (alpha_i, sim_tau) on held-out sequences after each epoch; rank 0 logs.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pipelines.cluster import connect_ray
from pipelines.configs import ClusterTrainConfig, on_cluster
from pipelines.ingest import load_conversations
from pipelines.nodes import ranks_on_nodes, record_ranks
from specdraft.config import ConfigError, from_dict, to_dict
from specdraft.loggers import JsonlLogger, MultiLogger, NullLogger
from specdraft.models import save_draft
from specdraft.objectives import stage_note, unwrap
from specdraft.progress import progress_line
from specdraft.chat import TokenizedConversations, tokenize_conversations
from specdraft.configs.train import TrainConfig
from specdraft.configs.features import EAGLE3
from specdraft.online import OnlineDataset
from specdraft.plan import RunPlan, aux_layers_setting, plan_run
from specdraft.epochs import EpochEnd, RunHooks
from specdraft.run import Run, build_run, feature_plan as plan_features
from specdraft.store import FeatureDataset, location
from specdraft.configs.reader import ReaderConfig
from specdraft.targets import Target
from specdraft.targets.identity import target_record
from specdraft.targets.loading import load_target_model, load_tokenizer
from specdraft.training import (DRAFT_DIR, distinct_across_ranks, drop_metrics_after, load_checkpoint, save_checkpoint,
                                warmup_of)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """What the driver hands every worker (Ray's ``train_loop_config`` carries its ``to_dict``; ``from_dict`` reads it)."""

    train: ClusterTrainConfig
    target: str  # resolved path of the target
    target_id: str
    out: str  # the run's directory: metrics.jsonl, the final draft
    target_fingerprint: str | None = None  # the target's content fingerprint (None: each worker computes it)
    plan: RunPlan  # what the run trains, resolved on the driver (``specdraft.plan.build_plan``)
    stores: list[str] = field(default_factory=list)  # offline: the feature stores (paths or URLs)
    tracking: dict[str, Any] | None = None  # {"uri", "run_id", "timeout_s"} of the MLflow run rank 0 logs into
    fail_at_step: int | None = None  # fault injection (tests, failure drills)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train worker body (also runnable without Ray when ``ray.train`` has no session): this rank's run set up by
    the core (``build_run``), resumed from Ray Train's latest checkpoint (``resume``), trained by ``Run.fit`` with
    Ray Train's reports and checkpoints as its hooks (``RayReports``); rank 0 writes the draft."""
    import ray.train
    import ray.train.torch

    job = from_dict(WorkerConfig, config, "worker config")
    cfg = job.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu" and (threads := cfg.scaling.cpu_threads()) is not None:
        torch.set_num_threads(threads)  # Ray's OMP_NUM_THREADS default for a worker is 1, whatever it holds
    if cfg.features == "online":
        open_split = online_features(cfg, job.target, device, rank, world)
    else:
        def open_split(split: str, reader: ReaderConfig, aux_layers: tuple[int, ...]) -> FeatureDataset:
            return FeatureDataset(job.stores, reader, split=split, rank=rank, world_size=world, aux_layers=aux_layers)
    run = build_run(cfg, job.plan, job.target, open_split, target_id=job.target_id,
                    fingerprint=job.target_fingerprint, device=device, rank=rank, world=world,
                    logger=_rank0_logger(job) if rank == 0 else NullLogger(), strategy=cfg.scaling.strategy)
    trainer = run.trainer
    if rank == 0:
        print(f"[specdraft] {trainer.total_steps} optimizer steps ({run.batches_per_epoch} batches of <= "
              f"{run.reader.max_tokens} tokens per epoch and rank), warmup {warmup_of(cfg.optim, trainer.total_steps)}"
              f", peak lr {cfg.optim.lr:g}, {torch.get_num_threads()} torch threads per worker on {device}", flush=True)
        for line in trainer.warnings:
            print(f"[specdraft] WARNING: this configuration cannot learn well: {line}", flush=True)
    if not resume(run, job, rank, world) and rank == 0:
        trainer.logger.log_params({**run.params(cfg, world), "train.schedule": job.plan.start})  # warm or fresh
    reports = RayReports(job, run, rank)  # held-out acceptance after each epoch (Run.fit's default)
    run.fit(cfg.sim_depth, cfg.val_max_batches, hooks=RunHooks(step=reports.step, epoch_metrics=reports.skipped,
                                                               epoch_end=reports.epoch_end))
    weights = trainer.draft_state_dict()  # every rank: gathered in full, held by rank 0
    record_ranks(rank, job.out)  # every rank: which Ray node ran which ranks, written by rank 0 beside the draft
    if rank == 0:
        save_draft(unwrap(trainer.draft), Path(job.out) / DRAFT_DIR, weights=weights)
        trainer.logger.close()
    ray.train.report({"done": 1.0, **reports.skipped(run), **reports.state()})


def resume(run: Run, job: WorkerConfig, rank: int, world: int) -> bool:
    """Whether the run resumed: Ray Train's latest checkpoint, if any, loaded into every rank's trainer (rank 0 drops
    the metrics rows logged after it: they are logged again)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return False
    trainer = run.trainer
    with checkpoint.as_directory() as d:
        load_checkpoint(trainer, Path(d), rank, world)
    if rank == 0:
        dropped = drop_metrics_after(Path(job.out) / "metrics.jsonl", trainer.state.step)
        print(f"[specdraft] resumed at {trainer.state.as_dict()}"
              + (f"; {dropped} metrics rows logged after that checkpoint dropped (they are logged again)"
                 if dropped else ""), flush=True)
    return True


class RayReports:
    """One rank's part of ``Run.fit`` under Ray Train (its ``RunHooks``): rank 0's stage notes and progress lines, a
    checkpoint reported every ``train.checkpoint_every`` optimizer steps and at every epoch's end (gathered by all
    ranks, written by rank 0), the corrupt sequences the ranks skipped, and the failure drill (``fail_at_step``)."""

    def __init__(self, job: WorkerConfig, run: Run, rank: int) -> None:
        self.job, self.run, self.rank = job, run, rank
        self.started = time.perf_counter()
        self.announced = -1  # the stage whose note was printed

    def state(self) -> dict[str, float]:
        return {f"state_{k}": v for k, v in self.run.trainer.state.as_dict().items()}

    def report(self, metrics: dict[str, float]) -> None:
        """``metrics`` and the loop position reported to Ray Train with a checkpoint (collective: every rank)."""
        import ray.train

        metrics = {**metrics, **self.state()}
        with tempfile.TemporaryDirectory() as tmp:
            save_checkpoint(self.run.trainer, Path(tmp) if self.rank == 0 else None)  # every rank: the state is gathered
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp) if self.rank == 0 else None)

    def step(self, run: Run, metrics: dict[str, float]) -> None:
        cfg, tr, job = self.job.train, run.trainer, self.job
        step = tr.state.step
        if self.rank == 0 and tr.state.stage != self.announced:  # a stage starts (or a resumed run's first step)
            self.announced = tr.state.stage
            print(f"[specdraft] {stage_note(tr.state.stage, run.stages)}", flush=True)
        if self.rank == 0 and step % cfg.log_every == 0:
            print(progress_line("step", step, tr.total_steps, time.perf_counter() - self.started,
                                metrics["tokens_per_s"], f"stage {tr.state.stage} loss {metrics['loss']:.4f}"), flush=True)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            self.report({"loss": metrics["loss"]})
        if job.fail_at_step and step == job.fail_at_step and not Path(job.out, ".failed-once").exists():
            Path(job.out, ".failed-once").touch()
            raise RuntimeError(f"injected failure at step {step}")

    def skipped(self, run: Run) -> dict[str, float]:
        """reader.on_corrupt=skip: the sequences of corrupt chunks the ranks skipped (collective: every rank calls)."""
        if self.job.train.features != "offline" or run.reader.on_corrupt != "skip":
            return {}
        names = [*run.train.skipped, *(run.val.skipped if run.val else {})]
        return {"skipped_corrupt_sequences": float(distinct_across_ranks(names))}

    def epoch_end(self, run: Run, epoch: EpochEnd) -> None:
        if "sim_tau" not in epoch.metrics and self.rank == 0:  # nothing measured (summed over the ranks)
            print(f"[specdraft] no held-out batches (train.reader.val_fraction={self.job.train.reader.val_fraction}): "
                  f"sim_tau and alpha not measured at step {epoch.step}", flush=True)
        self.report(epoch.metrics)


def online_conversations(cfg: TrainConfig, target: Target | str | Path) -> tuple[TokenizedConversations, int]:
    """(``cfg.conversations`` tokenized as a dump with ``cfg.online`` would tokenize them, rows read)."""
    tokenizer = load_tokenizer(target, trust_remote_code=cfg.online.trust_remote_code)
    rows, _ = load_conversations(cfg.conversations)
    return tokenize_conversations(tokenizer, rows, cfg.online.max_length, cfg.online.overlong), len(rows)


def online_features(cfg: TrainConfig, target: str, device, rank: int, world: int):
    """``features: online``: a function ``(split, reader, aux_layers) -> OnlineDataset`` over this worker's target.

    The conversations are tokenized as a dump with ``cfg.online`` would tokenize them, and the frozen
    target is loaded once on the worker's device in ``cfg.online.dtype`` (auto: bf16 on GPU, fp32 on
    CPU); both splits share them. ``aux_layers`` (the run plan's, from ``build_run``): the auxiliary layers the
    draft reads, computed in the same forward.
    """
    data, num_rows = online_conversations(cfg, target)
    with torch.random.fork_rng(devices=[]):  # loading the target must not move the draft's random stream
        model = load_target_model(target, cfg.online.dtype, device, trust_remote_code=cfg.online.trust_remote_code,
                                  attn_implementation=cfg.online.attn_implementation)
    if rank == 0:
        print(f"[specdraft] online features: {len(data)} of {num_rows} conversations kept (rejected {data.rejected}, "
              f"truncated {data.truncated}, duplicate ids {data.duplicates}); target on {device} in "
              f"{next(model.parameters()).dtype}", flush=True)

    def open_split(split: str, reader: ReaderConfig, aux_layers: tuple[int, ...]) -> OnlineDataset:
        return OnlineDataset(model, data, reader, topk=cfg.online.topk, hidden_codec=cfg.online.hidden_codec,
                             logits_chunk=cfg.online.logits_chunk, split=split, rank=rank, world_size=world,
                             aux_layers=aux_layers)

    return open_split


def _rank0_logger(job: WorkerConfig):
    loggers = [JsonlLogger(Path(job.out) / "metrics.jsonl")]
    if job.tracking:
        from pipelines.tracking import MlflowLogger

        loggers.append(MlflowLogger(**job.tracking))  # MlflowLogger.ref(): uri, run_id, timeout_s
    return MultiLogger(*loggers)


def feature_plan(cfg: TrainConfig, stores: list[str], target: Target | str | Path, out: Path) -> tuple[list[int], list[int] | None]:
    """``specdraft.run.feature_plan``, online features' conversations read as this adapter reads them."""
    return plan_features(cfg, stores, target, out, conversations=lambda: online_conversations(cfg, target)[0])


def run_training(cfg: TrainConfig | ClusterTrainConfig, stores: list[str | Path], target: Target | str | Path,
                 out: str | Path, *, tracking: dict[str, str] | None = None, ray_address: str | None = None,
                 fail_at_step: int | None = None) -> dict[str, Any]:
    """Run (or resume) a training job; returns the draft path and the final metrics.

    ``stores``: the feature stores (``cfg.features == "offline"``): local directories or object-store
    URLs (``s3://bucket/prefix``; every worker needs the credentials, see ``specdraft/store/location.py``);
    none with online features, which read ``cfg.conversations`` instead.

    ``tracking``: ``{"uri": ..., "run_id": ...}`` of an existing MLflow run that rank 0
    logs into. Rerunning with the same ``out`` resumes from its latest checkpoint.
    ``fail_at_step`` raises once at that optimizer step (a failure drill for resume tests).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from pipelines.rendezvous import torch_trainer  # Ray's TorchTrainer, its rendezvous on Ray's address only

    cfg = on_cluster(cfg)  # a core TrainConfig: the Ray knobs' defaults (a wrong stage or epoch count failed when built)
    target, out = Target.of(target), Path(out).resolve()  # the target checked here, once
    out.mkdir(parents=True, exist_ok=True)
    sc = cfg.scaling
    if sc.num_workers == 0:
        print("[specdraft] train.scaling.num_workers=0: training in this process (Ray Train's local mode); "
              "a rerun starts over, it does not resume", flush=True)
    resources = {"CPU": sc.cpus_per_worker, **({"GPU": sc.gpus_per_worker} if sc.use_gpu else {})}
    stores = [str(location.as_location(s)) if location.is_url(s) else str(Path(s).resolve()) for s in stores]
    if cfg.features == "online":
        if not cfg.conversations:
            raise ConfigError("conversations: features: online needs conversations (files/dirs, as `specdraft dump` reads)")
        missing = [c for c in cfg.conversations if not Path(c).exists()]
        if missing:
            raise ConfigError(f"conversations: not found: {missing}")
        if stores:
            raise ConfigError(f"features: online reads no store; got {stores}")
        cfg = replace(cfg, conversations=[str(Path(c).resolve()) for c in cfg.conversations])  # workers' cwd differs
        if (aux := aux_layers_setting(cfg, cfg.online.aux_layers)) != cfg.online.aux_layers:
            cfg = replace(cfg, online=replace(cfg.online, aux_layers=aux))
            print(f"[specdraft] recipe {cfg.recipe!r} reads auxiliary target layers: online features compute "
                  f"train.online.aux_layers={EAGLE3} (set it to a list of layers to choose others)", flush=True)
    else:
        if not stores:
            raise ConfigError("features: offline needs at least one feature store (or features=online with conversations)")
    # the stores checked against the target (TargetMismatch), the feature plan decided: before Ray starts
    plan = plan_run(cfg, *feature_plan(cfg, stores, target, out), out)  # resolved once: the workers train from it
    connect_ray(ray_address)
    job = WorkerConfig(train=cfg, plan=plan, stores=stores, target=str(target), **target_record(target), out=str(out),
                       tracking=tracking, fail_at_step=fail_at_step)
    trainer = torch_trainer(
        train_loop_per_worker,
        train_loop_config=to_dict(job),
        backend="nccl" if sc.use_gpu else "gloo",
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
    summary = {"draft": str(draft_dir), "metrics": dict(result.metrics or {}), "nodes": ranks_on_nodes(out),
               "checkpoint": result.checkpoint.path if result.checkpoint else None}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


