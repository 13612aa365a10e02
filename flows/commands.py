"""The ``specdraft`` sub-commands' bodies (docs/commands.md): each reads its config (``flows.options.command_config``),
runs its pre-flight and the job it names, and prints its summary; ``flows/cli.py`` parses the command line and
dispatches here. Each imports what it needs when it runs, so ``--help`` imports none of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flows.options import command_config


def mark_out(args: argparse.Namespace) -> None:
    """Record in --out that this command writes it (a rerun then resumes there)."""
    from specdraft.outputs import mark_output

    mark_output(args.out, args.command)


def preflight(args: argparse.Namespace, cfg: Any) -> None:
    """The pre-flight of a command, before any cluster, model or data is touched: the paths it names
    (``flows.preflight.check_command``: target, draft, inputs); a problem is a ``ConfigError`` (exit 2)."""
    from flows.preflight import check_command

    check_command(args, cfg)


def toy_target(args: argparse.Namespace) -> int:
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


def quickstart(args: argparse.Namespace) -> int:
    from specdraft.quickstart import run_quickstart

    cfg, _ = command_config(args)
    mark_out(args)
    report = run_quickstart(Path(args.out), cfg, progress=not args.quiet)
    print(json.dumps(report, indent=2))
    return 0


def dump(args: argparse.Namespace) -> int:
    from pipelines.dump import dump_features, load_prompts
    from specdraft.store import StoreError

    cfg, _ = command_config(args)
    preflight(args, cfg)
    rows, ingested = load_prompts(args.prompts)
    mark_out(args)
    if ingested is not None:
        print(f"ingest: {ingested['rows_in']} rows in, {ingested['rows_out']} out, rejected {ingested['rejects_by_reason']}, "
              f"{ingested['files_skipped']} files skipped", file=sys.stderr)
    try:
        summary = dump_features(args.target, rows, args.out, cfg, progress=not args.quiet, lines=not args.quiet,
                                overwrite=args.overwrite, ingested=ingested)
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


def validate_store(args: argparse.Namespace) -> int:
    from specdraft.store import validate

    report = validate(args.store, checksums=not args.no_checksums, progress=not args.quiet)
    for line in report.warnings:
        print(f"warning: {line}")
    for line in report.problems:
        print(f"problem: {line}")
    state = "ok" if report.ok else f"CORRUPT ({len(report.problems)} problems)"
    print(f"{report.store}: {state}; {report.num_shards} shards, {report.num_sequences} sequences, {report.num_tokens} tokens")
    return 0 if report.ok else 1


def regenerate(args: argparse.Namespace) -> int:
    from pipelines.regenerate import regenerate

    cfg, _ = command_config(args)
    preflight(args, cfg)
    mark_out(args)
    s = regenerate(args.target, args.prompts, args.out, cfg, progress=not args.quiet)
    print(
        f"regenerate: rows in {s['rows_in']}, out {s['rows_out']}, skipped {s['rows_skipped']} (already done), "
        f"rejected {s['rows_rejected']}, too long {s['rows_too_long']}; {s['tokens_generated']} tokens in "
        f"{s['run_s']:.1f} s ({s['tokens_per_s']:.1f} tokens/s); {s['rows_total']} conversations in {s['out_dir']}"
        + ("" if s["mode"] == "target" else f"; mode {s['mode']}: {s['rows_regenerated']} regenerated, "
           f"{s['rows_shipped']} kept as shipped, {s['rows_no_answer']} rejected with no answer to keep")
    )
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from pipelines.evaluate import evaluate
    from specdraft.evaluation.questions import describe_kinds, describe_skipped

    settings, sections = command_config(args)
    preflight(args, settings)
    report = evaluate(args.target, args.draft, args.questions, args.out, settings, use_ray=args.ray,
                      ray_cfg=sections["ray"], progress=not args.quiet)
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    for name, d in report["datasets"].items():
        print(f"{name}: tau {fmt(d['tau'])} vs pld {fmt(d['tau_pld'])} (tau/pld {fmt(d['tau_over_pld'])}), "
              f"alpha {[None if a is None else round(a, 3) for a in d['alpha']]}, "
              f"{fmt(d['tokens_per_s'])} tokens/s vs {fmt(d['baseline_tokens_per_s'])} vanilla "
              f"(speedup {fmt(d['speedup'])}, pld {fmt(d['speedup_pld'])}; all timed in this run, "
              f"load {fmt(d['load_1m'])}), lossless {d['lossless_checked'] - d['lossless_mismatches']}"
              f"/{d['lossless_checked']}")
    if "engine" in report:
        from specdraft.evaluation.engine import engine_summary

        print(engine_summary(report["engine"]))
    print(f"questions: {describe_kinds(report.get('question_kinds') or {})}, {describe_skipped(report)}")
    print(f"report: {args.out}")
    return 0


def train(args: argparse.Namespace) -> int:
    from pipelines.tracking import check_tracking, open_run
    from pipelines.train import run_training

    cfg, sections = command_config(args)
    check_tracking(sections["tracking"])  # an unreachable server: one line now, not minutes of retries later
    if cfg.features == "offline" and not args.store:
        print("specdraft train: give --store DIR... (offline features) or --conversations FILE... (online "
              "features: the target runs in every worker, no store)", file=sys.stderr)
        return 2
    preflight(args, cfg)
    mark_out(args)
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


def toy_data(args: argparse.Namespace) -> int:
    from specdraft.toy.conversations import generate_prompts

    out = Path(args.out)
    mark_out(args)
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


def export(args: argparse.Namespace) -> int:
    import tempfile

    from specdraft.export import ExportError, export_draft, export_layout, formats_for, serve_commands, variant
    from specdraft.models import read_draft_config

    cfg, sections = command_config(args)
    target, recipe, k = args.target, "", cfg.speculative_tokens  # K: as set, else a version's fastest in the engine
    with tempfile.TemporaryDirectory(prefix="specdraft-export-") as tmp:
        draft = args.draft
        if args.model_uri:
            from mlflow.tracking import MlflowClient

            from pipelines.registry import BEST_K_TAG, download_draft
            from pipelines.tracking import check_tracking

            check_tracking(sections["tracking"], lookup=True)  # answers, and holds a registry (no new mlflow.db)
            client = MlflowClient(tracking_uri=sections["tracking"].resolved_uri())
            try:
                local, version = download_draft(client, args.model_uri, tmp)
            except ValueError as err:
                print(f"specdraft export: {err}", file=sys.stderr)
                return 1
            draft, target = str(local), target or version.tags.get("specdraft.target")
            recipe = version.tags.get("specdraft.recipe", "")  # the flow tags the recipe that trained it
            k = k or (int(version.tags[BEST_K_TAG]) if version.tags.get(BEST_K_TAG, "").isdigit() else None)
            print(f"{args.model_uri}: {version.name} v{version.version} (run {version.run_id})")
        if not target or not Path(target).is_dir():
            print(f"specdraft export: the target directory {target!r} is not here: pass --target DIR (the model the "
                  "draft was trained on)", file=sys.stderr)
            return 1
        fmt = args.format if args.format != "auto" else (formats_for(read_draft_config(draft)) or ("vllm",))[0]
        try:
            out = export_draft(draft, fmt, args.out, target=target, dtype=cfg.dtype,
                               speculative_tokens=k, verifier=cfg.verifier,
                               overwrite=args.overwrite)
        except (ExportError, FileNotFoundError) as err:
            print(f"specdraft export: cannot export: {err}", file=sys.stderr)
            return 1
        config = read_draft_config(draft)
    # the recipe as trained (a registered version's tag); a bare draft directory: the draft as the engines see it
    print(f"exported {recipe or variant(config)} draft as {fmt}: {out}")
    for engine, command in serve_commands({fmt: str(Path(out).resolve())}, target, k).items():
        print(f"serve with {engine}:\n  {command}")
    if export_layout(fmt, out).plugin:
        print("  (vLLM finds this architecture through specdraft's plugin: install specdraft beside vLLM, e.g. "
              "`pip install --no-deps specdraft` in the serving image)")
    return 0


def import_target(args: argparse.Namespace) -> int:
    from specdraft.gguf_target import GGUFImportError, import_gguf
    from specdraft.packaged import PackageFileError, package_file

    try:
        gguf = args.gguf or package_file(args.package, ".gguf")
        record = import_gguf(gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except (GGUFImportError, PackageFileError) as err:
        print(f"specdraft import-target: {err}", file=sys.stderr)
        return 2
    print(f"target ready: {args.out} ({record['architecture']}, {record['layers']} layers, "
          f"{record['parameters'] / 1e6:.1f}M parameters, {record['dtype']}; {record['target_id']})")
    return 0


def rollback(args: argparse.Namespace) -> int:
    from specdraft.freshness.handoff import rollback as swap_back

    try:
        meta = swap_back(args.exports)
    except FileNotFoundError as err:
        print(f"specdraft rollback: {err}", file=sys.stderr)
        return 1
    print(f"{args.exports}/current: now serving version {meta.get('version', '?')} of {meta.get('model', 'the draft')} "
          f"(the one rolled back is {args.exports}/previous); restart the server to load it")
    return 0


def run(args: argparse.Namespace) -> int:
    cfg, _ = command_config(args)  # a bad key exits with code 2 here, before Prefect starts
    preflight(args, cfg)  # the workdir too: not an input, and a run's own unless --overwrite
    from specdraft.outputs import held_output, mark_output

    # one run per workdir: a second one (another `specdraft run`, a deployment's) is refused here, exit 2
    with held_output(cfg.workdir, "run"):
        mark_output(cfg.workdir, "run")  # the flow's own pre-flight finds it the run's
        from flows.local_api import local_prefect_api
        from flows.regenerate_and_train import regenerate_and_train, summary_off_the_console

        # the flow logs its summary (pipelines.summary) to the flow-run log; here it is printed once, last
        with local_prefect_api(cfg.workdir), summary_off_the_console():  # API started reliably, stopped before exit
            result = regenerate_and_train(config=args.config, overrides=list(args.overrides))
    print("\n" + result["summary"])
    return 0
