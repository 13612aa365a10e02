"""One recipe's training on a feature store, measured: time, CPU, memory and held-out acceptance.

The recipe (``specdraft.configs.recipes``) is set up by ``specdraft.run.build_run`` and trained by ``Run.fit`` exactly as
a one-rank Ray Train worker does (minus its checkpoints), in a fresh spawned process, so its peak resident set is
its own; the held-out simulated chain acceptance (alpha_i, sim_tau, as in "Cross-Attention Speculative
Decoding" (Beagle), §5) is measured before, after every epoch and after training. With ``epoch_batches`` every
epoch is the first that many batches of its shuffled order and the LR schedule is sized to them, so recipes
of one and of two stages train the same number of optimizer steps (``benchmarks.real_model``).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from transformers.utils import logging as hf_logging

from benchmarks.host import peak_rss_mb, reset_peak_rss, rss_mb
from specdraft.config import to_dict
from specdraft.epochs import Fitted, RunHooks
from specdraft.models import save_draft
from specdraft.plan import build_plan
from specdraft.run import Run, build_run, feature_plan
from specdraft.store import EpochBatches, FeatureDataset
from specdraft.targets.identity import target_id

SHARED = ("threads", "seed", "epochs", "max_tokens", "lr", "warmup", "schedule", "min_lr_ratio", "noise_std",
          "sim_depth", "val_fraction", "draft_vocab", "block_size", "draft_layers", "anchors")  # every recipe's


def train_config(args: dict[str, Any], recipe: str):
    """The ``ClusterTrainConfig`` of ``recipe`` under the benchmark's shared settings (batches not refitted);
    ``args["init_from"]`` (optional): the draft directory a warm start begins from (``train.init_from``)."""
    from pipelines.configs import ClusterTrainConfig, ScalingSection
    from specdraft.configs.draft import DEFAULT_BLOCK_SIZE
    from specdraft.configs.recipes import RECIPES
    from specdraft.configs.reader import ReaderConfig
    from specdraft.configs.train import OptimConfig

    stages = RECIPES[recipe].stages
    if args["noise_std"] is not None:
        stages = [replace(s, noise_std=args["noise_std"]) for s in stages]
    if args.get("anchors"):
        stages = [replace(s, anchors=args["anchors"]) for s in stages]
    return ClusterTrainConfig(
        recipe=recipe, stages=stages, epochs=args["epochs"],  # the total, split over the stages
        optim=OptimConfig(lr=args["lr"], warmup_steps=args["warmup"], schedule=args["schedule"],
                          min_lr_ratio=args["min_lr_ratio"]),
        reader=ReaderConfig(max_tokens=args["max_tokens"], val_fraction=args["val_fraction"], seed=args["seed"]),
        min_steps=0, seed=args["seed"], checkpoint_every=0, sim_depth=args["sim_depth"],
        val_max_batches=args.get("val_max_batches") or 10**6,  # held-out batches validated (default: all)
        log_every=10**9, scaling=ScalingSection(num_workers=1, cpus_per_worker=1.0),
        **({"draft_vocab_size": args["draft_vocab"]} if args.get("draft_vocab") else {}),
        block_size=args.get("block_size") or DEFAULT_BLOCK_SIZE, draft_layers=args.get("draft_layers"),
        init_from=args.get("init_from") or "",  # a draft directory: warm start (its weights and draft vocabulary)
        precision=args.get("precision") or "auto",  # bf16: autocast on a CPU with avx512_bf16 too
    )


def train_recipe(args: dict[str, Any], recipe: str, store: str, target: str, out: str) -> dict[str, Any]:
    """Train ``recipe`` as a one-rank Ray Train worker would (``build_run``, ``Run.fit``; no checkpoints); measure
    it: the loop's wall and CPU time without its per-epoch validation, the store reads' share, the training loop's
    peak resident set, the held-out acceptance before, after each epoch and after."""
    t_enter = time.perf_counter()
    torch.set_num_threads(args["threads"])
    hf_logging.disable_progress_bar()
    cfg = train_config(args, recipe)
    rss_imports = rss_mb()
    t0 = time.perf_counter()
    run, vocab_plan, per_epoch = set_up(cfg, args, recipe, store, target, out)
    setup_s = time.perf_counter() - t0
    read_s = [0.0]
    memory: dict[str, Any] = {"rss_after_imports_mb": rss_imports}

    class TimedBatches(EpochBatches):
        """The pipeline's lazy epoch batches (the first ``per_epoch``), with the store reads timed."""

        def __len__(self) -> int:
            return min(per_epoch, super().__len__())

        def __getitem__(self, i: int):
            t = time.perf_counter()
            try:
                return super().__getitem__(i)
            finally:
                read_s[0] += time.perf_counter() - t

    def loop_start(_) -> None:  # the peak is the training loop's own, after the validation before it
        memory.update(peak_process_before=peak_rss_mb(), reset_ok=reset_peak_rss(), rss_start=rss_mb())

    fitted = run.fit(cfg.sim_depth, cfg.val_max_batches, validate=("before", "epoch", "after"),
                     batches=lambda epoch: TimedBatches(run.train, epoch),
                     hooks=RunHooks(loop_start=loop_start, loop_end=lambda _: memory.update(peak_train=peak_rss_mb())))
    draft_dir = save_draft(run.draft, out)
    return {**measured(run, fitted, per_epoch, read_s[0], memory), "setup_s": round(setup_s, 2),
            "function_s": round(time.perf_counter() - t_enter, 2), "draft": str(draft_dir), "vocab_plan": vocab_plan}


def set_up(cfg, args: dict[str, Any], recipe: str, store: str, target: str, out: str):
    """(the run of ``cfg`` on ``store`` as a one-rank worker's, the draft vocabulary's record, batches per epoch):
    the pipeline's feature plan and ``build_run``; with ``args["epoch_batches"]`` each epoch its first N batches and
    the trainer's LR schedule sized to them; with ``args["train_samples"]`` (sample ids) the training split is only
    those sequences, and the draft vocabulary is counted on them (the held-out split stays the store's)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    samples = args.get("train_samples")
    aux_layers, vocab = feature_plan(cfg, [store], target, Path(out), samples=samples)  # out/draft_vocab.json
    vocab_file = Path(out) / "draft_vocab.json"  # feature_plan's record (save_draft replaces out's files)
    vocab_plan = ({k: v for k, v in json.loads(vocab_file.read_text()).items() if k != "target_ids"}
                  if vocab_file.is_file() else None)
    plan = build_plan(cfg, aux_layers=aux_layers, vocab=vocab)
    run = build_run(cfg, plan, target, lambda split, reader, aux: FeatureDataset(
        [store], reader, split=split, aux_layers=aux, samples=samples if split == "train" else None),
                    target_id=target_id(target))
    per_epoch = run.batches_per_epoch
    if args.get("epoch_batches"):
        if args["epoch_batches"] > run.batches_per_epoch:
            raise ValueError(f"{recipe}: {args['epoch_batches']} batches per epoch asked, the store gives "
                             f"{run.batches_per_epoch} (fewer steps, more epochs or a smaller max_tokens)")
        per_epoch = args["epoch_batches"]
        run.trainer = replace(run.trainer, batches_per_epoch=per_epoch)  # a fresh optimizer and scheduler for the draft
    return run, vocab_plan, per_epoch


def measured(run: Run, fitted: Fitted, per_epoch: int, data_s: float, memory: dict[str, Any]) -> dict[str, Any]:
    """The record of a trained ``run``: its steps and tokens, the loop's times (per-epoch validation taken out: it
    is not training), memory, the held-out acceptance before, after each epoch and after."""
    train_s, cpu_s = fitted.loop_s - fitted.val_s, fitted.loop_cpu_s - fitted.val_cpu_s
    tokens, steps, val, reset_ok = run.trainer.state.tokens, run.trainer.state.step, run.val, memory["reset_ok"]
    peak_train, rss_start = memory["peak_train"], memory["rss_start"]
    return {
        "recipe": run.plan.recipe, "arch": run.arch, "stages": [to_dict(s) for s in run.stages],
        "epochs": [s.epochs for s in run.stages],
        "train_sequences": len(run.train.sample_ids), "val_sequences": len(val.sample_ids) if val else 0,
        "batches_per_epoch": per_epoch, "store_batches_per_epoch": run.batches_per_epoch, "optimizer_steps": steps,
        "train_tokens": tokens,
        "train_s": round(train_s, 2), "data_s": round(data_s, 2), "tokens_per_s": round(tokens / train_s, 1),
        "tokens_per_s_excl_data": round(tokens / max(1e-9, train_s - data_s), 1),
        "cpu_s": round(cpu_s, 2),  # process CPU time of the loop (all its threads), validation excluded
        "cpu_ms_per_token": round(1e3 * cpu_s / tokens, 4),
        "cpu_share": round(cpu_s / train_s, 3),  # < threads: the host's other load took the rest
        "validation_s": round(fitted.before_s + fitted.val_s, 2),
        "memory": {
            "method": "/proc/self/status VmHWM (= getrusage maxrss) of the spawned training process"
                      + ("; training-loop peak after a clear_refs reset" if reset_ok else "; reset refused"),
            "rss_after_imports_mb": memory["rss_after_imports_mb"], "rss_train_start_mb": rss_start,
            "peak_train_mb": peak_train if reset_ok else None,
            "peak_train_increase_mb": round(peak_train - rss_start, 1) if reset_ok and rss_start else None,
            "peak_process_mb": max(memory["peak_process_before"], peak_train),
        },
        "sim_before": rounded(fitted.before), "sim_after": rounded(fitted.after),
        "history": [{"stage": e.stage, "kind": e.kind, "epoch": e.epoch, "step": e.step,
                     "loss_mean": None if e.loss_mean is None else round(e.loss_mean, 4), **rounded(e.counts)}
                    for e in fitted.epochs],
        "aux_layers": list(run.plan.aux_layers), "draft_vocab_size": None if run.plan.vocab is None else len(run.plan.vocab),
        "draft_layers": run.draft_config.num_layers,
        "trainable_params": sum(p.numel() for p in run.draft.parameters() if p.requires_grad),
        "threads": torch.get_num_threads(),
    }


def rounded(counts) -> dict[str, Any]:
    return {"sim_tau": round(counts.sim_tau, 4), "alpha": [round(a, 4) for a in counts.alpha]}


def train_in_fresh_process(args: dict[str, Any], recipe: str, store: Path, target: Path, out: Path) -> dict[str, Any]:
    """``train_recipe`` in a spawned process of its own (its peak RSS is its own)."""
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        result = pool.submit(train_recipe, args, recipe, str(store), str(target), str(out)).result()
    result["process_s"] = round(time.perf_counter() - started, 2)  # spawn + imports + function
    return result
