"""A training run's set-up: the draft, its features, its stages and its trainer, built in one place.

What every trainer of a draft does before its loop — the Ray Train worker, the quickstart, the
benchmarks — is ``build_run``: the draft built from the frozen target heads ("Cross-Attention
Speculative Decoding" (Beagle), §3; "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", §3 for the auxiliary layers and draft vocabulary), its frozen
heads in the compute dtype, wrapped for the worker group (``specdraft.parallel``), the feature splits
opened with batches small enough for a useful number of steps (``fit_batches``), and the stage schedule
with its optimizer and learning-rate schedule (``specdraft.training.Trainer``). ``Run.fit`` is every trainer's
loop around it: the stages' data epochs (``plan.epoch_offsets``), the held-out validation before training, after
each epoch and after training, and each epoch's end logged; a caller adds its own through ``RunHooks`` (the Ray
worker reports and checkpoints there). Beside it:
``feature_plan`` (the stores checked against the target — ``store.manifest.check_store_target`` — then
auxiliary layers and draft vocabulary, decided once on the driver) and
``validate_draft`` (simulated chain acceptance over held-out batches). No Ray here: a caller that
runs workers initialises ``torch.distributed`` and passes its rank and world size.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from specdraft.config import flatten
from specdraft.acceptance import AcceptanceCounts, simulated_acceptance
from specdraft.batch import Batch
from specdraft.features import aux_layers_of
from specdraft.loggers import MetricLogger, NullLogger
from specdraft.models import (
    ARCHS,
    EMBED_KEY,
    LM_HEAD_KEY,
    build_draft,
    check_draft_target,
    draft_config_from_target,
    read_draft_config,
    set_frozen_dtype,
)
from specdraft.configs.draft import Arch, DraftConfig
from specdraft.objectives import unwrap
from specdraft.configs.stages import StageConfig
from specdraft.chat import TokenizedConversations
from specdraft.parallel import distribute, gathered
from specdraft.configs.train import TrainConfig
from specdraft.epochs import VALIDATE, EpochEnd, Fitted, RunHooks
from specdraft.plan import RunPlan, draft_arch, draft_vocab_ids, has_own_vocab, reads_eagle3_features, warm_start
from specdraft.store import StoreError, common_aux_layers, predicted_token_counts, read_manifest
from specdraft.configs.reader import ReaderConfig
from specdraft.store.manifest import check_store_target
from specdraft.targets import Target
from specdraft.targets.identity import target_fingerprint
from specdraft.targets.loading import load_target_config, load_target_heads
from specdraft.training import DRAFT_DIR, Trainer, resolve_precision, warmup_of
from specdraft.vocab import coverage, select_vocab


class FeatureSplit(Protocol):
    """One split of the training features as the run reads it (``FeatureDataset``, ``OnlineDataset``,
    or an in-memory list): its reader config (batch budget) and each epoch's batches."""

    cfg: ReaderConfig

    def batches(self, epoch: int) -> list[Any]: ...

    def epoch_batches(self, epoch: int) -> Sequence[Batch]: ...


# ("train" | "val", reader, the plan's aux layers: () none) -> the split, its batches carrying those layers' states
OpenSplit = Callable[[str, ReaderConfig, tuple[int, ...]], FeatureSplit]


@dataclass
class Run:
    """Everything a worker holds before its loop, and the loop (``fit``)."""

    plan: RunPlan  # what the driver resolved (``specdraft.plan``); arch and stages are its
    arch: Arch
    stages: list[StageConfig]
    draft_config: DraftConfig
    draft: torch.nn.Module  # the bare draft (what ``save_draft`` writes)
    trainer: Trainer  # trainer.draft: the draft as trained (wrapped for the worker group)
    train: FeatureSplit
    val: FeatureSplit | None  # None: reader.val_fraction == 0
    reader: ReaderConfig  # the reader config the batches were fitted to (``fit_batches``)
    batches_per_epoch: int

    def fit(self, depth: int, max_batches: int, *, validate: Collection[str] = ("epoch",), hooks: RunHooks | None = None,
            batches: Callable[[int], Sequence[Batch]] | None = None) -> Fitted:
        """Train from the trainer's state (a loaded checkpoint's: mid-stage) to the end of the schedule, each stage's
        epochs reading the data epochs from its ``plan.epoch_offsets`` on, and measure the held-out acceptance
        (``validate_draft`` over ``depth`` draft tokens and up to ``max_batches`` batches) when ``validate`` says:
        ``before`` training, after each ``epoch``, ``after`` training. At an epoch's end the acceptance measured
        (sim_tau, alpha_i; nothing when nothing is held out) and ``hooks.epoch_metrics`` are logged by the trainer's
        logger, then ``hooks.epoch_end`` runs. ``batches(data_epoch)``: that epoch's batches (default
        ``train.epoch_batches``)."""
        if unknown := set(validate) - set(VALIDATE):
            raise ValueError(f"validate: {sorted(unknown)} not among {VALIDATE}")
        hooks, read, trainer = hooks or RunHooks(), batches or self.train.epoch_batches, self.trainer
        losses: list[float] = []

        def measure() -> AcceptanceCounts:
            return validate_draft(trainer.draft, self.val, depth, max_batches, trainer.device)

        def on_step(_: Trainer, metrics: dict[str, float]) -> None:
            losses.append(metrics["loss"])
            hooks.step(self, metrics)

        def on_epoch_end(_: Trainer) -> None:
            counts = None
            if "epoch" in validate:
                t, c = time.perf_counter(), time.process_time()
                counts = measure()
                fitted.val_s += time.perf_counter() - t
                fitted.val_cpu_s += time.process_time() - c
            metrics = ({"sim_tau": counts.sim_tau, **{f"alpha_{i + 1}": a for i, a in enumerate(counts.alpha)}}
                       if counts is not None and float(counts.reached[0]) > 0 else {})  # summed over the ranks
            metrics.update(hooks.epoch_metrics(self))
            if metrics:
                trainer.logger.log_metrics(metrics, trainer.state.step)
            state, done = trainer.state, sum(len(e.losses) for e in fitted.epochs)
            fitted.epochs.append(EpochEnd(stage=state.stage, kind=self.stages[state.stage].kind, epoch=state.epoch,
                                          step=state.step, losses=tuple(losses[done:]), counts=counts, metrics=metrics))
            hooks.epoch_end(self, fitted.epochs[-1])

        started = time.perf_counter()
        fitted = Fitted(before=measure() if "before" in validate else None)
        fitted.before_s = time.perf_counter() - started
        hooks.loop_start(self)
        t, c = time.perf_counter(), time.process_time()
        trainer.run(lambda stage, epoch: read(self.plan.epoch_offsets[stage] + epoch), on_step=on_step,
                    on_epoch_end=on_epoch_end)
        fitted.loop_s, fitted.loop_cpu_s = time.perf_counter() - t, time.process_time() - c
        hooks.loop_end(self)
        fitted.after = measure() if "after" in validate else None
        return fitted

    def params(self, cfg: TrainConfig, world: int) -> dict[str, Any]:
        """A tracker's parameters of this run of ``cfg`` on ``world`` workers: ``cfg`` flattened under ``train.`` and
        what the run made of it (its batches, steps, warmup, stages and why it may not learn)."""
        trainer = self.trainer
        return {**flatten(cfg, "train"), "train.arch_resolved": self.arch, "train.world_size": world,
                "train.batches_per_epoch": self.batches_per_epoch, "train.total_steps": trainer.total_steps,
                "train.max_tokens_used": self.reader.max_tokens,
                "train.warmup_used": warmup_of(cfg.optim, trainer.total_steps),
                "train.stage_kinds": ",".join(s.kind for s in self.stages),  # the report's labels
                "train.epochs_used": ",".join(str(s.epochs) for s in self.stages),
                "train.warnings": " | ".join(trainer.warnings) or "none"}


def build_run(
    cfg: TrainConfig,
    plan: RunPlan,
    target: Target | str | Path,
    open_split: OpenSplit,
    *,
    target_id: str = "",
    fingerprint: str | None = None,
    device: torch.device | str = "cpu",
    rank: int = 0,
    world: int = 1,
    logger: MetricLogger | None = None,
    strategy: str = "ddp",
) -> Run:
    """The run of ``cfg`` as ``plan`` resolved it on the driver (``specdraft.plan.build_plan``: architecture, stage
    schedule, draft shape, aux layers, vocabulary) on this rank: draft, splits and trainer, ready for
    ``Run.fit``. ``open_split`` opens a split of
    the features with a reader config and the plan's auxiliary layers (``plan.aux_layers``: the one place they
    are said; a store holding others is refused by its reader).
    ``cfg.init_from`` (a draft directory) starts the draft from its weights and vocabulary (``load_warm``)
    when ``plan.vocab`` is its vocabulary (``feature_plan`` kept it; a fallback to a fresh one starts fresh).
    The seed is ``cfg.seed`` for the draft's initial weights and ``cfg.seed + 1000 * rank`` for the
    trainer's stream (noise, window offsets). With ``world > 1`` the caller has initialised
    ``torch.distributed``; the draft is wrapped per ``strategy`` (``train.scaling.strategy``). The draft records the
    target's ``target_id`` and content ``fingerprint`` (None: computed here, ``target_fingerprint``).
    """
    torch.manual_seed(cfg.seed)
    arch, stages, target = plan.arch, list(plan.stages), Target.of(target)
    heads = load_target_heads(target)
    vocab_ids = torch.tensor(plan.vocab) if plan.vocab is not None else None
    dcfg = draft_config_from_target(load_target_config(target), arch, intermediate_size=cfg.intermediate_size,
                                    target_id=target_id, aux_layers=list(plan.aux_layers),
                                    target_fingerprint=target_fingerprint(target) if fingerprint is None else fingerprint,
                                    draft_vocab_size=None if vocab_ids is None else vocab_ids.numel(),
                                    **(plan.draft_shape.as_kwargs() if plan.draft_shape else {}))
    draft = build_draft(dcfg, heads.embed, heads.lm_head, vocab=vocab_ids)
    if warm_start(cfg, plan.vocab):
        load_warm(draft, cfg.init_from)
    if resolve_precision(cfg.precision, torch.device(device)) == "bf16":
        set_frozen_dtype(draft, torch.bfloat16)  # frozen heads in the compute dtype; trainable weights stay fp32
    model, grad_sync = distribute(draft, strategy, world, device)

    train = open_split("train", cfg.reader, plan.aux_layers)
    reader = fit_batches(train, cfg, stages)  # small stores get smaller batches, hence enough steps
    train.cfg = reader
    val = open_split("val", reader, plan.aux_layers) if cfg.reader.val_fraction > 0 else None
    per_epoch = len(train.batches(0))
    if per_epoch == 0:
        raise ValueError(f"rank {rank} of {world} got no training batches: too few training sequences for "
                         f"{world} worker(s) (more data, fewer workers or a smaller reader.val_fraction)")
    trainer = Trainer(model, stages, cfg.optim, per_epoch, seed=cfg.seed + 1000 * rank, logger=logger or NullLogger(),
                      device=device, precision=cfg.precision, grad_sync=grad_sync, loss_chunk=cfg.loss_chunk)
    return Run(plan=plan, arch=arch, stages=stages, draft_config=dcfg, draft=draft, trainer=trainer, train=train, val=val,
               reader=reader, batches_per_epoch=per_epoch)


def fit_batches(dataset: FeatureSplit, cfg: TrainConfig, stages: list[StageConfig]) -> ReaderConfig:
    """The reader config whose batches give at least ``cfg.min_steps`` optimizer steps per rank.

    Halves ``max_tokens`` (the padded tokens per batch) from its configured value until the run has
    ``min_steps`` steps or every batch holds a single sequence (a store too small for ``min_steps`` then
    trains one sequence per step); a large store keeps its batches. A halving that leaves the number of
    batches unchanged — a budget still above a small store's total — goes on halving. The plan depends
    only on the stores and the config, so every rank computes the same one.
    """
    epochs = sum(s.epochs for s in stages)
    reader = dataset.cfg
    while True:
        dataset.cfg = reader
        plan = dataset.batches(0)
        if (epochs * math.ceil(len(plan) / cfg.optim.grad_accum) >= cfg.min_steps or reader.max_tokens == 1
                or all(len(seqs) <= 1 for seqs in plan)):
            return reader
        reader = replace(reader, max_tokens=max(1, reader.max_tokens // 2))


def validate_draft(draft, dataset, depth: int, max_batches: int, device) -> AcceptanceCounts:
    """Simulated acceptance over (up to ``max_batches`` of) this rank's held-out batches (summed over
    the ranks when ``torch.distributed`` is initialised; collective then)."""
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


def load_warm(draft, init_from: str | Path) -> None:
    """Load the draft directory ``init_from`` into the fresh ``draft``: every persistent tensor, the draft
    vocabulary maps ``d2t``/``t2d`` included, copied as stored (never recomputed: recomputing them from new data
    misaligns every head slot, SpecForge PR #534). Its config must match the draft's but for the target's
    identity fields (``check_draft_target`` checks those); ``ValueError`` naming the fields that differ."""
    from safetensors.torch import load_file

    theirs = read_draft_config(init_from)
    mine = draft.config
    skip = {"target_id", "target_fingerprint"}
    differ = [f for f in mine.__dataclass_fields__ if f not in skip and getattr(mine, f) != getattr(theirs, f)]
    if differ:
        raise ValueError(f"train.init_from={init_from}: its draft differs from this run's in "
                         + ", ".join(f"{f} ({getattr(theirs, f)!r} vs {getattr(mine, f)!r})" for f in differ))
    state = load_file(str(Path(init_from) / "model.safetensors"), device="cpu")
    state = {k: v for k, v in state.items() if k not in (EMBED_KEY, LM_HEAD_KEY)}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"train.init_from={init_from}: weights do not match (missing={missing}, "
                         f"unexpected={unexpected})")


def warm_start_gap(init_from: str | Path) -> str:
    """What the draft directory ``init_from`` lacks to be warm-started from (``load_warm``, ``draft_vocab_ids``):
    "" when nothing; else one phrase — a file missing or unreadable, or the tensors its own config says it holds
    that ``model.safetensors`` does not (the vocabulary maps ``heads.d2t``/``heads.t2d`` of a draft vocabulary
    named as such). Reads the safetensors header only; the draft is built on the meta device (no memory)."""
    from safetensors import safe_open

    path = Path(init_from)
    absent = [name for name in ("config.json", "model.safetensors") if not (path / name).is_file()]
    if absent:
        return f"{' and '.join(absent)} missing"
    try:
        config = read_draft_config(path)
        with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
            present = set(fh.keys())
    except Exception as err:  # a truncated file, a bad config: safetensors and the config reader raise their own
        return f"unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    with torch.device("meta"):
        expected = set(ARCHS[config.arch](config).state_dict())
    missing = sorted(expected - present)
    maps = [key for key in missing if key.rsplit(".", 1)[-1] in ("d2t", "t2d")]
    others = [key for key in missing if key not in maps]
    said = ([f"its draft vocabulary maps {', '.join(maps)}"] if maps else []) + (
        [f"{len(others)} weight tensors ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"] if others else [])
    return f"{' and '.join(said)} missing from model.safetensors" if said else ""


def feature_plan(
    cfg: TrainConfig,
    stores: list[str],
    target: Target | str | Path,
    out: Path,
    conversations: Callable[[], TokenizedConversations] | None = None,
    samples: Collection[str] | None = None,
) -> tuple[list[int], list[int] | None]:
    """(aux layer ids, draft vocabulary ids) for a recipe reading the EAGLE-3 features, else ([], None)
    (a block draft with the target's head: (aux layer ids, None)).

    The aux layers are the stores' (they must all hold the same ones), or with online features
    ``cfg.online.aux_layers`` resolved for the target as the dump resolves them (the Ray adapter
    defaults them to ``eagle3``). The draft vocabulary is built once on the driver from the predicted
    tokens — the stores', or online those of ``conversations()`` (the tokenized conversations: the same
    tokens a dump of them stores; with ``samples`` only those sequences of the stores, the ones trained on) — and
    written to ``out/draft_vocab.json`` (reused on resume, so a resumed run keeps its vocabulary).

    First, before any model or cluster is touched, every store is checked against ``target``
    (``check_store_target``: ``TargetMismatch`` naming the store, its fingerprint and the target's), and
    so is every draft the run already wrote under ``out`` — its checkpoints', which a rerun resumes from,
    and a finished run's (``check_draft_target``: ``TargetMismatch`` naming that draft and both fingerprints).
    """
    target = Target.of(target)
    if cfg.features != "online":
        for store in stores:
            check_store_target(store, target)
    for config in sorted(Path(out).glob(f"**/{DRAFT_DIR}/config.json")):  # a resumed run's own drafts
        check_draft_target(config.parent, target)
    if not reads_eagle3_features(cfg):
        return [], None
    where = f"recipe {cfg.recipe!r} (arch {draft_arch(cfg)!r}) reads auxiliary target layers"
    if cfg.features == "online":
        try:
            layers = aux_layers_of(cfg.online, load_target_config(target))
        except ValueError as err:
            raise ValueError(f"{where} (train.online.aux_layers={cfg.online.aux_layers!r}): {err}") from None
        if not layers:
            raise ValueError(f"{where}: set train.online.aux_layers (eagle3 or a list of layers)")
    else:
        try:
            layers = common_aux_layers([(Path(s), read_manifest(s)) for s in stores])
        except StoreError as err:
            raise StoreError(f"{where}: {err}") from None
    if not has_own_vocab(cfg):  # the target's frozen head over its whole vocabulary
        return list(layers), None
    path = out / "draft_vocab.json"
    if path.is_file():
        return list(layers), json.loads(path.read_text())["target_ids"]
    vocab_size = int(load_target_config(target).get_text_config().vocab_size)
    if cfg.features == "online":
        assert conversations is not None, "online features: feature_plan needs the tokenized conversations"
        counts = conversations().predicted_token_counts(vocab_size)
    else:
        counts = predicted_token_counts(stores, vocab_size, samples)
    warm: dict[str, Any] = {}
    if cfg.init_from:  # warm start: the draft's own vocabulary, unless it no longer covers the new data
        kept = torch.tensor(draft_vocab_ids(cfg.init_from))
        covered = coverage(counts, kept)
        if covered >= cfg.init_min_coverage:
            record = {"size": kept.numel(), "coverage": covered, "counted_tokens": int(counts.sum()),
                      "target_ids": kept.tolist(), "init_from": str(cfg.init_from)}
            path.write_text(json.dumps(record))
            print(f"[specdraft] warm start from {cfg.init_from}: its draft vocabulary kept ({kept.numel()} tokens, "
                  f"covering {covered:.2%} of the new predicted tokens)", flush=True)
            return list(layers), record["target_ids"]
        warm = {"warm_start_fallback": f"{cfg.init_from}'s vocabulary covers {covered:.2%} of the new predicted "
                                       f"tokens < train.init_min_coverage {cfg.init_min_coverage:.0%}: a fresh "
                                       "vocabulary and fresh weights"}
        print(f"[specdraft] no warm start: {warm['warm_start_fallback']}", flush=True)
    ids = select_vocab(counts, cfg.draft_vocab_size)
    record = {"size": ids.numel(), "vocab_size": vocab_size, "coverage": coverage(counts, ids),
              "counted_tokens": int(counts.sum()), "target_ids": ids.tolist(), **warm}
    path.write_text(json.dumps(record))
    print(f"[specdraft] draft vocabulary: {ids.numel()} of {vocab_size} target tokens, covering "
          f"{record['coverage']:.2%} of {record['counted_tokens']} predicted tokens", flush=True)
    return list(layers), record["target_ids"]
