"""Draft quality per training recipe on one toy feature store.

Trains recipes of ``specdraft.configs.recipes.RECIPES`` (default: all ten — ``eagle``, ``hass``, ``beagle-early``,
``beagle``, ``beagle-topk``, and on the stored EAGLE-3 features ``eagle3``, ``eagle3-hass``, ``beagle3`` and the
block drafts ``dflash``, ``beagle-dflash``) on the SAME toy feature store (``benchmarks.toy_data``) for the SAME total
epochs (split over a recipe's stages, earlier stages taking the rest), optimizer, seed and held-out split.
Each recipe is set up by ``specdraft.run.build_run``, as a Ray Train worker sets it up (minus its
checkpoints), and trains in a fresh spawned process. Per recipe it reports:

* held-out simulated chain acceptance (``alpha_i``, ``sim_tau``; no bonus token) before and after
  training and after every epoch (``specdraft.run.validate_draft`` on the store's ``val`` split);
* training-loop wall time (validation timed apart), trained tokens/s, store-read time, CPU seconds and
  CPU ms per token (robust to a loaded host), optimizer steps;
* peak resident memory of the training process (VmHWM; the loop's own peak after a ``clear_refs`` reset);
* real speculative decoding of the toy target with the trained draft (``specdraft.evaluation``): greedy
  chain and EAGLE-2 tree drafting on held-out toy questions, tau, alpha_i, speedup and the lossless check;
  ``--mt-bench N --mt-bench-path FILE`` adds the first N questions of an MT-Bench file. A block draft
  drafts one block per round: ``gamma`` tokens in the chain column, its whole block (block_size - 1) in the
  tree column;
* ``--engine``: vLLM's measured acceptance for every recipe it serves (all but ``beagle-dflash``;
  ``benchmarks.speculative.engine_acceptance``) beside our decoder's on the same prompts, chain of ``--gamma``.

``--ray`` also trains one recipe through ``pipelines.train.run_training`` (Ray Train, one worker): the Ray
overhead and its draft's distance to the single-process one. The host's load average is recorded.

    python -m benchmarks.train_quality runs/bench/train_quality.json [--epochs 6 --conversations 512 ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.host import write_result
from specdraft.limits import LoadSampler
from benchmarks.recipe_training import SHARED, train_config, train_in_fresh_process
from benchmarks.speculative import decode_eval, engine_acceptance
from benchmarks.toy_data import build_store, question_overlap, write_mt_bench, write_toy_questions

RECIPE_ORDER = ("eagle", "hass", "beagle-early", "beagle", "beagle-topk", "eagle3", "eagle3-hass", "beagle3", "dflash",
                "beagle-dflash")


def ray_run(args: argparse.Namespace, shared: dict[str, Any], store: Path, target: Path, work: Path,
            single: dict[str, Any] | None) -> dict[str, Any]:
    """One recipe through ``pipelines.train.run_training`` (one worker): Ray overhead and agreement."""
    import ray

    from pipelines.train import run_training
    from specdraft.models import load_draft
    from specdraft.run import validate_draft
    from specdraft.store import FeatureDataset

    cfg = train_config(shared, args.ray_recipe)
    out = work / f"ray-{args.ray_recipe}"
    shutil.rmtree(out, ignore_errors=True)  # the same out would resume, not train
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    init_s = time.perf_counter() - started
    t0 = time.perf_counter()
    summary = run_training(cfg, [store], target, out)
    fit_s = time.perf_counter() - t0
    ray.shutdown()
    draft = load_draft(summary["draft"], target=target)
    counts = validate_draft(draft, FeatureDataset([store], cfg.reader, split="val", aux_layers=draft.config.aux_layers
                                                  or ()), cfg.sim_depth, 10**6, "cpu")
    result = {"recipe": args.ray_recipe, "ray_init_s": round(init_s, 2), "run_training_s": round(fit_s, 2),
              "optimizer_steps": summary["metrics"].get("state_step"),
              "train_tokens": summary["metrics"].get("state_tokens"), "sim_tau": round(counts.sim_tau, 4),
              "alpha": [round(a, 4) for a in counts.alpha],
              "note": "run_training also writes a checkpoint (draft + optimizer state) at every epoch end"}
    if single is not None:
        reference = load_draft(single["draft"], target=target)
        diff = max(float((a - b).abs().max()) for a, b in zip(draft.state_dict().values(),
                                                               reference.state_dict().values()))
        result.update({"single_process_function_s": single["function_s"],
                       "single_process_total_s": single["process_s"],
                       "overhead_vs_function_s": round(init_s + fit_s - single["function_s"], 2),
                       "overhead_vs_process_s": round(init_s + fit_s - single["process_s"], 2),
                       "max_abs_param_diff_vs_single_process": diff})
    return result


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
    if "engine" in result:
        e = result["engine"]
        for recipe in rows:
            if recipe in e:
                r = e[recipe]
                print(f"vLLM ({recipe}, K={e['speculative_tokens']}): acceptance length {_fmt(r['acceptance_length'], '.3f')}"
                      f" vs ours {_fmt(r['tau_ours'], '.3f')} (gap {_fmt(r['gap'], '+.4f')}); answers equal ours "
                      f"{r['same_answer_as_ours']}/{r['prompts']}, engine lossless {r['engine_lossless']}/{r['prompts']}")
    if "ray" in result:
        r = result["ray"]
        print(f"ray ({r['recipe']}): init {r['ray_init_s']} s + run_training {r['run_training_s']} s; "
              f"overhead vs single process {r.get('overhead_vs_function_s')} s; sim_tau {r['sim_tau']}; "
              f"max |param diff| {r.get('max_abs_param_diff_vs_single_process')}")


OPTIONS = (  # (flag, default, help): every option but out, --recipes, --schedule, --skip-decode, --ray
    ("--work", "runs/bench-train-quality", "toy target, store, drafts and questions"),
    ("--threads", 1, "torch threads (training processes and decoding)"), ("--seed", 0, "seed of everything"),
    ("--toy-steps", 150, "toy target training steps"), ("--toy-batch", 16, "toy target batch size"),
    ("--toy-conversations", 4000, "toy target training chats"), ("--toy-hidden", 128, "toy target width"),
    ("--toy-layers", 4, "toy target layers"), ("--conversations", 512, "toy chats in the feature store"),
    ("--data-seed", 1000, "generate_conversations seed of the store"),
    ("--val-fraction", 0.15, "held-out share of the store (by sample-id hash)"),
    ("--max-length", 192, "tokens per chat"), ("--topk", 10, "stored top-K"),
    ("--aux-layers", "1,2,3", ("EAGLE-3 features: HF hidden_states indices (the toy target has too few layers "
                               "for the default triple 2, N/2, N-3); empty: none")),
    ("--draft-vocab", None, "draft vocabulary of the EAGLE-3 recipes (default: the pipeline's)"),
    ("--samples-per-shard", 128, "sequences per store shard"),
    ("--epochs", 6, "total epochs per recipe (split over its stages)"),
    ("--max-tokens", 2048, "padded tokens per batch"), ("--lr", 2e-3, "peak learning rate"),
    ("--warmup", 20, "warmup optimizer steps"), ("--min-lr-ratio", 0.1, "final lr / peak lr"),
    ("--noise-std", None, "override every recipe's input noise"), ("--sim-depth", 5, "simulated chain depth"),
    ("--prompts", 16, "held-out toy questions"), ("--prompt-seed", 4242, "generate_prompts seed (not --data-seed)"),
    ("--max-turns", None, "user turns per question (default: all)"), ("--max-new-tokens", 64, "tokens per answer"),
    ("--gamma", 4, "chain draft length"), ("--tree-depth", 6, "tree depth"), ("--tree-topk", 10, "tree top-K"),
    ("--total-tokens", 60, "tree tokens per round"), ("--mt-bench", 0, "also decode the first N MT-Bench questions"),
    ("--mt-bench-path", None, "the MT-Bench question file (JSON lines) --mt-bench reads"),
    ("--ray-recipe", "beagle", "the recipe --ray trains"),
    ("--block-size", 16, "block drafts: positions per block"), ("--draft-layers", None, "block drafts: layers"),
    ("--anchors", None, "block drafts: anchors per sequence (default: the recipe's)"),
)
TYPES = {"--draft-vocab": int, "--noise-std": float, "--max-turns": int, "--mt-bench-path": str, "--draft-layers": int,
         "--anchors": int}


def main(argv: list[str] | None = None) -> int:
    # Long on purpose: the benchmark's script, phase by phase; its phases share the locals a split would pass around.
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON result path")
    ap.add_argument("--recipes", default=",".join(RECIPE_ORDER), help="comma-separated subset of the recipes")
    ap.add_argument("--schedule", default="cosine", choices=("constant", "cosine", "linear"))
    ap.add_argument("--skip-decode", action="store_true", help="no speculative decoding evaluation")
    ap.add_argument("--ray", action="store_true", help="also train one recipe through run_training (Ray Train)")
    ap.add_argument("--engine", action="store_true", help="also serve the drafts in vLLM (acceptance beside ours)")
    for flag, default, text in OPTIONS:
        ap.add_argument(flag, type=TYPES.get(flag, type(default)), default=default, help=text)
    args = ap.parse_args(argv)

    from specdraft.configs.recipes import RECIPES
    from specdraft.toy.build import build_toy_target, read_build_record
    from specdraft.configs.toy import ToyTargetConfig

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = sorted(set(recipes) - set(RECIPES))
    assert not unknown, f"unknown recipes {unknown}; known: {sorted(RECIPES)}"
    for r in recipes:
        assert args.epochs >= len(RECIPES[r].stages), f"--epochs {args.epochs} is fewer than {r}'s stages"
    assert not args.mt_bench or args.mt_bench_path, "--mt-bench N needs --mt-bench-path FILE"
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    phases: dict[str, float] = {}

    def phase(name: str, t0: float) -> None:
        phases[name] = round(time.perf_counter() - t0, 1)

    with LoadSampler() as load:
        t0 = time.perf_counter()
        toy = ToyTargetConfig(seed=args.seed, num_conversations=args.toy_conversations, train_steps=args.toy_steps,
                              batch_size=args.toy_batch, hidden_size=args.toy_hidden, num_layers=args.toy_layers,
                              num_threads=args.threads)
        target = build_toy_target(work / "target", toy, progress=False)
        phase("toy_target_s", t0)
        record = read_build_record(target)
        t0, store = time.perf_counter(), work / "store"
        aux_layers = [int(x) for x in args.aux_layers.split(",") if x.strip()]
        store_info = build_store(store, target, args.conversations, args.data_seed, args.max_length, args.topk,
                                 args.samples_per_shard, aux_layers)
        phase("store_s", t0)
        files = [write_toy_questions(work / "questions" / "toy.jsonl", args.prompts, args.prompt_seed, args.max_turns)]
        overlap = question_overlap(files[0], args.conversations, args.data_seed)
        if args.mt_bench:
            files.append(write_mt_bench(work / "questions" / "mt_bench.jsonl", Path(args.mt_bench_path),
                                        args.mt_bench, args.max_turns))

        shared = {k: getattr(args, k) for k in SHARED}
        results: dict[str, Any] = {}
        t0 = time.perf_counter()
        for recipe in recipes:
            print(f"[train_quality] training {recipe} ...", file=sys.stderr, flush=True)
            r = results[recipe] = train_in_fresh_process(shared, recipe, store, target, work / "drafts" / recipe)
            print(f"[train_quality]   {r['optimizer_steps']} steps, {r['train_s']} s, sim_tau "
                  f"{r['sim_before']['sim_tau']} -> {r['sim_after']['sim_tau']}", file=sys.stderr, flush=True)
        phase("training_s", t0)
        if not args.skip_decode:
            t0 = time.perf_counter()
            for recipe in recipes:
                print(f"[train_quality] decoding with {recipe} ...", file=sys.stderr, flush=True)
                results[recipe]["decode"] = decode_eval(target, Path(results[recipe]["draft"]), files, args)
            phase("decoding_s", t0)
        engine_result = None
        if args.engine:
            t0 = time.perf_counter()
            from specdraft.export import VLLM_FORMATS, formats_for
            from specdraft.models import read_draft_config

            served = {r: Path(results[r]["draft"]) for r in recipes
                      if set(formats_for(read_draft_config(results[r]["draft"]))) & set(VLLM_FORMATS)}
            print(f"[train_quality] vLLM engine for {sorted(served)} ...", file=sys.stderr, flush=True)
            engine_result = engine_acceptance(target, served, files, work, args.max_new_tokens, args.gamma)
            phase("engine_s", t0)
        ray_result = None
        if args.ray:
            t0 = time.perf_counter()
            print(f"[train_quality] ray run of {args.ray_recipe} ...", file=sys.stderr, flush=True)
            ray_result = ray_run(args, shared, store, target, work, results.get(args.ray_recipe))
            phase("ray_s", t0)

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
                      "toy_first_turn_also_in_store": overlap, "mt_bench": args.mt_bench or None},
        "recipes": results,
        "host": {"threads": args.threads, "device": "cpu", "load": load.summary()},  # write_result adds the host's facts
        "phases": phases,
        "total_s": round(time.perf_counter() - started, 1),
        **({"ray": ray_result} if ray_result is not None else {}),
        **({"engine": engine_result} if engine_result is not None else {}),
    }
    path = write_result(args.out, result)
    print_table(result)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
