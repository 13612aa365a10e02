"""A laptop-sized end-to-end run of the core: toy target -> features -> two-stage draft training.

Builds (or reuses) the toy target, renders synthetic conversations with its chat
template, computes the target's last hidden states and top-K log-probs in memory,
trains a draft on the configured stage schedule (default: Beagle early stage, k=5, then
late stage, s=4 — Beagle §4.2), and reports the simulated chain acceptance (alpha_i,
sim_tau) on held-out conversations before and after training. The full pipeline (Zarr
store, Ray, Prefect, MLflow) runs the same pieces at scale.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from specdraft.acceptance import AcceptanceCounts, simulated_acceptance
from specdraft.config import to_dict
from specdraft.features import compute_features
from specdraft.loggers import JsonlLogger
from specdraft.models import build_draft, draft_config_from_target, save_draft
from specdraft.batch import pad_batch
from specdraft.objectives import LossWeights, StageConfig
from specdraft.target import load_target_config, load_target_heads, load_target_model, load_tokenizer
from specdraft.toy.build import ToyTargetConfig, build_toy_target
from specdraft.toy.conversations import generate_conversations
from specdraft.training import OptimConfig, Trainer


def _default_stages() -> list[StageConfig]:
    loss = LossWeights(ce=1.0, vloss=1.0)
    return [
        StageConfig(kind="early", epochs=3, window=5, noise_std=0.05, loss=loss),
        StageConfig(kind="late", epochs=2, steps=4, noise_std=0.05, loss=loss),
    ]


@dataclass(frozen=True, kw_only=True, slots=True)
class QuickstartConfig:
    seed: int = 0
    toy: ToyTargetConfig = field(default_factory=ToyTargetConfig)
    arch: Literal["beagle", "eagle"] = "beagle"
    num_train: int = 768
    num_eval: int = 96
    max_length: int = 192
    topk: int = 10
    batch_size: int = 16
    depth: int = 5  # simulated chain depth for alpha_i
    stages: list[StageConfig] = field(default_factory=_default_stages)
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=2e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1)
    )


def batches_of(samples, batch_size: int, seed: int):
    """Length-bucketed batches in a seeded order (fixed for a given seed)."""
    order = sorted(range(len(samples)), key=lambda i: samples[i]["input_ids"].shape[0])
    groups = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    random.Random(seed).shuffle(groups)
    return [pad_batch([samples[i] for i in g]) for g in groups]


def evaluate(draft, batches, depth: int) -> AcceptanceCounts:
    counts = AcceptanceCounts.zeros(depth)
    draft.eval()
    for batch in batches:
        counts.add(simulated_acceptance(draft, batch, depth))
    draft.train()
    return counts


def run_quickstart(out: Path, cfg: QuickstartConfig = QuickstartConfig(), progress: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    target_dir = build_toy_target(out / "target", cfg.toy, progress=progress)
    t_target = time.perf_counter() - t_start

    tokenizer = load_tokenizer(target_dir)
    model = load_target_model(target_dir)
    convs = generate_conversations(cfg.num_train + cfg.num_eval, seed=cfg.seed + 1000)
    samples = compute_features(model, tokenizer, convs, cfg.max_length, cfg.topk, progress=progress)
    random.Random(cfg.seed).shuffle(samples)
    train, held_out = samples[cfg.num_eval :], samples[: cfg.num_eval]
    eval_batches = batches_of(held_out, cfg.batch_size, cfg.seed)

    heads = load_target_heads(target_dir)
    draft_cfg = draft_config_from_target(load_target_config(target_dir), cfg.arch, target_id=str(target_dir))
    draft = build_draft(draft_cfg, heads.embed, heads.lm_head)
    before = evaluate(draft, eval_batches, cfg.depth)

    n_batches = -(-len(train) // cfg.batch_size)  # batches_of groups fixed-size runs
    trainer = Trainer(
        draft, list(cfg.stages), cfg.optim, n_batches, seed=cfg.seed, logger=JsonlLogger(out / "metrics.jsonl")
    )
    bar = tqdm(total=trainer.total_steps, desc="train", disable=not progress)
    history: list[dict] = []

    def on_step(tr: Trainer, metrics: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix(stage=tr.state.stage, loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")

    def on_epoch_end(tr: Trainer) -> None:
        counts = evaluate(tr.draft, eval_batches, cfg.depth)
        history.append({"stage": tr.state.stage, "epoch": tr.state.epoch, "sim_tau": counts.sim_tau})
        tr.logger.log_metrics({"sim_tau": counts.sim_tau}, tr.state.step)

    t_train0 = time.perf_counter()
    trainer.run(lambda stage, epoch: batches_of(train, cfg.batch_size, cfg.seed * 1000 + 100 * stage + epoch),
                on_step=on_step, on_epoch_end=on_epoch_end)
    bar.close()
    train_s = time.perf_counter() - t_train0
    after = evaluate(draft, eval_batches, cfg.depth)
    draft_dir = save_draft(draft, out / "draft")
    report = {
        "target": str(target_dir),
        "draft": str(draft_dir),
        "arch": cfg.arch,
        "stages": [to_dict(s) for s in cfg.stages],
        "train_samples": len(train),
        "eval_samples": len(held_out),
        "optimizer_steps": trainer.state.step,
        "train_tokens": trainer.state.tokens,
        "train_seconds": round(train_s, 1),
        "target_seconds": round(t_target, 1),
        "sim_alpha_before": [round(a, 4) for a in before.alpha],
        "sim_tau_before": round(before.sim_tau, 4),
        "sim_alpha_after": [round(a, 4) for a in after.alpha],
        "sim_tau_after": round(after.sim_tau, 4),
        "history": history,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
