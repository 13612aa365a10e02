"""Draft quality per training recipe on one toy feature store (issue 4 item 8).

Trains the recipes of ``pipelines.train.RECIPES`` — EAGLE (``eagle``, one plain stage),
HASS (``hass``, harmonized context alignment), Beagle early stage only (``beagle-early``),
Beagle two-stage (``beagle``), Beagle + top-K distillation (``beagle-topk``, a combination
neither paper tried), and on the EAGLE-3 features (``--aux-layers``, stored beside the last
hidden state in the same store; draft vocabulary built by the pipeline's ``feature_plan``):
EAGLE-3 with training-time test (``eagle3``), EAGLE-3 + HASS alignment (``eagle3-hass``) and
two-stage Beagle over the fused features (``beagle3``) — on the SAME feature store of the toy
target, for the SAME total number
of epochs (a two-stage recipe splits them early/late, the early stage taking the odd one), with
the same optimizer, LR schedule, seed, batches and held-out split. Per recipe it measures:

* held-out simulated chain acceptance (``alpha_i``, ``sim_tau``; no bonus token) before and
  after training, and after every epoch — ``pipelines.train.validate_draft`` on the store's
  ``val`` split (sample-id hash, the same split for every recipe and for the Ray path);
* training wall time (the training loop only: setup and validation passes are timed apart),
  trained tokens/s (loss-mask tokens), the time spent reading batches from the store, CPU
  seconds and CPU ms per trained token (robust to a loaded host), optimizer steps;
* peak memory of the training process: every recipe trains in a fresh spawned process;
  its peak resident set is read from ``/proc/self/status`` VmHWM (= ``getrusage`` maxrss) —
  once for the whole process (imports, store, model) and once for the training loop alone
  (the high-water mark is reset through ``/proc/self/clear_refs`` just before it; falls back
  to the process peak where the kernel refuses the reset). CPU only: no GPU memory;
* real speculative decoding of the toy target with the trained draft
  (``specdraft.decoding.eval.run_eval``): greedy chain and EAGLE-2 tree drafting on held-out
  toy questions (``generate_prompts`` with a seed unlike the training data's, MT-Bench format,
  every user turn), with tau (tokens per target forward, bonus token counted), alpha_i,
  tokens/s, speedup against vanilla decoding and the lossless check (speculative output ==
  vanilla greedy output, token for token). ``--mt-bench N`` adds the first N questions of
  ``/work/shared/data/mt_bench.jsonl`` (the toy target answers those with nonsense).

The per-recipe comparison runs the single-process ``specdraft.training.Trainer`` with exactly
the draft construction, data order and validation of ``pipelines.train.train_loop_per_worker``
(minus its checkpoints), so timings are not dominated by Ray. ``--ray`` additionally trains one
recipe through ``pipelines.train.run_training`` (Ray Train, one worker) and reports the Ray
overhead and how far its draft is from the single-process one.

The toy target is built (or reused) under ``--work``; the store is built there in process from
``specdraft.quickstart.compute_features`` and written with ``specdraft.store.write_shard``.
Wall-clock numbers depend on what else the host runs: the load average is sampled during the
run and recorded.

    python -m benchmarks.train_quality runs/bench/train_quality.json [--epochs 6 --conversations 512 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

RECIPE_ORDER = ("eagle", "hass", "beagle-early", "beagle", "beagle-topk", "eagle3", "eagle3-hass", "beagle3")
MT_BENCH = Path("/work/shared/data/mt_bench.jsonl")


# --- host measurements -------------------------------------------------------------------------


def _status_kb(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (VmRSS, VmHWM), None where unavailable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb() -> float | None:
    kb = _status_kb("VmRSS")
    return None if kb is None else round(kb / 1024, 1)


def peak_rss_mb() -> float:
    """Peak resident set of this process (VmHWM; ``getrusage`` maxrss where /proc is missing)."""
    kb = _status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    return round(kb / 1024, 1)


def reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux ``clear_refs`` 5); False if refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class LoadSampler:
    """Samples the host's 1-minute load average every ``every`` seconds in a thread."""

    def __init__(self, every: float = 2.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> "LoadSampler":
        self.start = os.getloadavg()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = os.getloadavg()

    def summary(self) -> dict[str, Any]:
        s = self.samples or [float("nan")]
        return {
            "cpus": os.cpu_count(),
            "load_1m_min": round(min(s), 2), "load_1m_mean": round(sum(s) / len(s), 2), "load_1m_max": round(max(s), 2),
            "loadavg_start": [round(x, 2) for x in self.start], "loadavg_end": [round(x, 2) for x in self.end],
            "samples": len(self.samples), "sample_every_s": self.every,
            "note": "includes this benchmark's own process (about 1 with --threads 1)",
        }


# --- setup: toy target, feature store, questions -------------------------------------------------


def split_epochs(total: int, stages: int) -> list[int]:
    """``total`` epochs over ``stages`` stages as evenly as possible (earlier stages take the rest)."""
    assert total >= stages, f"{total} epochs cannot cover {stages} stages"
    return [total // stages + (1 if i < total % stages else 0) for i in range(stages)]


def build_store(store: Path, target: Path, conversations: int, seed: int, max_length: int, topk: int,
                samples_per_shard: int, aux_layers: list[int]) -> dict[str, Any]:
    """A Zarr feature store of ``conversations`` toy chats (reused when already built the same way).

    With ``aux_layers`` the store also holds the EAGLE-3 features (``aux_hidden``: the states entering
    those target layers, from the same forward), so every recipe trains from the same store."""
    from specdraft.quickstart import compute_features
    from specdraft.store import make_manifest, read_manifest, write_manifest, write_shard
    from specdraft.target import AUX_CONVENTION, load_target_model, load_tokenizer, target_id
    from specdraft.toy.conversations import generate_conversations

    spec = {"target_id": target_id(target), "conversations": conversations, "seed": seed, "max_length": max_length,
            "topk": topk, "samples_per_shard": samples_per_shard, "aux_layers": aux_layers}
    marker = store / "bench_store.json"
    if marker.is_file() and json.loads(marker.read_text()).get("spec") == spec:
        return {**json.loads(marker.read_text()), "reused": True}
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    started = time.perf_counter()
    model, tokenizer = load_target_model(target), load_tokenizer(target)
    samples = compute_features(model, tokenizer, generate_conversations(conversations, seed=seed), max_length, topk,
                               progress=False, aux_layers=aux_layers)
    # compute_features returns the samples sorted by length; ids number them in that order and the
    # held-out split is by id hash (FeatureDataset), identical for every recipe
    d = samples[0]["hidden"].shape[-1]
    attrs = {"d": d, "k": topk, "hidden_codec": "fp16", **({"aux_layers": aux_layers} if aux_layers else {})}
    records = []
    for index, lo in enumerate(range(0, len(samples), samples_per_shard)):
        part = samples[lo : lo + samples_per_shard]
        lengths = [s["input_ids"].shape[0] for s in part]
        arrays = {
            "input_ids": torch.cat([s["input_ids"] for s in part]).numpy().astype(np.int32),
            "loss_mask": torch.cat([s["loss_mask"] for s in part]).numpy().astype(np.uint8),
            "hidden": torch.cat([s["hidden"] for s in part]).numpy(),
            "topk_ids": torch.cat([s["topk_ids"] for s in part]).numpy().astype(np.int32),
            "topk_logits": torch.cat([s["topk_logp"] for s in part]).numpy().astype(np.float16),
            "logsumexp": np.zeros(sum(lengths), np.float32),  # topk_logits are already log-probs
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "sample_ids": np.array([f"toy-{seed}-{lo + i:06d}" for i in range(len(part))]),
        }
        if aux_layers:
            arrays["aux_hidden"] = torch.cat([s["aux_hidden"] for s in part]).numpy()
        records.append(write_shard(store, index, arrays, attrs))
    header = {"target_id": spec["target_id"], **attrs, **({"aux_convention": AUX_CONVENTION} if aux_layers else {})}
    write_manifest(store, make_manifest(header=header, shards=records))
    totals = read_manifest(store)["totals"]
    info = {"spec": spec, "seconds": round(time.perf_counter() - started, 1),
            "sequences": totals["sequences"], "tokens": totals["tokens"], "loss_tokens": totals["loss_tokens"],
            "bytes": totals["bytes"]}
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return {**info, "reused": False}


def write_toy_questions(path: Path, n: int, seed: int, max_turns: int | None) -> Path:
    """Held-out toy prompts as MT-Bench-format rows (every user turn; system prompts dropped)."""
    from specdraft.toy.conversations import generate_prompts

    rows = []
    for i, conv in enumerate(generate_prompts(n, seed)):
        users = [m["content"] for m in conv if m["role"] == "user"]
        rows.append({"question_id": i, "category": "toy", "turns": users[:max_turns] if max_turns else users})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def question_overlap(questions: Path, conversations: int, seed: int) -> int:
    """How many held-out questions open with a first user turn that also opens a chat of the store."""
    from specdraft.toy.conversations import generate_conversations

    firsts = {next(m["content"] for m in c if m["role"] == "user") for c in generate_conversations(conversations, seed)}
    rows = [json.loads(x) for x in questions.read_text().splitlines() if x.strip()]
    return sum(r["turns"][0] in firsts for r in rows)


def write_mt_bench(path: Path, source: Path, n: int, max_turns: int | None) -> Path:
    rows = [json.loads(x) for x in source.read_text().splitlines() if x.strip()][:n]
    for r in rows:
        r["turns"] = r["turns"][:max_turns] if max_turns else r["turns"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- one recipe, in its own process ----------------------------------------------------------------


def train_config(args: dict[str, Any], recipe: str):
    """The ``TrainConfig`` of ``recipe`` under the benchmark's shared settings (same for every recipe)."""
    from dataclasses import replace

    from specdraft.recipes import RECIPES, ScalingSection, TrainConfig
    from specdraft.store import ReaderConfig
    from specdraft.training import OptimConfig

    stages = RECIPES[recipe].stages
    if args["noise_std"] is not None:
        stages = [replace(s, noise_std=args["noise_std"]) for s in stages]
    return TrainConfig(
        recipe=recipe,
        stages=stages,
        epochs=split_epochs(args["epochs"], len(stages)),
        optim=OptimConfig(lr=args["lr"], warmup_steps=args["warmup"], schedule=args["schedule"],
                          min_lr_ratio=args["min_lr_ratio"]),
        reader=ReaderConfig(max_tokens=args["max_tokens"], val_fraction=args["val_fraction"], seed=args["seed"]),
        seed=args["seed"],
        checkpoint_every=0,
        sim_depth=args["sim_depth"],
        val_max_batches=10**6,
        log_every=10**9,
        scaling=ScalingSection(num_workers=1, cpus_per_worker=1.0),
        **({"draft_vocab_size": args["draft_vocab"]} if args.get("draft_vocab") else {}),
    )


def train_recipe(args: dict[str, Any], recipe: str, store: str, target: str, out: str) -> dict[str, Any]:
    """Train ``recipe`` like ``train_loop_per_worker`` does (one rank, no checkpoints); measure it."""
    from dataclasses import replace

    t_enter = time.perf_counter()
    torch.set_num_threads(args["threads"])
    from transformers.utils import logging as hf_logging

    from specdraft.run import feature_plan, validate_draft
    from specdraft.config import to_dict
    from specdraft.models import build_draft, draft_config_from_target, save_draft
    from specdraft.store import EpochBatches, FeatureDataset
    from specdraft.target import load_target_config, load_target_heads, target_id
    from specdraft.training import Trainer

    hf_logging.disable_progress_bar()
    cfg = train_config(args, recipe)
    arch, stages = cfg.resolved()
    rss_imports = rss_mb()

    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    heads = load_target_heads(target)
    # the pipeline's own choice of aux layers and draft vocabulary (written to out/draft_vocab.json)
    Path(out).mkdir(parents=True, exist_ok=True)
    aux_layers, vocab_ids = feature_plan(cfg, [store], target, Path(out))
    vocab = torch.tensor(vocab_ids) if vocab_ids is not None else None
    dcfg = draft_config_from_target(load_target_config(target), arch, intermediate_size=cfg.intermediate_size,
                                    target_id=target_id(target), aux_layers=aux_layers or None,
                                    draft_vocab_size=None if vocab is None else vocab.numel())
    draft = build_draft(dcfg, heads.embed, heads.lm_head, vocab=vocab)
    reader = replace(cfg.reader, aux=bool(aux_layers))
    train_ds = FeatureDataset([store], reader, split="train")
    val_ds = FeatureDataset([store], reader, split="val")
    per_epoch = len(train_ds.batches(0))
    trainer = Trainer(draft, stages, cfg.optim, per_epoch, seed=cfg.seed)
    setup_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    before = validate_draft(draft, val_ds, cfg.sim_depth, cfg.val_max_batches, "cpu")
    initial_val_s = time.perf_counter() - t0

    epoch_offsets = [sum(s.epochs for s in stages[:i]) for i in range(len(stages))]
    timers = {"data_s": 0.0, "val_s": 0.0, "val_cpu_s": 0.0}
    losses: list[float] = []
    history: list[dict[str, Any]] = []
    epoch_start = [0]

    class TimedBatches(EpochBatches):
        """The pipeline's lazy epoch batches, with the store reads timed."""

        def __getitem__(self, i: int):
            t = time.perf_counter()
            try:
                return super().__getitem__(i)
            finally:
                timers["data_s"] += time.perf_counter() - t

    def on_step(tr: Trainer, metrics: dict[str, float]) -> None:
        losses.append(metrics["loss"])

    def on_epoch_end(tr: Trainer) -> None:
        t, c = time.perf_counter(), time.process_time()
        counts = validate_draft(tr.draft, val_ds, cfg.sim_depth, cfg.val_max_batches, "cpu")
        stage = stages[tr.state.stage]
        history.append({
            "stage": tr.state.stage, "kind": stage.kind, "epoch": tr.state.epoch, "step": tr.state.step,
            "loss_mean": round(float(np.mean(losses[epoch_start[0]:])), 4) if len(losses) > epoch_start[0] else None,
            "sim_tau": round(counts.sim_tau, 4), "alpha": [round(a, 4) for a in counts.alpha],
        })
        epoch_start[0] = len(losses)
        timers["val_s"] += time.perf_counter() - t
        timers["val_cpu_s"] += time.process_time() - c

    peak_process_before = peak_rss_mb()
    reset_ok = reset_peak_rss()
    rss_start = rss_mb()
    t0, cpu0 = time.perf_counter(), time.process_time()
    trainer.run(lambda stage, epoch: TimedBatches(train_ds, epoch_offsets[stage] + epoch),
                on_step=on_step, on_epoch_end=on_epoch_end)
    loop_s, loop_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    peak_train = peak_rss_mb()
    # the per-epoch validation passes run inside the loop (on_epoch_end): they are not training
    train_s, cpu_s = loop_s - timers["val_s"], loop_cpu_s - timers["val_cpu_s"]
    tokens, steps = trainer.state.tokens, trainer.state.step
    after = validate_draft(draft, val_ds, cfg.sim_depth, cfg.val_max_batches, "cpu")
    draft_dir = save_draft(draft, out)
    return {
        "recipe": recipe,
        "arch": arch,
        "stages": [to_dict(s) for s in stages],
        "epochs": [s.epochs for s in stages],
        "train_sequences": len(train_ds.sample_ids),
        "val_sequences": len(val_ds.sample_ids),
        "batches_per_epoch": per_epoch,
        "optimizer_steps": steps,
        "train_tokens": tokens,
        "train_s": round(train_s, 2),
        "data_s": round(timers["data_s"], 2),
        "tokens_per_s": round(tokens / train_s, 1),
        "tokens_per_s_excl_data": round(tokens / max(1e-9, train_s - timers["data_s"]), 1),
        "cpu_s": round(cpu_s, 2),  # process CPU time of the loop (all its threads), validation excluded
        "cpu_ms_per_token": round(1e3 * cpu_s / tokens, 4),
        "cpu_share": round(cpu_s / train_s, 3),  # < threads: the host's other load took the rest
        "setup_s": round(setup_s, 2),
        "validation_s": round(initial_val_s + timers["val_s"], 2),
        "function_s": round(time.perf_counter() - t_enter, 2),
        "memory": {
            "method": "/proc/self/status VmHWM (= getrusage maxrss) of the spawned training process"
                      + ("; training-loop peak after a clear_refs reset" if reset_ok else "; reset refused"),
            "rss_after_imports_mb": rss_imports,
            "rss_train_start_mb": rss_start,
            "peak_train_mb": peak_train if reset_ok else None,
            "peak_train_increase_mb": round(peak_train - rss_start, 1) if reset_ok and rss_start else None,
            "peak_process_mb": max(peak_process_before, peak_train),
        },
        "sim_before": {"sim_tau": round(before.sim_tau, 4), "alpha": [round(a, 4) for a in before.alpha]},
        "sim_after": {"sim_tau": round(after.sim_tau, 4), "alpha": [round(a, 4) for a in after.alpha]},
        "history": history,
        "draft": str(draft_dir),
        "aux_layers": aux_layers,
        "draft_vocab_size": None if vocab is None else int(vocab.numel()),
        "threads": torch.get_num_threads(),
    }


def train_in_fresh_process(args: dict[str, Any], recipe: str, store: Path, target: Path, out: Path) -> dict[str, Any]:
    """``train_recipe`` in a spawned process of its own (its peak RSS is its own)."""
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        result = pool.submit(train_recipe, args, recipe, str(store), str(target), str(out)).result()
    result["process_s"] = round(time.perf_counter() - started, 2)  # spawn + imports + function
    return result


# --- decoding evaluation -----------------------------------------------------------------------------


def bootstrap_tau(records: list[dict[str, Any]], samples: int = 2000, seed: int = 0) -> list[float] | None:
    """95% interval of tau = sum(round_tokens) / sum(rounds), questions resampled with replacement."""
    per_question: dict[int, list[int]] = {}
    for r in records:
        acc = per_question.setdefault(r["index"], [0, 0])
        acc[0] += r["round_tokens"]
        acc[1] += r["rounds"]
    if not per_question:
        return None
    totals = np.array(list(per_question.values()), dtype=np.float64)  # (Q, 2)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(totals), size=(samples, len(totals)))  # (samples, Q)
    sums = totals[picks].sum(axis=1)  # (samples, 2)
    taus = sums[:, 0] / np.maximum(sums[:, 1], 1)
    return [round(float(x), 3) for x in np.percentile(taus, [2.5, 97.5])]


def decode_eval(target: Path, draft: Path, files: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    """Greedy chain and tree speculative decoding of every question file; per dataset and mode."""
    from specdraft.decoding import DecodeConfig
    from specdraft.decoding.eval import EvalSettings, run_eval

    modes = {
        "chain": DecodeConfig(mode="chain", gamma=args.gamma, max_new_tokens=args.max_new_tokens),
        "tree": DecodeConfig(mode="tree", depth=args.tree_depth, topk=args.tree_topk, total_tokens=args.total_tokens,
                             max_new_tokens=args.max_new_tokens),
    }
    out: dict[str, Any] = {}
    for mode, decode in modes.items():
        started = time.perf_counter()
        report = run_eval(target, draft, files, EvalSettings(decode=decode, device="cpu", seed=args.seed),
                          progress=False)
        for name, block in report["datasets"].items():
            entry = {k: v for k, v in block.items() if k != "turns"}
            entry["tau_per_turn"] = {t: b["tau"] for t, b in block["turns"].items()}
            entry["tau_ci95"] = bootstrap_tau([r for r in report["records"] if r["dataset"] == name], seed=args.seed)
            out.setdefault(name, {})[mode] = entry
        for name in report["datasets"]:
            out[name][mode]["eval_run_s"] = round(time.perf_counter() - started, 2)
    return out


# --- optional: the same training through Ray Train ----------------------------------------------------


def ray_run(args: argparse.Namespace, shared: dict[str, Any], store: Path, target: Path, work: Path,
            single: dict[str, Any] | None) -> dict[str, Any]:
    """One recipe through ``pipelines.train.run_training`` (one worker): Ray overhead and agreement."""
    import ray

    from pipelines.train import run_training
    from specdraft.run import validate_draft
    from specdraft.models import load_draft
    from specdraft.store import FeatureDataset

    cfg = train_config(shared, args.ray_recipe)
    out = work / f"ray-{args.ray_recipe}"
    shutil.rmtree(out, ignore_errors=True)  # the same out would resume, not train
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    init_s = time.perf_counter() - started
    t0 = time.perf_counter()
    summary = run_training(cfg, [store], target, out)
    fit_s = time.perf_counter() - t0
    ray.shutdown()
    draft = load_draft(summary["draft"], target=target)
    val = FeatureDataset([store], cfg.reader, split="val")
    counts = validate_draft(draft, val, cfg.sim_depth, 10**6, "cpu")
    result = {
        "recipe": args.ray_recipe,
        "ray_init_s": round(init_s, 2),
        "run_training_s": round(fit_s, 2),
        "optimizer_steps": summary["metrics"].get("state_step"),
        "train_tokens": summary["metrics"].get("state_tokens"),
        "sim_tau": round(counts.sim_tau, 4),
        "alpha": [round(a, 4) for a in counts.alpha],
        "note": "run_training also writes a checkpoint (draft + optimizer state) at every epoch end",
    }
    if single is not None:
        reference = load_draft(single["draft"], target=target)
        diff = max(float((a - b).abs().max()) for a, b in zip(draft.state_dict().values(),
                                                               reference.state_dict().values()))
        result.update({
            "single_process_function_s": single["function_s"],
            "single_process_total_s": single["process_s"],
            "overhead_vs_function_s": round(init_s + fit_s - single["function_s"], 2),
            "overhead_vs_process_s": round(init_s + fit_s - single["process_s"], 2),
            "max_abs_param_diff_vs_single_process": diff,
        })
    return result


# --- report ------------------------------------------------------------------------------------------------


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict[str, Any]) -> None:
    rows = result["recipes"]
    datasets = list(next(iter(rows.values())).get("decode", {}))
    head = (f"{'recipe':12s} {'stages(ep)':14s} {'steps':>5s} {'train s':>7s} {'data s':>6s} {'tok/s':>6s} "
            f"{'cpu ms/tok':>10s} "
            f"{'peak MB':>7s} {'sim_tau':>13s} {'sim alpha_1..3':>17s}")
    for name in datasets:
        head += f" | {name[:9] + ' chain':>15s} {'tree':>5s} {'pld':>5s} {'lossless':>8s}"
    print(head)
    print("-" * len(head))
    for recipe, r in rows.items():
        stages = "+".join(f"{s['kind']}{s['epochs']}" for s in r["stages"])
        alpha = "/".join(f"{a:.2f}" for a in r["sim_after"]["alpha"][:3])
        peak = r["memory"]["peak_train_mb"] or r["memory"]["peak_process_mb"]
        line = (f"{recipe:12s} {stages:14s} {r['optimizer_steps']:5d} {r['train_s']:7.1f} {r['data_s']:6.1f} "
                f"{r['tokens_per_s']:6.0f} "
                f"{r['cpu_ms_per_token']:10.3f} {peak:7.0f} "
                f"{r['sim_before']['sim_tau']:5.2f}->{r['sim_after']['sim_tau']:5.2f}  {alpha:>17s}")
        for name in datasets:
            d = r["decode"][name]
            ok = sum(d[m]["lossless_checked"] - d[m]["lossless_mismatches"] for m in d)
            checked = sum(d[m]["lossless_checked"] for m in d)
            line += (f" | {_fmt(d['chain']['tau']):>15s} {_fmt(d['tree']['tau']):>5s} "
                     f"{_fmt(d['chain'].get('tau_pld')):>5s} {f'{ok}/{checked}':>8s}")
        print(line)
    print("train s: training loop without validation (data s: store reads within it); tok/s: loss-mask tokens; "
          "sim_tau: simulated greedy chain on held-out features, no bonus token; decode tau: tokens per target "
          "forward (bonus counted); pld: training-free prompt-lookup tau on the same questions (the floor); peak MB: "
          "training-loop peak RSS of the training process")
    for name in datasets:
        speed = {rec: (r["decode"][name]["chain"]["speedup"], r["decode"][name]["tree"]["speedup"])
                 for rec, r in rows.items()}
        print(f"{name} speedup vs vanilla (chain, tree): "
              + ", ".join(f"{k} {_fmt(a)}x/{_fmt(b)}x" for k, (a, b) in speed.items()))
        ci = {rec: (r["decode"][name]["chain"]["tau_ci95"], r["decode"][name]["tree"]["tau_ci95"]) for rec, r in rows.items()}
        print(f"{name} tau 95% bootstrap interval over questions (chain; tree): "
              + ", ".join(f"{k} {a}; {b}" for k, (a, b) in ci.items()))
    load = result["host"]["load"]
    print(f"load avg (1m) during run: min {load['load_1m_min']} mean {load['load_1m_mean']} max {load['load_1m_max']}"
          f" on {load['cpus']} CPUs; total {result['total_s']:.0f} s")
    if "ray" in result:
        r = result["ray"]
        print(f"ray ({r['recipe']}): init {r['ray_init_s']} s + run_training {r['run_training_s']} s; "
              f"overhead vs single process {r.get('overhead_vs_function_s')} s; sim_tau {r['sim_tau']}; "
              f"max |param diff| {r.get('max_abs_param_diff_vs_single_process')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON result path")
    ap.add_argument("--work", default="runs/bench-train-quality", help="toy target, store, drafts and questions")
    ap.add_argument("--recipes", default=",".join(RECIPE_ORDER), help="comma-separated subset of the recipes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (training processes and decoding)")
    ap.add_argument("--seed", type=int, default=0)
    # toy target
    ap.add_argument("--toy-steps", type=int, default=150, help="toy target training steps")
    ap.add_argument("--toy-batch", type=int, default=16)
    ap.add_argument("--toy-conversations", type=int, default=4000)
    ap.add_argument("--toy-hidden", type=int, default=128)
    ap.add_argument("--toy-layers", type=int, default=4)
    # features and training
    ap.add_argument("--conversations", type=int, default=512, help="toy chats in the feature store")
    ap.add_argument("--data-seed", type=int, default=1000, help="generate_conversations seed of the store")
    ap.add_argument("--val-fraction", type=float, default=0.15, help="held-out share of the store (by sample-id hash)")
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--topk", type=int, default=10, help="stored top-K")
    ap.add_argument("--aux-layers", default="1,2,3", help="EAGLE-3 features: HF hidden_states indices (the toy "
                    "target has too few layers for the default triple 2, N/2, N-3); empty: none")
    ap.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary of the EAGLE-3 recipes "
                    "(default: the pipeline's, capped by the target's vocabulary)")
    ap.add_argument("--samples-per-shard", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=6, help="total epochs per recipe (two-stage: split early/late)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per batch")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20, help="warmup optimizer steps")
    ap.add_argument("--schedule", default="cosine", choices=("constant", "cosine", "linear"))
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--noise-std", type=float, default=None, help="override every recipe's input noise")
    ap.add_argument("--sim-depth", type=int, default=5)
    # decoding
    ap.add_argument("--prompts", type=int, default=16, help="held-out toy questions")
    ap.add_argument("--prompt-seed", type=int, default=4242, help="generate_prompts seed (not --data-seed)")
    ap.add_argument("--max-turns", type=int, default=None, help="user turns per question (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4, help="chain draft length")
    ap.add_argument("--tree-depth", type=int, default=6)
    ap.add_argument("--tree-topk", type=int, default=10)
    ap.add_argument("--total-tokens", type=int, default=60)
    ap.add_argument("--mt-bench", type=int, default=0, metavar="N", help="also decode the first N MT-Bench questions")
    ap.add_argument("--mt-bench-path", default=str(MT_BENCH))
    ap.add_argument("--skip-decode", action="store_true", help="no speculative decoding evaluation")
    # ray
    ap.add_argument("--ray", action="store_true", help="also train one recipe through run_training (Ray Train)")
    ap.add_argument("--ray-recipe", default="beagle")
    args = ap.parse_args(argv)

    from specdraft.recipes import RECIPES
    from specdraft.toy.build import ToyTargetConfig, build_toy_target, read_build_record

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = sorted(set(recipes) - set(RECIPES))
    assert not unknown, f"unknown recipes {unknown}; known: {sorted(RECIPES)}"
    for r in recipes:
        assert args.epochs >= len(RECIPES[r].stages), f"--epochs {args.epochs} is fewer than {r}'s stages"
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    phases: dict[str, float] = {}

    with LoadSampler() as load:
        t0 = time.perf_counter()
        toy = ToyTargetConfig(seed=args.seed, num_conversations=args.toy_conversations, train_steps=args.toy_steps,
                              batch_size=args.toy_batch, hidden_size=args.toy_hidden, num_layers=args.toy_layers,
                              num_threads=args.threads)
        target = build_toy_target(work / "target", toy, progress=False)
        phases["toy_target_s"] = round(time.perf_counter() - t0, 1)
        record = read_build_record(target)

        t0 = time.perf_counter()
        store = work / "store"
        aux_layers = [int(x) for x in args.aux_layers.split(",") if x.strip()]
        store_info = build_store(store, target, args.conversations, args.data_seed, args.max_length, args.topk,
                                 args.samples_per_shard, aux_layers)
        phases["store_s"] = round(time.perf_counter() - t0, 1)

        files = [write_toy_questions(work / "questions" / "toy.jsonl", args.prompts, args.prompt_seed, args.max_turns)]
        overlap = question_overlap(files[0], args.conversations, args.data_seed)
        mt_note = None
        if args.mt_bench:
            if Path(args.mt_bench_path).is_file():
                files.append(write_mt_bench(work / "questions" / "mt_bench.jsonl", Path(args.mt_bench_path),
                                            args.mt_bench, args.max_turns))
            else:
                mt_note = f"{args.mt_bench_path} not found: skipped"

        shared = {k: getattr(args, k) for k in ("threads", "seed", "epochs", "max_tokens", "lr", "warmup", "schedule",
                                                 "min_lr_ratio", "noise_std", "sim_depth", "val_fraction",
                                                 "draft_vocab")}
        results: dict[str, Any] = {}
        t0 = time.perf_counter()
        for recipe in recipes:
            print(f"[train_quality] training {recipe} ...", file=sys.stderr, flush=True)
            results[recipe] = train_in_fresh_process(shared, recipe, store, target, work / "drafts" / recipe)
            r = results[recipe]
            print(f"[train_quality]   {r['optimizer_steps']} steps, {r['train_s']} s, sim_tau "
                  f"{r['sim_before']['sim_tau']} -> {r['sim_after']['sim_tau']}", file=sys.stderr, flush=True)
        phases["training_s"] = round(time.perf_counter() - t0, 1)

        if not args.skip_decode:
            t0 = time.perf_counter()
            for recipe in recipes:
                print(f"[train_quality] decoding with {recipe} ...", file=sys.stderr, flush=True)
                results[recipe]["decode"] = decode_eval(target, Path(results[recipe]["draft"]), files, args)
            phases["decoding_s"] = round(time.perf_counter() - t0, 1)

        ray_result = None
        if args.ray:
            t0 = time.perf_counter()
            print(f"[train_quality] ray run of {args.ray_recipe} ...", file=sys.stderr, flush=True)
            ray_result = ray_run(args, shared, store, target, work, results.get(args.ray_recipe))
            phases["ray_s"] = round(time.perf_counter() - t0, 1)

    result = {
        "benchmark": "train_quality",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "optimizer": {"lr": args.lr, "warmup_steps": args.warmup, "schedule": args.schedule,
                      "min_lr_ratio": args.min_lr_ratio, "note": "the same for every recipe; betas, grad clip: "
                      "specdraft.training.OptimConfig defaults"},
        "target": {"dir": str(target), "config_hash": record["config_hash"], "num_parameters": record["num_parameters"],
                   "eval_loss": record["eval_loss"], "build_s": record["wall_time_s"]},
        "store": {"dir": str(store), **store_info},
        "questions": {"files": [str(f) for f in files], "toy_prompt_seed": args.prompt_seed,
                      "toy_first_turn_also_in_store": overlap, "mt_bench": mt_note or (args.mt_bench or None)},
        "recipes": results,
        "host": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                 "threads": args.threads, "device": "cpu", "load": load.summary()},
        "phases": phases,
        "total_s": round(time.perf_counter() - started, 1),
    }
    if ray_result is not None:
        result["ray"] = ray_result
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
