"""The ``specdraft`` command line: one sub-command per user-facing job.

It sits at the top of the dependency chain (flows -> pipelines -> specdraft) so it can
reach every layer; each command imports what it needs lazily, so ``specdraft --help`` and
``specdraft COMMAND --help`` import no torch, Ray, Prefect or MLflow (a command's ``--help``
reads its config classes' source: ``flows/config_source.py``).
Config-bearing commands are bound to their config dataclass (``flows/options.py``): they
take ``--config FILE`` plus trailing ``key=value`` overrides, and their ``--help`` lists
every field with its default and description. The few other options are paths and switches, and a handful
of familiar flags (``train --recipe``, ``eval --mode``) are sugar for one override each.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from flows.options import CommandParser, ConfigSpec, add_config_options, load_config

RUN = ConfigSpec(root="pipelines.stages:RunConfig")
TOY_TARGET = ConfigSpec(root="specdraft.toy.build:ToyTargetConfig")
QUICKSTART = ConfigSpec(root="specdraft.quickstart:QuickstartConfig")
DUMP = ConfigSpec(root="specdraft.features:FeaturesConfig")
REGENERATE = ConfigSpec(root="pipelines.regenerate:RegenerateConfig")
EVAL = ConfigSpec(root="specdraft.decoding.eval:EvalSettings", sections=(("ray", "pipelines.evaluate:RayEvalConfig"),))
# train logs to MLflow only when asked (--mlflow or tracking.enabled=true)
EXPORT = ConfigSpec(root="specdraft.export:ExportConfig", sections=(("tracking", "pipelines.tracking:TrackingConfig"),))
TRAIN = ConfigSpec(root="specdraft.recipes:TrainConfig", sections=(("tracking", "pipelines.tracking:TrackingConfig"),),
                   defaults=("tracking.enabled=false",))


def _no_sugar(args: argparse.Namespace) -> list[str]:
    return []


def _train_sugar(args: argparse.Namespace) -> list[str]:
    out = [f"recipe={args.recipe}"] if args.recipe is not None else []
    out += [f"arch={args.arch}"] if args.arch is not None else []
    if args.conversations:  # --conversations FILE...: online features from those conversations
        out += ["features=online", f"conversations={json.dumps(args.conversations)}"]
    if args.mlflow is not None:  # --mlflow [URI]
        out += ["tracking.enabled=true"] + ([f"tracking.uri={args.mlflow}"] if args.mlflow else [])
    return out


def _eval_sugar(args: argparse.Namespace) -> list[str]:
    out = [f"decode.mode={args.mode}"] if args.mode is not None else []
    return out + ([f"engine.name={args.engine}"] if args.engine is not None else [])


def command_config(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The config (and its sections) a parsed command line asks for: --config, sugar flags, then key=value.

    Raises ``specdraft.config.ConfigError`` for a bad key or value; runs nothing.
    """
    return load_config(args.config_spec, args.config, [*args.sugar(args), *args.overrides])


# README "Guarantees" (output directories a command owns, ``specdraft/outputs.py``): per command with an
# --out directory, the options naming its inputs, and the names only it writes there (its outputs from
# before the marker file). export checks in ``export_draft`` (its draft may be a download); eval's --out
# is a report file: only its inputs are checked.
OUTPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dump": (("target", "prompts"), ("manifest.json", "shard-*")),
    "regenerate": (("target", "prompts"), ("regenerate.json",)),
    "train": (("target", "store", "conversations"), ("metrics.jsonl", "train_summary.json", "ray")),
    "eval": (("target", "draft", "questions"), ()),
    "quickstart": ((), ("report.json",)),
    "toy-data": ((), ("toy_prompts.jsonl", "toy_questions.jsonl")),
    "toy-target": ((), ("toy_target.json",)),
}


def check_out(args: argparse.Namespace) -> None:
    """Refuse an --out the command must not write (``specdraft.outputs.OutputError``), before it runs."""
    if args.command not in OUTPUTS:
        return
    from specdraft.outputs import check_output, refuse_own_input

    options, own = OUTPUTS[args.command]
    inputs = {f"--{name}": getattr(args, name) for name in options}
    if args.command == "train":  # online conversations may come from --config or key=value too
        inputs["--conversations"] = command_config(args)[0].conversations
    if args.command == "eval":
        refuse_own_input(args.out, inputs)
    else:
        check_output(args.out, args.command, inputs=inputs, overwrite=args.overwrite, own=own)


def _mark_out(args: argparse.Namespace) -> None:
    """Record in --out that this command writes it (a rerun then resumes there)."""
    from specdraft.outputs import mark_output

    mark_output(args.out, args.command)


def preflight(args: argparse.Namespace, cfg: Any) -> None:
    """The pre-flight of a command, before any cluster, model or data is touched: the paths it names
    (``flows.preflight.check_command``: target, draft, inputs); a problem is a ``ConfigError`` (exit 2)."""
    from flows.preflight import check_command

    check_command(args, cfg)


def _toy_target(args: argparse.Namespace) -> int:
    from specdraft.toy.build import build_toy_target, compare_with_prebuilt

    cfg, _ = command_config(args)
    out = build_toy_target(args.out, cfg, progress=not args.quiet, prebuilt=args.prebuilt, overwrite=args.overwrite)
    print(f"toy target ready: {out}")
    diff = compare_with_prebuilt(out)
    if diff["same_config"] and not args.prebuilt:  # a from-scratch rebuild of the shipped target
        same = [name for name, equal in diff["identical_files"].items() if equal]
        print(f"vs the shipped prebuilt target: {len(same)}/{len(diff['identical_files'])} files identical"
              f" ({', '.join(same) or 'none'}), max |weight difference| {diff['max_abs_weight_diff']}")
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from specdraft.quickstart import run_quickstart

    cfg, _ = command_config(args)
    _mark_out(args)
    report = run_quickstart(Path(args.out), cfg, progress=not args.quiet)
    print(json.dumps(report, indent=2))
    return 0


def _dump(args: argparse.Namespace) -> int:
    from pipelines.dump import dump_features, load_prompts
    from specdraft.store import StoreError

    cfg, _ = command_config(args)
    preflight(args, cfg)
    rows, ingested = load_prompts(args.prompts)
    _mark_out(args)
    if ingested is not None:
        print(f"ingest: {ingested['rows_in']} rows in, {ingested['rows_out']} out, rejected {ingested['rejects_by_reason']}, "
              f"{ingested['files_skipped']} files skipped", file=sys.stderr)
    try:
        summary = dump_features(args.target, rows, args.out, cfg, progress=not args.quiet, overwrite=args.overwrite,
                                ingested=ingested)
    except StoreError as err:
        print(f"specdraft: store error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    if summary["rows_out"] == 0:  # an empty store trains nothing: say why instead of succeeding quietly
        hint = (" — the conversations have no assistant turns to learn from: answer the prompts first "
                "(`specdraft regenerate`) and dump its output" if summary["rejected"].get("no_loss_tokens") else "")
        print(f"specdraft dump: no conversation was stored (rejected: {summary['rejected']}){hint}", file=sys.stderr)
        return 1
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
    from pipelines.regenerate import regenerate

    cfg, _ = command_config(args)
    preflight(args, cfg)
    _mark_out(args)
    s = regenerate(args.target, args.prompts, args.out, cfg, progress=not args.quiet)
    print(
        f"regenerate: rows in {s['rows_in']}, out {s['rows_out']}, skipped {s['rows_skipped']} (already done), "
        f"rejected {s['rows_rejected']}, too long {s['rows_too_long']}; {s['tokens_generated']} tokens in "
        f"{s['run_s']:.1f} s ({s['tokens_per_s']:.1f} tokens/s); {s['rows_total']} conversations in {s['out_dir']}"
    )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pipelines.evaluate import evaluate

    settings, sections = command_config(args)
    preflight(args, settings)
    report = evaluate(args.target, args.draft, args.questions, args.out, settings, use_ray=args.ray,
                      ray_cfg=sections["ray"], progress=not args.quiet)
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    for name, d in report["datasets"].items():
        print(f"{name}: tau {fmt(d['tau'])} vs pld {fmt(d['tau_pld'])} (tau/pld {fmt(d['tau_over_pld'])}), "
              f"alpha {[None if a is None else round(a, 3) for a in d['alpha']]}, "
              f"{fmt(d['tokens_per_s'])} tokens/s vs {fmt(d['baseline_tokens_per_s'])} vanilla "
              f"(speedup {fmt(d['speedup'])}), lossless {d['lossless_checked'] - d['lossless_mismatches']}"
              f"/{d['lossless_checked']}")
    if "engine" in report:
        from specdraft.evaluation.engine import engine_summary

        print(engine_summary(report["engine"]))
    print(f"report: {args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from pipelines.tracking import open_run
    from pipelines.train import run_training

    cfg, sections = command_config(args)
    if cfg.features == "offline" and not args.store:
        print("specdraft train: give --store DIR... (offline features) or --conversations FILE... (online "
              "features: the target runs in every worker, no store)", file=sys.stderr)
        return 2
    preflight(args, cfg)
    _mark_out(args)
    run = open_run(sections["tracking"], run_name="train",
                   tags={"specdraft.stage": "train", "specdraft.recipe": cfg.recipe})
    try:
        summary = run_training(cfg, args.store, args.target, args.out, tracking=run.ref(), ray_address=args.ray_address)
    except BaseException:
        run.close("FAILED")
        raise
    run.log_artifacts(summary["draft"], "draft")
    run.close()
    metrics = {k: round(v, 4) for k, v in summary["metrics"].items() if isinstance(v, float)}
    print(json.dumps({"draft": summary["draft"], "final": metrics, "mlflow_run": run.run_id,
                      "mlflow_uri": run.uri}, indent=2))
    return 0


def _toy_data(args: argparse.Namespace) -> int:
    from specdraft.toy.conversations import generate_prompts

    out = Path(args.out)
    _mark_out(args)
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


def _export_sugar(args: argparse.Namespace) -> list[str]:
    out = [f"dtype={args.dtype}"] if args.dtype is not None else []
    out += [f"speculative_tokens={args.speculative_tokens}"] if args.speculative_tokens is not None else []
    out += [f"tracking.uri={args.tracking_uri}"] if args.tracking_uri is not None else []
    return out


def _export(args: argparse.Namespace) -> int:
    import tempfile

    from specdraft.export import ExportError, export_draft, export_layout, formats_for, serve_commands
    from specdraft.models import read_draft_config

    cfg, sections = command_config(args)
    target = args.target
    with tempfile.TemporaryDirectory(prefix="specdraft-export-") as tmp:
        draft = args.draft
        if args.model_uri:
            from mlflow.tracking import MlflowClient

            from pipelines.registry import download_draft

            client = MlflowClient(tracking_uri=sections["tracking"].resolved_uri())
            try:
                local, version = download_draft(client, args.model_uri, tmp)
            except ValueError as err:
                print(f"specdraft export: {err}", file=sys.stderr)
                return 1
            draft, target = str(local), target or version.tags.get("specdraft.target")
            print(f"{args.model_uri}: {version.name} v{version.version} (run {version.run_id})")
        if not target or not Path(target).is_dir():
            print(f"specdraft export: the target directory {target!r} is not here: pass --target DIR (the model the "
                  "draft was trained on)", file=sys.stderr)
            return 1
        fmt = args.format if args.format != "auto" else (formats_for(read_draft_config(draft)) or ("vllm",))[0]
        try:
            out = export_draft(draft, fmt, args.out, target=target, dtype=cfg.dtype,
                               speculative_tokens=cfg.speculative_tokens, verifier=cfg.verifier,
                               overwrite=args.overwrite)
        except (ExportError, FileNotFoundError) as err:
            print(f"specdraft export: cannot export: {err}", file=sys.stderr)
            return 1
        arch = read_draft_config(draft).arch
    print(f"exported {arch} draft as {fmt}: {out}")
    for engine, command in serve_commands({fmt: str(Path(out).resolve())}, target, cfg.speculative_tokens).items():
        print(f"serve with {engine}:\n  {command}")
    if export_layout(fmt, out).plugin:
        print("  (vLLM finds this architecture through specdraft's plugin: install specdraft beside vLLM, e.g. "
              "`pip install --no-deps specdraft` in the serving image)")
    return 0


def _run(args: argparse.Namespace) -> int:
    cfg, _ = command_config(args)  # a bad key exits with code 2 here, before Prefect starts
    preflight(args, cfg)  # the workdir too: not an input, and a run's own unless --overwrite
    from specdraft.outputs import mark_output

    mark_output(cfg.workdir, "run")  # the flow's own pre-flight finds it the run's
    from flows.local_api import local_prefect_api
    from flows.regenerate_and_train import regenerate_and_train, summary_off_the_console

    # the flow logs its summary (pipelines.summary) to the flow-run log; here it is printed once, last
    with local_prefect_api(cfg.workdir), summary_off_the_console():  # API started reliably, stopped before exit
        result = regenerate_and_train(config=args.config, overrides=list(args.overrides))
    print("\n" + result["summary"])
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from specdraft.handoff import rollback

    try:
        meta = rollback(args.exports)
    except FileNotFoundError as err:
        print(f"specdraft rollback: {err}", file=sys.stderr)
        return 1
    print(f"{args.exports}/current: now serving version {meta.get('version', '?')} of {meta.get('model', 'the draft')} "
          f"(the one rolled back is {args.exports}/previous); restart the server to load it")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdraft",
        description="Train and keep fresh speculative-decoding draft models (Beagle, HASS/EAGLE).",
        epilog="`specdraft COMMAND --help` lists a command's options and config fields with their defaults.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)

    p = sub.add_parser("run", help="run the regenerate-and-train flow locally (ephemeral Prefect API unless PREFECT_API_URL)")
    p.add_argument("--overwrite", action="store_true",
                   help="run in a non-empty workdir that is not a run's own (its stage directories are written beside "
                        "the files there; never one holding an input)")
    add_config_options(p, RUN, default="configs/toy.yaml", example="train.recipe=hass train.epochs=[5] eval.settings.decode.mode=chain")
    p.set_defaults(func=_run, sugar=_no_sugar)

    p = sub.add_parser("toy-target", help="build the toy target model directory (small Llama + tokenizer)")
    p.add_argument("--out", required=True, help="output model directory (an earlier toy build there is replaced)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that is not a toy build (only the build's files are replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--prebuilt", action="store_true",
                   help="copy the target shipped with specdraft when the config is its (the default) one, instead "
                        "of training it; without: train from scratch and compare with the shipped one")
    add_config_options(p, TOY_TARGET, example="train_steps=200")
    p.set_defaults(func=_toy_target, sugar=_no_sugar)

    p = sub.add_parser("toy-data", help="write toy prompt conversations (messages JSONL) and MT-Bench-format questions")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that is not this command's earlier output (only the files "
                        "it writes are replaced; never one of its inputs)")
    p.add_argument("--prompts", type=int, default=240, help="prompt conversations (default 240)")
    p.add_argument("--questions", type=int, default=12, help="evaluation questions (default 12)")
    p.add_argument("--seed", type=int, default=7, help="generator seed (questions use seed + 1)")
    p.set_defaults(func=_toy_data)

    p = sub.add_parser(
        "quickstart",
        help="toy target + in-memory features + a short two-stage Beagle training, with simulated acceptance",
    )
    p.add_argument("--out", default="runs/quickstart", help="working directory (default: runs/quickstart)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that is not this command's earlier output (only the files "
                        "it writes are replaced; never one of its inputs)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_config_options(p, QUICKSTART, example="arch=eagle toy.train_steps=200")
    p.set_defaults(func=_quickstart, sugar=_no_sugar)

    p = sub.add_parser("dump", help="dump the target's features (hidden, top-K) for conversations into a Zarr store")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--prompts", required=True, nargs="+", metavar="FILE", help="conversation files (Parquet, JSON, JSONL)")
    p.add_argument("--out", required=True, help="store directory (resumed when it holds a partial dump)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a store written by another dump, or write into a non-empty --out that is not a "
                        "store (only the store's files are replaced; never one of its inputs)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_config_options(p, DUMP, example="hidden_codec=bf16 samples_per_shard=256")
    p.set_defaults(func=_dump, sugar=_no_sugar)

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
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that is not this command's earlier output (only the files "
                        "it writes are replaced; never one of its inputs)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_config_options(p, REGENERATE, example="temperature=0.7 ingest.max_turns=4")
    p.set_defaults(func=_regenerate, sugar=_no_sugar)

    p = sub.add_parser("eval", help="speculative decoding of the target with a draft: tau, alpha, speedup, lossless check")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--draft", required=True, help="draft directory (config.json + model.safetensors)")
    p.add_argument("--questions", required=True, nargs="+", metavar="FILE", help="MT-Bench-format question files")
    p.add_argument("--out", required=True, help="report JSON path")
    p.add_argument("--mode", metavar="MODE", help="same as decode.mode=MODE (chain of gamma tokens, or EAGLE-2 tree)")
    p.add_argument("--ray", action="store_true", help="spread questions over Ray Data replicas (settings: ray.*)")
    p.add_argument("--engine", metavar="ENGINE", choices=["vllm", "none"],
                   help="same as engine.name=ENGINE: also serve the draft in vLLM (exported for it) on the same "
                        "questions and report the engine's acceptance and speedup beside ours (settings: engine.*)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_options(p, EVAL, example="decode.gamma=4 max_questions=10 ray.replicas=2")
    p.set_defaults(func=_eval, sugar=_eval_sugar)

    p = sub.add_parser("export", help="export a draft for a serving engine (vLLM, SGLang, the EAGLE reference)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--draft", help="draft directory (config.json + model.safetensors)")
    src.add_argument("--model-uri", help="a registered draft: models:/NAME@ALIAS (e.g. @champion) or models:/NAME/VERSION")
    p.add_argument("--format", default="auto", choices=("auto", "speculators", "vllm", "sglang", "eagle"),
                   help="auto (default): the draft's vLLM format; speculators: EAGLE-3 for vLLM; vllm: Beagle, "
                        "Beagle over EAGLE-3 features and EAGLE-1/2 for vLLM with specdraft's plugin; sglang: EAGLE-3 "
                        "or EAGLE-1/2 for SGLang; eagle: EAGLE-1/2 in the EAGLE reference layout")
    p.add_argument("--out", required=True, help="output directory (an earlier export there is replaced atomically)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that is not this command's earlier output (only the files "
                        "it writes are replaced; never one of its inputs)")
    p.add_argument("--target", help="the target model directory (default with --model-uri: the one it was trained on)")
    p.add_argument("--dtype", metavar="DTYPE", help="same as dtype=DTYPE (default: the target's)")
    p.add_argument("--speculative-tokens", metavar="K", help="same as speculative_tokens=K")
    p.add_argument("--tracking-uri", metavar="URI", help="same as tracking.uri=URI (the registry of --model-uri)")
    add_config_options(p, EXPORT, example="dtype=bfloat16 speculative_tokens=5 verifier=meta-llama/Llama-3.1-8B")
    p.set_defaults(func=_export, sugar=_export_sugar)

    p = sub.add_parser("rollback", help="serve the draft handed off before the current one again (swaps "
                                        "EXPORTS/current and EXPORTS/previous)")
    p.add_argument("--exports", required=True, help="the hand-off directory (handoff.exports; default <workdir>/exports)")
    p.set_defaults(func=_rollback)

    p = sub.add_parser("train", help="train a draft on Ray Train from feature store(s) (Beagle two-stage, HASS, ...)")
    p.add_argument("--store", nargs="+", default=[], metavar="DIR", help="feature store directories")
    p.add_argument("--conversations", nargs="+", default=[], metavar="FILE",
                   help="online features instead of a store: conversation files/dirs, as `specdraft dump --prompts` "
                        "reads them (same as features=online conversations=[...]; tokenization: online.*)")
    p.add_argument("--target", required=True, help="target model directory (embedding and lm_head are read from it)")
    p.add_argument("--out", required=True, help="output directory (draft/, checkpoints, metrics.jsonl); rerun resumes")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that is not this command's earlier output (only the files "
                        "it writes are replaced; never one of its inputs)")
    p.add_argument("--recipe", metavar="NAME", help="same as recipe=NAME (an unknown name lists the known ones)")
    p.add_argument("--arch", metavar="NAME", help="same as arch=NAME: override the recipe's draft")
    p.add_argument("--mlflow", nargs="?", const="", default=None, metavar="URI",
                   help="same as tracking.enabled=true [tracking.uri=URI] "
                        "(default URI: MLFLOW_TRACKING_URI or sqlite:///./mlflow.db)")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local Ray)")
    add_config_options(p, TRAIN, example="epochs=[2,2] optim.lr=3e-4 scaling.num_workers=2")
    p.set_defaults(func=_train, sugar=_train_sugar)
    return parser


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")  # key=value, as opposed to a path or a URI


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; options with a variable number of values give trailing key=value back.

    ``--prompts a.jsonl k=v`` (nargs="+") and ``--mlflow k=v`` (an optional URI) would swallow
    the overrides that follow them; a value of the form key=value that is not an existing path
    is an override.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    given_back: list[str] = []
    if args.command in ("dump", "regenerate"):
        given_back = [p for p in args.prompts if OVERRIDE.match(p) and not Path(p).exists()]
        args.prompts = [p for p in args.prompts if p not in given_back]
        if not args.prompts:
            parser.error(f"{args.command}: --prompts needs at least one file")
    if args.command == "train":
        for name in ("store", "conversations"):  # nargs="+" too
            values = getattr(args, name)
            given_back += [v for v in values if OVERRIDE.match(v) and not Path(v).exists()]
            setattr(args, name, [v for v in values if v not in given_back])
    if args.command == "train" and args.mlflow and OVERRIDE.match(args.mlflow) and not Path(args.mlflow).exists():
        given_back, args.mlflow = given_back + [args.mlflow], ""
    if given_back:
        args.overrides = given_back + list(args.overrides)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)  # --help answers here, before any heavy import
    from specdraft.config import ConfigError
    from specdraft.outputs import OutputError
    from specdraft.target import TargetMismatch

    try:
        check_out(args)
        return int(args.func(args) or 0)
    except ConfigError as err:
        print(f"specdraft {args.command}: config error: {err}", file=sys.stderr)
        return 2
    except OutputError as err:
        print(f"specdraft {args.command}: {err}", file=sys.stderr)
        return 2
    except TargetMismatch as err:  # an artifact of another target: one line, before the expensive part
        print(f"specdraft {args.command}: wrong target: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a corrupt or inconsistent store, raised however deep (a Ray worker too): one line
        store_error = _store_error(err)
        if store_error is None:
            raise
        print(f"specdraft {args.command}: store error: {store_error}", file=sys.stderr)
        return 1


def _store_error(err: BaseException | None):
    """The ``StoreError`` that ``err`` is or wraps (a Ray task or Train failure's cause), else None."""
    from specdraft.store import StoreError

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        inner = getattr(err, "cause", None)  # RayTaskError: the worker's exception
        failures = getattr(err, "worker_failures", None)  # Ray Train: rank -> its exception
        if not isinstance(inner, BaseException) and isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
        if isinstance(err, StoreError) and not isinstance(inner, BaseException):
            return err
        err = inner if isinstance(inner, BaseException) else (err.__cause__ or err.__context__)
    return None


if __name__ == "__main__":
    raise SystemExit(main())
