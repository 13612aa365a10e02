"""The ``specdraft`` command line: one sub-command per user-facing job.

It sits at the top of the dependency chain (flows -> pipelines -> specdraft) so it can
reach every layer; each command imports what it needs lazily so ``--help`` is instant.
Config-bearing commands take ``--config FILE`` plus trailing ``key=value`` overrides.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _toy_target(args: argparse.Namespace) -> int:
    from specdraft.config import load
    from specdraft.toy.build import ToyTargetConfig, build_toy_target

    cfg = load(ToyTargetConfig, args.config, args.overrides)
    out = build_toy_target(args.out, cfg, progress=not args.quiet)
    print(f"toy target ready: {out}")
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from specdraft.config import load
    from specdraft.quickstart import QuickstartConfig, run_quickstart

    cfg = load(QuickstartConfig, args.config, args.overrides)
    report = run_quickstart(Path(args.out), cfg, progress=not args.quiet)
    print(json.dumps(report, indent=2))
    return 0


def _dump(args: argparse.Namespace) -> int:
    from pipelines.dump import FeaturesConfig, dump_features, load_conversations
    from specdraft.config import load
    from specdraft.store import StoreError

    # `--prompts a.parquet k=v` : nargs="+" swallows trailing overrides; give them back
    prompts = [p for p in args.prompts if "=" not in p or Path(p).exists()]
    overrides = [p for p in args.prompts if p not in prompts] + list(args.overrides)
    cfg = load(FeaturesConfig, args.config, overrides)
    rows, ingested = load_conversations(prompts)
    if ingested is not None:
        print(f"ingest: {ingested['rows_in']} rows in, {ingested['rows_out']} out, rejected {ingested['rejects_by_reason']}", file=sys.stderr)
    try:
        summary = dump_features(args.target, rows, args.out, cfg, progress=not args.quiet, overwrite=args.overwrite)
    except StoreError as err:
        print(f"specdraft: store error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


def _validate_store(args: argparse.Namespace) -> int:
    from specdraft.store import validate

    report = validate(args.store, checksums=not args.no_checksums, progress=not args.quiet)
    for line in report.warnings:
        print(f"warning: {line}")
    for line in report.problems:
        print(f"problem: {line}")
    state = "ok" if report.ok else f"CORRUPT ({len(report.problems)} problems)"
    print(f"{report.store}: {state}; {report.num_shards} shards, {report.num_sequences} sequences, {report.num_tokens} tokens")
    return 0 if report.ok else 1


def _regenerate(args: argparse.Namespace) -> int:
    from pipelines.regenerate import RegenerateConfig, regenerate
    from specdraft.config import load

    # `--prompts a.jsonl k=v` : nargs="+" swallows trailing overrides; give them back
    prompts = [p for p in args.prompts if "=" not in p or Path(p).exists()]
    overrides = [p for p in args.prompts if p not in prompts] + list(args.overrides)
    cfg = load(RegenerateConfig, args.config, overrides)
    s = regenerate(args.target, prompts, args.out, cfg, progress=not args.quiet)
    print(
        f"regenerate: rows in {s['rows_in']}, out {s['rows_out']}, skipped {s['rows_skipped']} (already done), "
        f"rejected {s['rows_rejected']}, too long {s['rows_too_long']}; {s['tokens_generated']} tokens in "
        f"{s['run_s']:.1f} s ({s['tokens_per_s']:.1f} tokens/s); {s['rows_total']} conversations in {s['out_dir']}"
    )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pipelines.evaluate import RayEvalConfig, evaluate
    from specdraft.decoding import DecodeConfig
    from specdraft.decoding.eval import EvalSettings

    decode = DecodeConfig(
        mode=args.mode, gamma=args.gamma, depth=args.depth, topk=args.topk, total_tokens=args.total_tokens,
        concate=not args.no_concate, temperature=args.temperature, top_p=args.top_p, top_k=args.sample_top_k,
        max_new_tokens=args.max_new_tokens,
    )
    settings = EvalSettings(decode=decode, max_questions=args.max_questions, seed=args.seed, dtype=args.dtype,
                            device=args.device)
    ray_cfg = RayEvalConfig(replicas=args.replicas)
    report = evaluate(args.target, args.draft, args.questions, args.out, settings, use_ray=args.ray,
                      ray_cfg=ray_cfg, progress=not args.quiet)
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    for name, d in report["datasets"].items():
        print(f"{name}: tau {fmt(d['tau'])}, alpha {[None if a is None else round(a, 3) for a in d['alpha']]}, "
              f"{fmt(d['tokens_per_s'])} tokens/s vs {fmt(d['baseline_tokens_per_s'])} vanilla "
              f"(speedup {fmt(d['speedup'])}), lossless {d['lossless_checked'] - d['lossless_mismatches']}"
              f"/{d['lossless_checked']}")
    print(f"report: {args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from pipelines.train import TrainConfig, run_training
    from pipelines.tracking import TrackingConfig, open_run
    from specdraft.config import flatten, load

    sugar = [f"recipe={args.recipe}"] if args.recipe else []
    sugar += [f"arch={args.arch}"] if args.arch else []
    cfg = load(TrainConfig, args.config, sugar + list(args.overrides))
    tracking, run = None, None
    if args.mlflow is not None:
        run = open_run(TrackingConfig(uri=args.mlflow or None, experiment=args.experiment), run_name="train",
                       tags={"specdraft.stage": "train", "specdraft.recipe": cfg.recipe})
        tracking = {"uri": run.uri, "run_id": run.run_id}
    try:
        summary = run_training(cfg, args.store, args.target, args.out, tracking=tracking, ray_address=args.ray_address)
    except BaseException:
        if run is not None:
            run.close("FAILED")
        raise
    if run is not None:
        run.log_artifacts(summary["draft"], "draft")
        run.close()
        print(f"mlflow run: {run.run_id} ({run.uri})")
    metrics = {k: round(v, 4) for k, v in summary["metrics"].items() if isinstance(v, float)}
    print(json.dumps({"draft": summary["draft"], "final": metrics}, indent=2))
    return 0


def _toy_data(args: argparse.Namespace) -> int:
    from specdraft.toy.conversations import generate_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "toy_prompts.jsonl"
    with prompts.open("w") as fh:
        for i, conv in enumerate(generate_prompts(args.prompts, seed=args.seed)):
            fh.write(json.dumps({"id": f"toy-{args.seed}-{i}", "messages": conv}) + "\n")
    questions = out / "toy_questions.jsonl"
    with questions.open("w") as fh:
        for i, conv in enumerate(generate_prompts(args.questions, seed=args.seed + 1)):
            turns = [m["content"] for m in conv if m["role"] == "user"]
            fh.write(json.dumps({"question_id": i, "category": "toy", "turns": turns}) + "\n")
    print(f"wrote {prompts} ({args.prompts} prompt conversations) and {questions} ({args.questions} questions)")
    return 0


def _run(args: argparse.Namespace) -> int:
    from flows.regenerate_and_train import regenerate_and_train

    result = regenerate_and_train(config=args.config, overrides=list(args.overrides))
    print("\nstage        status   seconds")
    rows = [("prepare", result["prepare"])] + [("regenerate", r) for r in result["regenerate"]]
    rows += [("features", r) for r in result["features"]] + [("train", result["train"]), ("eval", result["eval"])]
    for name, rec in rows:
        print(f"{name:<12} {'skipped' if rec.get('skipped') else 'done':<8} {rec.get('wall_s', 0.0):8.1f}")
    print("\ndataset              tau")
    for name, tau in result["eval"]["tau"].items():
        print(f"{name:<20} {tau:.3f}")
    reg = result["register"]
    if reg.get("version") is not None:
        print(f"\nregistered {reg['model_name']} v{reg['version']}: "
              f"{'promoted to ' + reg['alias'] if reg['promoted'] else 'not promoted'} ({reg['reason']})")
    if result.get("mlflow_parent_run"):
        print(f"mlflow parent run: {result['mlflow_parent_run']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdraft",
        description="Train and keep fresh speculative-decoding draft models (Beagle, HASS/EAGLE).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the regenerate-and-train flow locally (ephemeral Prefect API unless PREFECT_API_URL)")
    p.add_argument("--config", default="configs/toy.yaml", help="run config YAML (default configs/toy.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.recipe=hass eval.settings.decode.mode=chain")
    p.set_defaults(func=_run)

    p = sub.add_parser("toy-target", help="build the toy target model directory (small Llama + tokenizer)")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--config", help="YAML with ToyTargetConfig fields")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train_steps=200")
    p.set_defaults(func=_toy_target)

    p = sub.add_parser("toy-data", help="write toy prompt conversations (messages JSONL) and MT-Bench-format questions")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--prompts", type=int, default=240, help="prompt conversations (default 240)")
    p.add_argument("--questions", type=int, default=12, help="evaluation questions (default 12)")
    p.add_argument("--seed", type=int, default=7, help="generator seed (questions use seed + 1)")
    p.set_defaults(func=_toy_data)

    p = sub.add_parser(
        "quickstart",
        help="toy target + in-memory features + a short two-stage Beagle training, with simulated acceptance",
    )
    p.add_argument("--out", default="runs/quickstart", help="working directory (default: runs/quickstart)")
    p.add_argument("--config", help="YAML with QuickstartConfig fields")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. draft.arch=eagle")
    p.set_defaults(func=_quickstart)

    p = sub.add_parser("dump", help="dump the target's features (hidden, top-K) for conversations into a Zarr store")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--prompts", required=True, nargs="+", metavar="FILE", help="conversation files (Parquet, JSON, JSONL)")
    p.add_argument("--out", required=True, help="store directory (resumed when it holds a partial dump)")
    p.add_argument("--config", help="YAML with FeaturesConfig fields")
    p.add_argument("--overwrite", action="store_true", help="replace a store written by another dump")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. hidden_codec=bf16")
    p.set_defaults(func=_dump)

    p = sub.add_parser("validate-store", help="check a feature store against its manifest (counts, shapes, sha256)")
    p.add_argument("store", help="store directory")
    p.add_argument("--no-checksums", action="store_true", help="skip reading the data for sha256")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_validate_store)

    p = sub.add_parser("regenerate", help="let the target answer every prompt conversation itself (Ray Data)")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--prompts", required=True, nargs="+", metavar="FILE",
                   help="prompt files, directories or globs (ShareGPT, OpenAI messages, MT-Bench, HumanEval, Parquet)")
    p.add_argument("--out", required=True, help="output directory of Parquet parts (resumed when it holds some)")
    p.add_argument("--config", help="YAML with RegenerateConfig fields")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. temperature=0.7")
    p.set_defaults(func=_regenerate)

    p = sub.add_parser("eval", help="speculative decoding of the target with a draft: tau, alpha, speedup, lossless check")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--draft", required=True, help="draft directory (config.json + model.safetensors)")
    p.add_argument("--questions", required=True, nargs="+", metavar="FILE", help="MT-Bench-format question files")
    p.add_argument("--out", required=True, help="report JSON path")
    p.add_argument("--mode", choices=("chain", "tree"), default="tree", help="chain of gamma tokens or EAGLE-2 tree")
    p.add_argument("--gamma", type=int, default=5, help="chain: draft tokens per round (default 5)")
    p.add_argument("--depth", type=int, default=6, help="tree: drafted levels (default 6)")
    p.add_argument("--topk", type=int, default=10, help="tree: expansions per level and children per node (default 10)")
    p.add_argument("--total-tokens", type=int, default=60, help="tree: drafted nodes verified per round (default 60)")
    p.add_argument("--no-concate", action="store_true", help="Beagle: do not append drafted states while drafting")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (with the lossless check)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling warper (default 1 = off)")
    p.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k warper (default 0 = off)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default 256)")
    p.add_argument("--max-questions", type=int, default=None, help="first N questions of each file")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per question and turn)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (single-process path)")
    p.add_argument("--ray", action="store_true", help="spread questions over Ray Data replicas (one per GPU)")
    p.add_argument("--replicas", type=int, default=None, help="with --ray: number of model replicas")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_eval)

    p = sub.add_parser("train", help="train a draft on Ray Train from feature store(s) (Beagle two-stage, HASS, ...)")
    p.add_argument("--store", required=True, nargs="+", metavar="DIR", help="feature store directories")
    p.add_argument("--target", required=True, help="target model directory (embedding and lm_head are read from it)")
    p.add_argument("--out", required=True, help="output directory (draft/, checkpoints, metrics.jsonl); rerun resumes")
    p.add_argument("--recipe", help="beagle | beagle-early | beagle-topk | eagle | hass (default beagle)")
    p.add_argument("--arch", choices=("beagle", "eagle"), help="override the recipe's draft")
    p.add_argument("--config", help="YAML with TrainConfig fields")
    p.add_argument("--mlflow", nargs="?", const="", default=None, metavar="URI",
                   help="log to MLflow (default URI: MLFLOW_TRACKING_URI or sqlite:///./mlflow.db)")
    p.add_argument("--experiment", default="specdraft", help="MLflow experiment (default specdraft)")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local Ray)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. epochs=[2,2] scaling.num_workers=2")
    p.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    from specdraft.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"specdraft: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
