"""A training run's set-up: the draft, its features, its stages and its trainer, built in one place.

What every trainer of a draft does before its loop — the Ray Train worker, the quickstart, the
benchmarks — is ``build_run``: the draft built from the frozen target heads ("Cross-Attention
Speculative Decoding" (Beagle), §3; "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", §3 for the auxiliary layers and draft vocabulary), its frozen
heads in the compute dtype, wrapped for the worker group (``specdraft.parallel``), the feature splits
opened with batches small enough for a useful number of steps (``fit_batches``), and the stage schedule
with its optimizer and learning-rate schedule (``specdraft.training.Trainer``). Beside it:
``feature_plan`` (the stores checked against the target — ``store.manifest.check_store_target`` — then
auxiliary layers and draft vocabulary, decided once on the driver) and
``validate_draft`` (simulated chain acceptance over held-out batches). No Ray here: a caller that
runs workers initialises ``torch.distributed`` and passes its rank and world size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from specdraft import files
from specdraft.acceptance import AcceptanceCounts, simulated_acceptance
from specdraft.features import aux_layers_of
from specdraft.loggers import MetricLogger, NullLogger
from specdraft.models import (
    ARCHS,
    EMBED_KEY,
    LM_HEAD_KEY,
    DraftConfig,
    build_draft,
    check_draft_target,
    draft_config_from_target,
    read_draft_config,
    set_frozen_dtype,
)
from specdraft.objectives import StageConfig, unwrap
from specdraft.chat import TokenizedConversations
from specdraft.parallel import distribute, gathered
from specdraft.configs.draft import Arch
from specdraft.configs.train import TrainConfig
from specdraft.plan import RunPlan, build_plan, has_own_vocab, reads_eagle3_features
from specdraft.store import (
    ReaderConfig,
    StoreError,
    common_aux_layers,
    predicted_token_counts,
    read_manifest,
)
from specdraft.store.manifest import check_store_target
from specdraft.targets import Target
from specdraft.targets.identity import target_fingerprint
from specdraft.targets.loading import load_target_config, load_target_heads
from specdraft.training import DRAFT_DIR, Trainer, resolve_precision
from specdraft.vocab import coverage, select_vocab


class FeatureSplit(Protocol):
    """One split of the training features as the run reads it (``FeatureDataset``, ``OnlineDataset``,
    or an in-memory list): its reader config (batch budget) and each epoch's batches."""

    cfg: ReaderConfig

    def batches(self, epoch: int) -> list[Any]: ...


# ("train" | "val", reader, the plan's aux layers: () none) -> the split, its batches carrying those layers' states
OpenSplit = Callable[[str, ReaderConfig, tuple[int, ...]], FeatureSplit]


@dataclass
class Run:
    """Everything a worker holds before its loop."""

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
    ``run.trainer.run``. ``open_split`` opens a split of
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
                                    **plan.draft_shape)
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


def warm_start(cfg: TrainConfig, vocab: list[int] | tuple[int, ...] | None) -> bool:
    """Whether a run of ``cfg`` with the draft vocabulary ``vocab`` (``feature_plan``'s) starts from
    ``cfg.init_from``: one is given and its vocabulary was kept (a draft over the target's vocabulary keeps it
    always); a fallback to a fresh vocabulary starts fresh. The driver's plan (``build_plan(warm=...)``: the warm
    schedule) and ``build_run`` (the weights loaded) both ask here."""
    return bool(cfg.init_from) and (vocab is None or list(vocab) == draft_vocab_ids(cfg.init_from))


def plan_run(cfg: TrainConfig, aux_layers: list[int], vocab: list[int] | None, out: Path) -> RunPlan:
    """The run's plan on the driver, from the feature plan (``feature_plan``: aux layers, draft vocabulary): whether
    it warm-starts (``warm_start``) and so its schedule (``build_plan``: ``train.warm_epochs`` on a warm start),
    written to ``out/schedule.json`` (epochs per stage, warm or fresh and why, ``init_from`` when warm)."""
    warm = warm_start(cfg, vocab)
    plan = build_plan(cfg, aux_layers=aux_layers, vocab=vocab, warm=warm)
    schedule = {**plan.schedule(), **({"init_from": str(cfg.init_from)} if warm else {})}
    files.write_text(Path(out) / "schedule.json", json.dumps(schedule, indent=2))
    print(f"[specdraft] schedule: {schedule['why']}: epochs {schedule['epochs']} ({', '.join(schedule['stages'])})",
          flush=True)
    return plan


def draft_vocab_ids(init_from: str | Path) -> list[int]:
    """The draft vocabulary's target ids of the draft directory ``init_from``, from its stored ``d2t``."""
    from safetensors import safe_open

    with safe_open(str(Path(init_from) / "model.safetensors"), framework="pt") as fh:
        d2t = fh.get_tensor("heads.d2t")  # (Vd,) offsets: target id = draft id + d2t
    return (torch.arange(d2t.numel()) + d2t).tolist()


def feature_plan(
    cfg: TrainConfig,
    stores: list[str],
    target: Target | str | Path,
    out: Path,
    conversations: Callable[[], TokenizedConversations] | None = None,
) -> tuple[list[int], list[int] | None]:
    """(aux layer ids, draft vocabulary ids) for a recipe reading the EAGLE-3 features, else ([], None)
    (a block draft with the target's head: (aux layer ids, None)).

    The aux layers are the stores' (they must all hold the same ones), or with online features
    ``cfg.online.aux_layers`` resolved for the target as the dump resolves them (the Ray adapter
    defaults them to ``eagle3``). The draft vocabulary is built once on the driver from the predicted
    tokens — the stores', or online those of ``conversations()`` (the tokenized conversations: the same
    tokens a dump of them stores) — and written to ``out/draft_vocab.json`` (reused on resume, so a
    resumed run keeps its vocabulary).

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
    where = f"recipe {cfg.recipe!r} (arch {cfg.resolved()[0]!r}) reads auxiliary target layers"
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
        counts = predicted_token_counts(stores, vocab_size)
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
    record = {"size": ids.numel(), "coverage": coverage(counts, ids), "counted_tokens": int(counts.sum()),
              "target_ids": ids.tolist(), **warm}
    path.write_text(json.dumps(record))
    print(f"[specdraft] draft vocabulary: {ids.numel()} of {vocab_size} target tokens, covering "
          f"{record['coverage']:.2%} of {record['counted_tokens']} predicted tokens", flush=True)
    return list(layers), record["target_ids"]
