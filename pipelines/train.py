"""Train a draft on Ray Train from a feature store (Beagle §4.2 two-stage; HASS §3).

A ``TorchTrainer`` runs ``train_loop_per_worker`` on each worker: build the draft from the
target's embedding/lm_head, read this rank's partition of the store, and run the stage
schedule with ``specdraft.training.Trainer`` (gloo on CPU, nccl on GPU), the draft replicated
(``train.scaling.strategy: ddp``, ``ray.train.torch.prepare_model``) or sharded with FSDP2
(``fsdp``, ``torch.distributed.fsdp.fully_shard``; see ``distribute`` and ``shard_draft``). Every
``checkpoint_every`` optimizer steps and at every epoch end a checkpoint (the full draft dir +
full optimizer state, scheduler, every rank's RNG, loop position), gathered with all ranks taking
part and written by rank 0, is reported; a rerun with the same output directory, or a worker
failure, resumes from the latest one mid-stage, whatever the strategy. ``features: online`` (SpecForge's
online mode) reads no store: each worker loads the frozen target and computes every batch's features
from the tokenized conversations (``specdraft.online``), the same batches and values a store of them
would give — for the EAGLE-3 recipes too (``train.online.aux_layers``, default ``eagle3``; the draft
vocabulary counted from the conversations, see ``feature_plan``). Validation runs the
simulated chain acceptance on held-out sequences (alpha_i, sim_tau) after each epoch. Rank 0
logs to the configured logger.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pipelines.cluster import connect_ray
from pipelines.ingest import load_conversations
from specdraft.acceptance import AcceptanceCounts, simulated_acceptance
from specdraft.config import flatten, from_dict, to_dict
from specdraft.features import aux_layers_of
from specdraft.loggers import JsonlLogger, MultiLogger, NullLogger
from specdraft.models import build_draft, draft_config_from_target, save_draft, set_frozen_dtype
from specdraft.models.heads import FROZEN
from specdraft.objectives import StageConfig, no_grad_sync_needed, unwrap
from specdraft.recipes import RECIPES, Recipe, ScalingSection, TrainConfig  # noqa: F401 - the train config's home
from specdraft.online import OnlineDataset, TokenizedConversations, tokenize_conversations
from specdraft.store import (
    FeatureDataset,
    ReaderConfig,
    StoreError,
    check_aux_layers,
    predicted_token_counts,
    read_manifest,
)
from specdraft.store import location
from specdraft.target import EAGLE3, load_target_config, load_target_heads, load_target_model, load_tokenizer, target_id
from specdraft.training import Trainer, resolve_precision, warmup_of
from specdraft.vocab import coverage, select_vocab

STATE_FILE = "trainer_state.pt"
DRAFT_DIR = "draft"

def fit_batches(dataset: FeatureDataset, cfg: TrainConfig, stages: list[StageConfig]) -> ReaderConfig:
    """The reader config whose batches give at least ``cfg.min_steps`` optimizer steps per rank.

    Halves ``max_tokens`` (the padded tokens per batch) from its configured value until the run has
    ``min_steps`` steps or every batch holds a single sequence; a large store keeps its batches. The
    plan depends only on the stores and the config, so every rank computes the same one.
    """
    epochs = sum(s.epochs for s in stages)
    reader, previous, batches = dataset.cfg, dataset.cfg, -1
    while True:
        dataset.cfg = reader
        more = len(dataset.batches(0))
        if more == batches:  # one sequence per batch already: smaller budgets change nothing
            dataset.cfg = previous
            return previous
        batches, previous = more, reader
        if epochs * math.ceil(batches / cfg.optim.grad_accum) >= cfg.min_steps or reader.max_tokens == 1:
            return reader
        reader = replace(reader, max_tokens=max(1, reader.max_tokens // 2))


def validate_draft(draft, dataset: FeatureDataset | None, depth: int, max_batches: int, device) -> AcceptanceCounts:
    """Simulated acceptance over (up to ``max_batches`` of) this rank's held-out batches."""
    counts = AcceptanceCounts.zeros(depth)
    if dataset is None:
        return counts
    core = unwrap(draft)
    core.eval()
    with gathered(core):  # drafting runs outside the forward: FSDP2 shards must be gathered by hand
        for seqs in dataset.batches(0)[:max_batches]:
            counts.add(simulated_acceptance(core, dataset.load(seqs, lazy=True).to(device), depth))
    core.train()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        both = torch.stack([counts.accepted, counts.reached]).to(device)
        torch.distributed.all_reduce(both)
        counts = AcceptanceCounts(both[0].cpu(), both[1].cpu())
    return counts


def _save_checkpoint(trainer: Trainer, directory: Path | None) -> None:
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


def _load_checkpoint(trainer: Trainer, directory: Path, rank: int = 0, world: int = 1) -> None:
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
    vocab = torch.tensor(config["vocab"]) if config.get("vocab") is not None else None
    dcfg = draft_config_from_target(load_target_config(target), arch, intermediate_size=cfg.intermediate_size,
                                    target_id=config.get("target_id", ""), aux_layers=config.get("aux_layers"),
                                    draft_vocab_size=None if vocab is None else vocab.numel())
    draft = build_draft(dcfg, heads.embed, heads.lm_head, vocab=vocab)
    if resolve_precision(cfg.precision, torch.device(device)) == "bf16":
        set_frozen_dtype(draft, torch.bfloat16)  # frozen heads in the compute dtype; trainable weights stay fp32
    model, grad_sync = distribute(draft, cfg.scaling.strategy, world, device)

    reader = replace(cfg.reader, aux=True) if dcfg.aux_layers else cfg.reader
    open_split = (online_features(cfg, config["target"], device, rank, world, dcfg.aux_layers)
                  if cfg.features == "online"
                  else lambda split, rd: FeatureDataset(config["stores"], rd, split=split, rank=rank, world_size=world))
    train_ds = open_split("train", reader)
    reader = fit_batches(train_ds, cfg, stages)  # small stores get smaller batches, hence enough steps
    train_ds.cfg = reader
    val_ds = open_split("val", reader) if cfg.reader.val_fraction > 0 else None
    per_epoch = len(train_ds.batches(0))
    assert per_epoch > 0, f"rank {rank} got no training batches from {config['stores'] or cfg.conversations}"

    logger = _rank0_logger(config) if rank == 0 else NullLogger()
    trainer = Trainer(model, stages, cfg.optim, per_epoch, seed=cfg.seed + 1000 * rank, logger=logger, device=device,
                      precision=cfg.precision, grad_sync=grad_sync, loss_chunk=cfg.loss_chunk)
    if rank == 0:
        print(f"[specdraft] {trainer.total_steps} optimizer steps ({per_epoch} batches of <= {reader.max_tokens} "
              f"tokens per epoch and rank), warmup {warmup_of(cfg.optim, trainer.total_steps)}, peak lr "
              f"{cfg.optim.lr:g}", flush=True)
        for line in trainer.warnings:
            print(f"[specdraft] WARNING: this configuration cannot learn well: {line}", flush=True)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            _load_checkpoint(trainer, Path(d), rank, world)
        if rank == 0:
            print(f"[specdraft] resumed at {trainer.state.as_dict()}", flush=True)
    elif rank == 0:
        trainer.logger.log_params({**flatten(cfg, "train"), "train.arch_resolved": arch,
                                   "train.world_size": world, "train.batches_per_epoch": per_epoch,
                                   "train.total_steps": trainer.total_steps, "train.max_tokens_used": reader.max_tokens,
                                   "train.warmup_used": warmup_of(cfg.optim, trainer.total_steps),
                                   "train.warnings": " | ".join(trainer.warnings) or "none"})

    epoch_offsets = [sum(s.epochs for s in stages[:i]) for i in range(len(stages))]
    started = time.perf_counter()

    def report(metrics: dict[str, float], with_checkpoint: bool) -> None:
        metrics = {**metrics, **{f"state_{k}": v for k, v in trainer.state.as_dict().items()}}
        if not with_checkpoint:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as tmp:
            _save_checkpoint(trainer, Path(tmp) if rank == 0 else None)  # every rank: the state is gathered
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

    def batches(stage: int, epoch: int):  # read ahead in the background, decoded on the device (Batch.to)
        return train_ds.epoch_batches(epoch_offsets[stage] + epoch)

    fail_at = int(config.get("fail_at_step") or 0)  # fault injection (tests, failure drills)
    if fail_at:
        inner = on_step

        def on_step(tr, metrics, inner=inner):  # noqa: F811
            inner(tr, metrics)
            if tr.state.step == fail_at and not Path(config["out"], ".failed-once").exists():
                Path(config["out"], ".failed-once").touch()
                raise RuntimeError(f"injected failure at step {fail_at}")

    trainer.run(batches, on_step=on_step, on_epoch_end=on_epoch_end)
    weights = trainer.draft_state_dict()  # every rank: gathered in full, held by rank 0
    if rank == 0:
        save_draft(unwrap(trainer.draft), Path(config["out"]) / DRAFT_DIR, weights=weights)
        trainer.logger.close()
    ray.train.report({"done": 1.0, **{f"state_{k}": v for k, v in trainer.state.as_dict().items()}})


def online_conversations(cfg: TrainConfig, target: str | Path) -> tuple[TokenizedConversations, int]:
    """(``cfg.conversations`` tokenized as a dump with ``cfg.online`` would tokenize them, rows read)."""
    tokenizer = load_tokenizer(target, trust_remote_code=cfg.online.trust_remote_code)
    rows, _ = load_conversations(cfg.conversations)
    return tokenize_conversations(tokenizer, rows, cfg.online.max_length, cfg.online.overlong), len(rows)


def online_features(cfg: TrainConfig, target: str, device, rank: int, world: int, aux_layers: list[int] | None = None):
    """``features: online``: a function ``(split, reader) -> OnlineDataset`` over this worker's target.

    The conversations are tokenized as a dump with ``cfg.online`` would tokenize them, and the frozen
    target is loaded once on the worker's device in ``cfg.online.dtype`` (auto: bf16 on GPU, fp32 on
    CPU); both splits share them. ``aux_layers``: the resolved auxiliary layers the draft reads
    (``feature_plan``), computed in the same forward.
    """
    data, num_rows = online_conversations(cfg, target)
    with torch.random.fork_rng(devices=[]):  # loading the target must not move the draft's random stream
        model = load_target_model(target, cfg.online.dtype, device, trust_remote_code=cfg.online.trust_remote_code,
                                  attn_implementation=cfg.online.attn_implementation)
    if rank == 0:
        print(f"[specdraft] online features: {len(data)} of {num_rows} conversations kept (rejected {data.rejected}, "
              f"truncated {data.truncated}, duplicate ids {data.duplicates}); target on {device} in "
              f"{next(model.parameters()).dtype}", flush=True)

    def open_split(split: str, reader: ReaderConfig) -> OnlineDataset:
        return OnlineDataset(model, data, reader, topk=cfg.online.topk, hidden_codec=cfg.online.hidden_codec,
                             logits_chunk=cfg.online.logits_chunk, split=split, rank=rank, world_size=world,
                             aux_layers=aux_layers or ())

    return open_split


def distribute(draft, strategy: str, world: int, device):
    """The draft wrapped for ``world`` workers, and its gradient-sync switch (``Trainer.grad_sync``).

    Choosing (``train.scaling.strategy``): ``ddp`` replicates the draft — every rank holds its fp32
    weights, gradients and AdamW state (16 bytes per trainable parameter) and gradients are
    all-reduced; ``fsdp`` shards those over the N ranks (``shard_draft``: each holds 1/N) at the
    cost of gathering the weights for every sub-step. A draft is one layer: 0.22-0.43 B parameters
    at Llama-3-8B's shape (3.3-6.3 GiB of weights + gradients + AdamW state; the top is EAGLE-3
    with a 32k draft vocabulary), 0.86-1.4 B at Llama-3-70B's (13-21 GiB). DDP is the default;
    FSDP pays off when that state crowds out activations (large targets, long sequences, ``ttt``).

    DDP: the frozen target tensors are buffers every rank loads from the target itself, so they are
    neither broadcast at construction nor before each forward (``broadcast_buffers=False``: a
    128k x 4096 embedding is 1 GB), and gradients are synchronised only on the last backward of an
    accumulation group (``no_sync`` elsewhere).
    """
    import ray.train.torch

    assert strategy in ("ddp", "fsdp"), f"unknown train.scaling.strategy {strategy!r}: ddp or fsdp"
    if world == 1:
        return draft.to(device), no_grad_sync_needed
    if strategy == "fsdp":
        return shard_draft(draft.to(device), world, device)
    from torch.nn.parallel import DistributedDataParallel

    frozen = [f"heads.{name}" for name, _ in draft.heads.named_buffers() if name in FROZEN]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(draft, frozen)
    model = ray.train.torch.prepare_model(draft, parallel_strategy="ddp",
                                          parallel_strategy_kwargs={"broadcast_buffers": False})
    return model, lambda enabled: nullcontext() if enabled else model.no_sync()


def shard_draft(draft, world: int, device):
    """The draft sharded with FSDP2 (``fully_shard``, in place) over ``world`` ranks, and its
    gradient-sync switch. (Ray's ``prepare_model(parallel_strategy="fsdp")`` wraps with FSDP1.)

    * Frozen tensors: the target's embedding, shared lm_head and teacher rows are non-persistent
      buffers of ``draft.heads``. FSDP shards, gathers and reduces parameters only, so every rank
      keeps the full copy it loaded from the target and they are never communicated.
    * The body is one unit, the root: a draft is one layer, so more units would only add
      all-gathers. The root keeps its weights gathered from its forward to its backward
      (``reshard_after_forward=False``), so a chained stage's several forwards before one backward
      (``ttt``) gather once. When ``ttt``'s backward reaches a forward whose inputs carry gradient
      (the fed-back states), FSDP reshards the root there and gathers it again for the earlier
      forward's backward: correct, one extra all-gather per step.
    * The head of a draft with its own vocabulary (EAGLE-3: trainable ``heads.norm`` +
      ``heads.lm_head``) is used by the losses *outside* the draft's forward (``objectives.score`` ->
      ``losses.head_loss``), where FSDP's hooks do not reach, so it is a second unit: a forward hook
      on the draft gathers it at the end of every forward (the losses run right after), and FSDP's
      end-of-backward callback, which visits every unit, reduce-scatters its gradients and
      reshards it once the whole backward is done. Inside the root unit it would be resharded with
      the root in the middle of ``ttt``'s backward, while earlier steps' head backwards still read
      it (freed storage: a crash).
    * Gradient sync: ``set_requires_gradient_sync(enabled)`` on every unit. Off, FSDP accumulates
      unsharded gradients locally; the last backward of an accumulation group reduce-scatters the
      sum (averaged over ranks, as DDP does).
    * Outside a forward (validation) the weights are gathered by ``gathered``; checkpoints gather
      the full state with every rank taking part (``Trainer.state_dict``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world,))
    heads = draft.heads
    if any(True for _ in heads.parameters()):
        fully_shard(heads, mesh=mesh)
        draft.register_forward_hook(lambda module, args, output: heads.unshard())
    fully_shard(draft, mesh=mesh, reshard_after_forward=False)

    @contextmanager
    def grad_sync(enabled: bool):
        draft.set_requires_gradient_sync(enabled)  # recursive: both units
        try:
            yield
        finally:
            draft.set_requires_gradient_sync(True)

    return draft, grad_sync


@contextmanager
def gathered(model):
    """``model`` with every FSDP2 unit's weights gathered, for code that runs outside its forward
    (validation drafting); collective: every rank enters it. A plain or DDP model is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def _rank0_logger(config: dict[str, Any]):
    loggers = [JsonlLogger(Path(config["out"]) / "metrics.jsonl")]
    tracking = config.get("tracking")
    if tracking:
        from pipelines.tracking import MlflowLogger

        loggers.append(MlflowLogger(tracking["uri"], run_id=tracking["run_id"]))
    return MultiLogger(*loggers)


def feature_plan(cfg: TrainConfig, stores: list[str], target: str | Path, out: Path) -> tuple[list[int], list[int] | None]:
    """(aux layer ids, draft vocabulary ids) for a recipe reading the EAGLE-3 features, else ([], None).

    The aux layers are the stores' (they must all hold the same ones), or with online features
    ``cfg.online.aux_layers`` resolved for the target as the dump resolves them (``run_training``
    defaults them to ``eagle3``). The draft vocabulary is built once on the driver from the predicted
    tokens — the stores', or online the tokenized conversations' (the same tokens a dump of them
    stores) — and written to ``out/draft_vocab.json`` (reused on resume, so a resumed run keeps its
    vocabulary).
    """
    if not cfg.eagle3_features:
        return [], None
    where = f"recipe {cfg.recipe!r} (arch {cfg.resolved()[0]!r}) reads the EAGLE-3 features"
    if cfg.features == "online":
        try:
            layers = aux_layers_of(cfg.online, load_target_config(target))
        except ValueError as err:
            raise ValueError(f"{where} (train.online.aux_layers={cfg.online.aux_layers!r}): {err}") from None
        if not layers:
            raise ValueError(f"{where}: set train.online.aux_layers (eagle3 or a list of layers)")
    else:
        try:
            layers = check_aux_layers([(Path(s), read_manifest(s)) for s in stores])
        except StoreError as err:
            raise StoreError(f"{where}: {err}") from None
    path = out / "draft_vocab.json"
    if path.is_file():
        return list(layers), json.loads(path.read_text())["target_ids"]
    vocab_size = int(load_target_config(target).get_text_config().vocab_size)
    if cfg.features == "online":
        counts = online_conversations(cfg, target)[0].predicted_token_counts(vocab_size)
    else:
        counts = predicted_token_counts(stores, vocab_size)
    ids = select_vocab(counts, cfg.draft_vocab_size)
    record = {"size": ids.numel(), "coverage": coverage(counts, ids), "counted_tokens": int(counts.sum()),
              "target_ids": ids.tolist()}
    path.write_text(json.dumps(record))
    print(f"[specdraft] draft vocabulary: {ids.numel()} of {vocab_size} target tokens, covering "
          f"{record['coverage']:.2%} of {record['counted_tokens']} predicted tokens", flush=True)
    return list(layers), record["target_ids"]


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

    ``stores``: the feature stores (``cfg.features == "offline"``): local directories or object-store
    URLs (``s3://bucket/prefix``; every worker needs the credentials, see ``specdraft/store/location.py``);
    none with online features, which read ``cfg.conversations`` instead.

    ``tracking``: ``{"uri": ..., "run_id": ...}`` of an existing MLflow run that rank 0
    logs into. Rerunning with the same ``out`` resumes from its latest checkpoint.
    ``fail_at_step`` raises once at that optimizer step (a failure drill for resume tests).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg.resolved()  # a wrong stage or epoch count fails here, on the driver, not in a (retried) worker
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    connect_ray(ray_address)
    sc = cfg.scaling
    assert sc.num_workers >= 0, f"train.scaling.num_workers={sc.num_workers}: 0 (in this process) or more workers"
    if sc.num_workers == 0:
        print("[specdraft] train.scaling.num_workers=0: training in this process (Ray Train's local mode); "
              "a rerun starts over, it does not resume", flush=True)
    resources = {"CPU": sc.cpus_per_worker, **({"GPU": sc.gpus_per_worker} if sc.use_gpu else {})}
    stores = [str(location.as_location(s)) if location.is_url(s) else str(Path(s).resolve()) for s in stores]
    if cfg.features == "online":
        assert cfg.conversations, "features: online needs conversations (files/dirs, as `specdraft dump` reads)"
        missing = [c for c in cfg.conversations if not Path(c).exists()]
        assert not missing, f"conversations not found: {missing}"
        assert not stores, f"features: online reads no store; got {stores}"
        cfg = replace(cfg, conversations=[str(Path(c).resolve()) for c in cfg.conversations])  # workers' cwd differs
        if cfg.eagle3_features and cfg.online.aux_layers is None:
            cfg = replace(cfg, online=replace(cfg.online, aux_layers=EAGLE3))
            print(f"[specdraft] recipe {cfg.recipe!r} reads auxiliary target layers: online features compute "
                  f"train.online.aux_layers={EAGLE3} (set it to a list of layers to choose others)", flush=True)
    else:
        assert stores, "features: offline needs at least one feature store (or features=online with conversations)"
    aux_layers, vocab = feature_plan(cfg, stores, target, out)
    config = {
        "train": to_dict(cfg),
        "stores": stores,
        "aux_layers": aux_layers,
        "vocab": vocab,
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


