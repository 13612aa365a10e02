"""Recipes on a real target, judged by vLLM beside its own prompt lookup (issue 32 item 4).

Given a target and a feature store dumped with the EAGLE-3 aux layers (``specdraft dump ... aux_layers=eagle3``),
or a finished ``specdraft run`` workdir to find the store in, every recipe (default ``beagle3``, ``eagle3``,
``hass``, ``dflash``) trains on that store for the SAME number of optimizer steps (``--steps`` over ``--epochs``:
each epoch the first steps/epochs batches of its shuffled order, the LR schedule sized to them;
``benchmarks.recipe_training``, a spawned process per recipe as a one-rank Ray Train worker sets it up). Per recipe:

* training: wall time (validation apart), trained tokens/s, held-out simulated acceptance before and after;
* our decoder (``specdraft.evaluation.run_eval`` via ``benchmarks.speculative.decode_eval``): greedy chain of
  K = 3 and K = 5 and the EAGLE-2 dynamic tree ("EAGLE-2: Faster Inference of Language Models with Dynamic
  Draft Trees", §4), τ per held-out question set beside our prompt-lookup floor τ_pld;
* vLLM (``specdraft.evaluation.engine``, ``benchmarks.speculative.engine_acceptance``): every draft exported in
  its vLLM format and served on the same prompts at K = 3 and K = 5 — mean acceptance length, tokens/s with and
  without the draft (the engine's speedup) — beside vLLM's own ``ngram`` prompt lookup (the floor).

The question sets are held out from training (MT-Bench and HumanEval prompts, never ShareGPT): any file
``specdraft ingest`` reads (MT-Bench rows, HumanEval ``{"task_id", "prompt"}``), the first ``--max-questions``
of each, written as MT-Bench-format files under ``--work``. One JSON holds every number, the settings, the
store's size and the machine (CPU, memory, versions, the load average sampled throughout); a table is printed.

    python -m benchmarks.real_model --target T (--store S | --run WORKDIR) [--steps 20 --epochs 2]
        [--questions configs/data/mt_bench.jsonl ../shared/data/humaneval.jsonl] [--max-questions 5]
        [--max-new-tokens 64] [--out benchmarks/results/real_model_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.host import write_result
from specdraft.limits import LoadSampler
from benchmarks.recipe_training import SHARED, train_in_fresh_process

ROOT = Path(__file__).resolve().parents[1]
RECIPES = "beagle3,eagle3,hass,dflash"


def find_store(run: Path) -> Path:
    """The finished feature store of a ``specdraft run`` workdir holding the EAGLE-3 features (the newest one)."""
    from specdraft.store import read_manifest

    stores = [d for d in sorted((run / "features").glob("*")) if (d / "DONE").is_file()
              and read_manifest(d).get("aux_layers")]
    if not stores:
        raise SystemExit(f"{run}/features: no finished store with the EAGLE-3 aux layers (dump with aux_layers=eagle3)")
    return max(stores, key=lambda d: (d / "DONE").stat().st_mtime)


def write_question_sets(files: list[Path], out: Path, n: int) -> list[Path]:
    """The first ``n`` questions of each file as an MT-Bench-format file under ``out`` (named by the source's stem):
    the user turns of each record as ``pipelines.ingest`` reads it (MT-Bench, HumanEval, chat rows)."""
    from pipelines.ingest import Reject, normalize_record

    written = []
    for path in files:
        text = path.read_text()
        records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines()
                                                                           if x.strip()]
        rows = []
        for i, record in enumerate(records):
            try:
                messages, source_id, _ = normalize_record(record)
            except Reject:
                continue
            turns = [m["content"] for m in messages if m["role"] == "user"]
            if turns:
                rows.append({"question_id": record.get("question_id", source_id or i),
                             "category": record.get("category", path.stem), "turns": turns})
            if len(rows) == n:
                break
        target = out / f"{path.stem}.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(json.dumps(r) + "\n" for r in rows))
        written.append(target)
    return written


def target_facts(target: Path) -> dict[str, Any]:
    from specdraft.targets.identity import target_id
    from specdraft.targets.loading import load_target_config

    cfg = load_target_config(target)
    return {"dir": str(target), "target_id": target_id(target), "model_type": cfg.model_type,
            "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings}


def store_facts(store: Path) -> dict[str, Any]:
    from specdraft.store import read_manifest

    manifest = read_manifest(store)
    return {"dir": str(store), "sequences": manifest["totals"]["sequences"], "tokens": manifest["totals"]["tokens"],
            "loss_tokens": manifest["totals"]["loss_tokens"], "aux_layers": manifest.get("aux_layers"),
            "target_id": manifest.get("target_id"), "bytes": manifest["totals"]["bytes"]}


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """A benchmark's command-line settings as JSON values (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if k == "questions" else v)
            for k, v in vars(args).items()}


def question_counts(files: list[Path]) -> dict[str, int]:
    """Questions per written question file (by its stem)."""
    return {f.stem: sum(1 for x in f.read_text().splitlines() if x.strip()) for f in files}


def decode_modes(args: argparse.Namespace) -> dict[str, Any]:
    from specdraft.configs.decode import DecodeConfig

    modes = {f"chain{k}": DecodeConfig(mode="chain", gamma=k, max_new_tokens=args.max_new_tokens) for k in args.k}
    modes["tree"] = DecodeConfig(mode="tree", depth=args.tree_depth, topk=args.tree_topk,
                                 total_tokens=args.total_tokens, max_new_tokens=args.max_new_tokens)
    return modes


def add_inputs(ap: argparse.ArgumentParser) -> None:
    """The target and its EAGLE-3 store (or the run workdir holding it): the options of this and the peer's arm."""
    ap.add_argument("--target", required=True, type=Path, help="the target model directory")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--store", type=Path, help="a feature store dumped with aux_layers=eagle3")
    source.add_argument("--run", type=Path, help="a finished `specdraft run` workdir: its EAGLE-3 store")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_inputs(ap)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_model_cpu.json")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-real-model"), help="drafts, questions, exports")
    ap.add_argument("--recipes", default=RECIPES, help="comma-separated (also: beagle, eagle3-hass)")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per recipe")
    ap.add_argument("--epochs", type=int, default=2, help="epochs the steps are spread over (>= a recipe's stages)")
    ap.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per batch")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the project's)")
    ap.add_argument("--questions", type=Path, nargs="+", default=[ROOT / "configs" / "data" / "mt_bench.jsonl"],
                    help="held-out question files (MT-Bench, HumanEval, ...)")
    ap.add_argument("--max-questions", type=int, default=5, help="questions per file")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5], help="chain lengths")
    ap.add_argument("--tree-depth", type=int, default=6)
    ap.add_argument("--tree-topk", type=int, default=10)
    ap.add_argument("--total-tokens", type=int, default=60)
    ap.add_argument("--engine-max-len", type=int, default=2048, help="vLLM's context (prompt + answer)")
    ap.add_argument("--no-engine", action="store_true", help="no vLLM")
    ap.add_argument("--no-decode", action="store_true", help="no evaluation in our decoder (vLLM's numbers only)")
    ap.add_argument("--engine-only", action="store_true",
                    help="vLLM's numbers alone (no decode of ours on the engine's prompts for the gap)")
    ap.add_argument("--eval-workers", type=int, default=None,
                    help="processes our decoder's questions spread over (default: one per CPU core)")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                    help="training precision (auto: bf16 on GPU, fp32 on CPU; bf16 on a CPU with avx512_bf16)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of training")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="a line stored with the result (its size, the host's state)")
    args = ap.parse_args(argv)
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if args.steps < args.epochs:
        ap.error(f"--steps {args.steps} is fewer than --epochs {args.epochs}")
    return args


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``benchmarks.recipe_training``'s settings every draft of a run shares: ``args.steps`` optimizer steps over
    ``args.epochs`` (``steps // epochs`` batches an epoch; ``args.steps`` None: whole epochs), the project's
    optimizer unless ``args.lr``."""
    from specdraft.configs.train import OptimConfig

    optim = OptimConfig()
    return {k: None for k in SHARED} | {
        "threads": args.threads, "seed": args.seed, "epochs": args.epochs, "max_tokens": args.max_tokens,
        "lr": args.lr or optim.lr, "warmup": None, "schedule": optim.schedule, "min_lr_ratio": optim.min_lr_ratio,
        "sim_depth": 5, "val_fraction": 0.05, "epoch_batches": args.steps // args.epochs if args.steps else None,
        "precision": args.precision}


def train_all(args: argparse.Namespace, store: Path, target: Path, work: Path,
              results: dict[str, Any], trained_one: Any = lambda: None) -> dict[str, Any]:
    """Every recipe on ``store`` for ``args.steps`` optimizer steps (``steps // epochs`` batches an epoch), into
    ``results``; ``trained_one()`` after each."""
    from specdraft.configs.recipes import RECIPES as KNOWN

    shared = shared_settings(args)
    for recipe in args.recipes:
        if recipe not in KNOWN or args.epochs < len(KNOWN[recipe].stages):
            raise SystemExit(f"{recipe}: unknown, or more stages than --epochs {args.epochs}")
        out = work / "drafts" / recipe
        shutil.rmtree(out, ignore_errors=True)  # a fresh run (feature_plan checks drafts already under out)
        print(f"[real_model] training {recipe} ...", file=sys.stderr, flush=True)
        r = results[recipe] = train_in_fresh_process(shared, recipe, store, target, out)
        print(f"[real_model]   {r['optimizer_steps']} steps, {r['train_s']} s, {r['tokens_per_s']} tokens/s, sim_tau "
              f"{r['sim_before']['sim_tau']} -> {r['sim_after']['sim_tau']}", file=sys.stderr, flush=True)
        trained_one()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.speculative import ENGINE_KEYS, decode_eval, engine_acceptance
    from specdraft.export import VLLM_FORMATS, formats_for
    from specdraft.models import read_draft_config

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    work = args.work.resolve()
    target = args.target.resolve()
    store = (args.store or find_store(args.run)).resolve()
    started, phases = time.perf_counter(), {}
    trained: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    engine: dict[str, Any] = {}

    def write(complete: bool) -> dict[str, Any]:
        """The result so far (after each phase: a run stopped later keeps what it measured)."""
        result = {
            "benchmark": "real_model", "complete": complete, "note": args.note,
            "settings": settings_of(args), "target": target_facts(target), "store": store_facts(store),
            "questions": question_counts(files),
            "recipes": {recipe: {"train": trained[recipe], "ours": ours.get(recipe),
                                 **{f"engine_{k}": e.get(recipe) for k, e in engine.items()}} for recipe in trained},
            "floor": {"engine_ngram": {k: e["ngram"] for k, e in engine.items()},
                      "ours_prompt_lookup": {name: {mode: block.get("tau_pld") for mode, block in modes.items()}
                                             for name, modes in next(iter(ours.values())).items()} if ours else {}},
            "engine": {k: {key: e.get(key) for key in ENGINE_KEYS}
                       for k, e in engine.items()},
            "host": {"torch_threads": args.threads, "load": load.summary()},  # write_result adds the host's facts
            "phases": phases, "total_s": round(time.perf_counter() - started, 1),
        }
        write_result(args.out, result)
        return result

    with LoadSampler() as load:
        files = write_question_sets(args.questions, work / "questions", args.max_questions)
        t0 = time.perf_counter()
        train_all(args, store, target, work, trained, lambda: write(False))
        phases["train_s"] = round(time.perf_counter() - t0, 1)
        write(False)
        if not args.no_engine:
            t0 = time.perf_counter()
            served = {r: Path(t["draft"]) for r, t in trained.items()
                      if set(formats_for(read_draft_config(t["draft"]))) & set(VLLM_FORMATS)}
            for k in args.k:
                print(f"[real_model] vLLM at K={k} for {sorted(served)} and ngram ...", file=sys.stderr, flush=True)
                engine[f"k{k}"] = engine_acceptance(target, served, files, work / f"engine-k{k}", args.max_new_tokens,
                                                    k, floor=True, max_model_len=args.engine_max_len,
                                                    ours=not args.engine_only)
                phases["engine_s"] = round(time.perf_counter() - t0, 1)
                write(False)
        t0 = time.perf_counter()
        for recipe, r in ({} if args.no_decode else trained).items():
            print(f"[real_model] our decoder with {recipe} ...", file=sys.stderr, flush=True)
            ours[recipe] = decode_eval(target, Path(r["draft"]), files, args, decode_modes(args), work / "baselines")
            write(False)
        phases["decode_s"] = round(time.perf_counter() - t0, 1)
        write(False)
    result = write(True)
    print_table(result)
    print(f"written: {args.out}")
    return 0


def number(x: Any, spec: str = ".2f") -> str:
    """``x`` formatted, or "-" where it was not measured."""
    return "-" if x is None else format(x, spec)


def print_table(result: dict[str, Any]) -> None:
    """One line per recipe and question set: training, our τ per mode, vLLM's acceptance and speedup per K."""
    ks = [k for k in result["engine"]]
    recipes = result["recipes"]
    first = next(iter(recipes.values()), {}).get("ours") or {}
    engine_first = next(iter(recipes.values()), {}).get(f"engine_{ks[0]}") if ks else None
    datasets = list(first) or list((engine_first or {}).get("datasets", {}))  # --no-decode: the engine's sets
    modes = list(first[datasets[0]]) if first else []
    head = (f"{'recipe':12s} {'set':10s} {'steps':>5s} {'train s':>7s} {'tok/s':>6s} "
            + " ".join(f"{'tau ' + m:>10s}" for m in modes)
            + "".join(f" | {'vLLM AL ' + k:>11s} {'speedup':>7s}" for k in ks))
    print(head)
    print("-" * len(head))
    for recipe, r in recipes.items():
        t = r["train"]
        for name in datasets:
            line = (f"{recipe:12s} {name[:10]:10s} {t['optimizer_steps']:5d} {t['train_s']:7.1f} "
                    f"{t['tokens_per_s']:6.0f} " + " ".join(f"{number(r['ours'][name][m]['tau']):>10s}" for m in modes))
            for k in ks:
                d = (r.get(f"engine_{k}") or {}).get("datasets", {}).get(name, {})
                line += f" | {number(d.get('acceptance_length')):>11s} {number(d.get('speedup')):>7s}"
            print(line)
    floor = result["floor"]
    for name in datasets:
        line = (f"{'floor':12s} {name[:10]:10s} {'':5s} {'':7s} {'':6s} "
                + " ".join(f"{number(floor['ours_prompt_lookup'][name][m]):>10s}" for m in modes))
        for k in ks:
            d = floor["engine_ngram"][k]["datasets"].get(name, {})
            line += f" | {number(d.get('acceptance_length')):>11s} {number(d.get('speedup')):>7s}"
        print(line)
    print("tau: our decoder's tokens per target forward (greedy, bonus counted); floor row: our prompt lookup "
          "(tau_pld) and vLLM's ngram; vLLM AL: vLLM's mean acceptance length (1 + accepted / drafts); speedup: "
          "vLLM's tokens/s with the draft over without it")
    load = result["host"]["load"]
    print(f"load avg (1m): min {load['load_1m_min']} mean {load['load_1m_mean']} max {load['load_1m_max']} on "
          f"{load['cpus']} CPUs; total {result['total_s']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
