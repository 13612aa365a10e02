"""A laptop-sized end-to-end run of the core: toy target -> features -> a recipe's draft training.

Builds (or reuses) the toy target, renders synthetic conversations with its chat
template, computes the target's last hidden states (and, for the EAGLE-3 recipes, the
auxiliary layers' states) and top-K log-probs in memory,
trains a draft with a recipe of ``specdraft.configs.recipes`` (default: ``beagle``, the early stage,
k=5, then the late stage, s=4 — "Cross-Attention Speculative Decoding" (Beagle), §4.2), set up
by ``specdraft.run.build_run`` and trained by ``Run.fit`` as every trainer is, with fewer epochs, and
reports the simulated chain acceptance (alpha_i, sim_tau) on held-out conversations before, during
and after training. The full pipeline (Zarr store, Ray, Prefect, MLflow) runs the same pieces at
scale.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdraft.batch import Batch, pad_batch
from specdraft.config import to_dict
from specdraft.features import compute_features, resolve_aux_layers
from specdraft.loggers import JsonlLogger
from specdraft.models import save_draft
from specdraft.configs.quickstart import QuickstartConfig
from specdraft.configs.train import TrainConfig
from specdraft.plan import aux_layers_setting, build_plan, has_own_vocab, reads_eagle3_features
from specdraft.epochs import RunHooks
from specdraft.run import Run, build_run
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.identity import target_id
from specdraft.targets.loading import load_target_config, load_target_model, load_tokenizer
from specdraft.toy.build import build_toy_target
from specdraft.toy.conversations import generate_conversations
from specdraft.vocab import count_predicted_tokens, select_vocab


class SampleSplit:
    """In-memory samples read as a split of a store is read: ``batches(epoch)`` gives length-bucketed
    groups of ``batch_size`` sample indices in an order seeded by ``seed + epoch``, ``load`` pads them.
    The held-out conversations are the ``val`` split (the reader's budget and val_fraction are unused)."""

    def __init__(self, samples: list[dict], batch_size: int, seed: int, cfg: ReaderConfig):
        self.samples, self.batch_size, self.seed, self.cfg = samples, batch_size, seed, cfg

    def batches(self, epoch: int) -> list[list[int]]:
        order = sorted(range(len(self.samples)), key=lambda i: self.samples[i]["input_ids"].shape[0])
        groups = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        random.Random(self.seed + epoch).shuffle(groups)
        return groups

    def load(self, group: list[int], lazy: bool = False) -> Batch:  # lazy: in memory, nothing to defer
        return pad_batch([self.samples[i] for i in group])

    def epoch_batches(self, epoch: int) -> list[Batch]:
        return [self.load(group) for group in self.batches(epoch)]


@dataclass
class TrainedInMemory:
    """A draft trained in memory (``train_on_samples``), with its run and the held-out estimates."""

    run: object  # ``specdraft.run.Run``
    before: object  # ``AcceptanceCounts`` of the fresh draft on the held-out samples
    after: object  # and of the trained one
    history: list[dict]  # sim_tau after each epoch
    seconds: float


def train_on_samples(
    target_dir: str | Path,
    cfg: TrainConfig,
    train: list[dict],
    held_out: list[dict],
    *,
    batch_size: int = 16,
    aux_layers: list[int] | None = None,
    depth: int = 5,
    logger=None,
    progress: bool = False,
) -> TrainedInMemory:
    """Train ``cfg``'s recipe on in-memory samples (``compute_features``; with ``aux_layers`` for an EAGLE-3
    recipe, whose draft vocabulary is counted from ``train`` as the trainer counts it from a store; a block draft
    keeps the target's head unless ``cfg.draft_vocab``), set up by ``build_run`` and trained by ``Run.fit`` as
    every trainer is. The draft is ``result.run.draft``."""
    eagle3 = reads_eagle3_features(cfg)
    vocab = None
    if eagle3:
        assert aux_layers, f"recipe {cfg.recipe!r} reads the EAGLE-3 features: give aux_layers"
    if eagle3 and has_own_vocab(cfg):  # a block draft predicts with the target's head unless asked
        ids = torch.cat([s["input_ids"] for s in train]).numpy()
        mask = torch.cat([s["loss_mask"] for s in train]).numpy()
        offsets = torch.tensor([0] + [len(s["input_ids"]) for s in train]).cumsum(0).numpy()
        vocab_size = load_target_config(target_dir).vocab_size
        counts = count_predicted_tokens(ids, mask, offsets, vocab_size)
        vocab = select_vocab(counts, cfg.draft_vocab_size).tolist()  # as specdraft.run.feature_plan chooses it
    plan = build_plan(cfg, aux_layers=aux_layers if eagle3 else (), vocab=vocab)
    splits = {"train": train, "val": held_out}
    run = build_run(cfg, plan, target_dir, lambda split, reader, aux: SampleSplit(splits[split], batch_size,
                                                                                  1000 * cfg.seed, reader),
                    target_id=target_id(target_dir), logger=logger)
    bar = tqdm(total=run.trainer.total_steps, desc="train", disable=not progress)

    def on_step(run: Run, metrics: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix(stage=run.trainer.state.stage, loss=f"{metrics['loss']:.3f}",
                        tok_s=f"{metrics['tokens_per_s']:.0f}")

    fitted = run.fit(depth, len(held_out), validate=("before", "epoch", "after"), hooks=RunHooks(step=on_step))
    bar.close()
    history = [{"stage": e.stage, "epoch": e.epoch, "sim_tau": e.counts.sim_tau} for e in fitted.epochs]
    return TrainedInMemory(run=run, before=fitted.before, after=fitted.after, history=history, seconds=fitted.loop_s)


def run_quickstart(out: Path, cfg: QuickstartConfig = QuickstartConfig(), progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    target_dir = build_toy_target(out / "target", cfg.toy, progress=progress)
    t_target = time.perf_counter() - t_start

    tokenizer = load_tokenizer(target_dir)
    model = load_target_model(target_dir)
    train_cfg = cfg.train_config()
    aux = resolve_aux_layers(aux_layers_setting(train_cfg, cfg.aux_layers) if reads_eagle3_features(train_cfg) else None,
                             model.config.num_hidden_layers)
    convs = generate_conversations(cfg.num_train + cfg.num_eval, seed=cfg.seed + 1000)
    samples = compute_features(model, tokenizer, convs, cfg.max_length, cfg.topk, progress=progress, aux_layers=aux)
    random.Random(cfg.seed).shuffle(samples)
    train, held_out = samples[cfg.num_eval :], samples[: cfg.num_eval]
    trained = train_on_samples(target_dir, train_cfg, train, held_out, batch_size=cfg.batch_size,
                               aux_layers=aux or None, depth=cfg.depth, logger=JsonlLogger(out / "metrics.jsonl"),
                               progress=progress)
    run, trainer = trained.run, trained.run.trainer
    draft_dir = save_draft(run.draft, out / "draft")
    report = {
        "target": str(target_dir),
        "draft": str(draft_dir),
        "recipe": cfg.recipe,
        "arch": run.arch,
        "aux_layers": aux,
        "stages": [to_dict(s) for s in run.stages],
        "train_samples": len(train),
        "eval_samples": len(held_out),
        "optimizer_steps": trainer.state.step,
        "train_tokens": trainer.state.tokens,
        "train_seconds": round(trained.seconds, 1),
        "target_seconds": round(t_target, 1),
        "sim_alpha_before": [round(a, 4) for a in trained.before.alpha],
        "sim_tau_before": round(trained.before.sim_tau, 4),
        "sim_alpha_after": [round(a, 4) for a in trained.after.alpha],
        "sim_tau_after": round(trained.after.sim_tau, 4),
        "history": trained.history,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
