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
    from pipelines.dump import FeaturesConfig, dump_features, read_conversations
    from specdraft.config import load
    from specdraft.store import StoreError

    # `--prompts a.parquet k=v` : nargs="+" swallows trailing overrides; give them back
    prompts = [p for p in args.prompts if "=" not in p or Path(p).exists()]
    overrides = [p for p in args.prompts if p not in prompts] + list(args.overrides)
    cfg = load(FeaturesConfig, args.config, overrides)
    rows = read_conversations(prompts)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdraft",
        description="Train and keep fresh speculative-decoding draft models (Beagle, HASS/EAGLE).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("toy-target", help="build the toy target model directory (small Llama + tokenizer)")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--config", help="YAML with ToyTargetConfig fields")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train_steps=200")
    p.set_defaults(func=_toy_target)

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
