"""Data scaling (issue 40, Deliver 4): vLLM's acceptance and speedup against training tokens, beside vLLM's ngram.

On a target and one or two feature stores dumped with the EAGLE-3 aux layers — the target's own answers
(``--store-regenerated``) and the answers as they ship (``--store-shipped``, ``regenerate.mode=shipped``) — for each
size of ``--tokens`` (ascending), per store ("data mode"):

1. **data** — a prefix of the store's training split (the store's held-out split is every size's): its sequences
   in a fixed order (by the digest of ``--seed`` and the sample id: independent of the shards' layout, the same
   conversations in both stores where their ids agree), the shortest prefix holding the size's tokens; so the
   sizes are nested. A size above the split's tokens is skipped, with the reason, in the JSON and the table;
2. **training** — each of ``--recipes`` (default ``beagle3``, the default recipe, and ``hass``) for ``--epochs``
   whole epochs over the prefix (``benchmarks.recipe_training``, a spawned process each; the draft vocabulary
   counted on the prefix): every recipe reads the same batches, so equal data and equal steps; at the sizes of
   ``--peer``, the peer (``speculators`` EAGLE-3, ``benchmarks.peer_speculators``) on the same prefix for the same
   optimizer steps (its packed length sized so an epoch holds as many batches as ours);
3. **serving** — every draft of the size (both modes, every recipe, the peer) and vLLM's ``ngram`` in ONE vLLM
   process at every K of ``--k`` (``benchmarks.speculative.engine_sweep``; interleaved K by K, after the target
   alone): per drafter its fastest K, acceptance and speedup there and its cost model
   (``specdraft.evaluation.engine_sweep``); the load sampled during it.

Then per (mode, recipe) the curve (``benchmarks.scaling_fit``: speedup and acceptance against log10 tokens, least
squares) and the tokens it predicts for ngram's speedup (the median of the run's ngram measurements) and for 1.3×,
flagged ``extrapolated`` outside the measured sizes; a plot (``--plot``). Resumable: the JSON (``--out``) is
written after every point; run the same command again and only the unfinished points are redone (a trained point
whose draft directory is gone is retrained; a size is served again unless every draft of it was served). Other
settings than the JSON's stop it (exit 2) unless ``--fresh``.

The stores come first (SmolLM2, ``configs/smollm2.yaml``'s slice settings; its 120 conversations held 26k tokens,
~220 a regenerated conversation, so ~8,000 hold the 1.6M training tokens beside the 5 % held out; a shipped
answer is longer, so its store holds more)::

    specdraft regenerate --target targets/smollm2 --prompts sharegpt --out runs-scaling/regen limit=8000 \\
        backend=vllm dtype=bfloat16 temperature=0.0 max_new_tokens=128 max_model_len=2048 num_cpus=2 \\
        ingest.max_turns=1 ingest.max_chars=4000
    specdraft regenerate --target targets/smollm2 --prompts sharegpt --out runs-scaling/shipped limit=8000 \\
        mode=shipped ingest.max_turns=1 ingest.max_chars=4000
    specdraft dump --target targets/smollm2 --prompts runs-scaling/regen --out runs-scaling/store-regen \\
        aux_layers=eagle3 max_length=1024 dtype=bfloat16 cpus_per_actor=1 torch_threads=2
    specdraft dump --target targets/smollm2 --prompts runs-scaling/shipped --out runs-scaling/store-shipped \\
        aux_layers=eagle3 max_length=1024 dtype=bfloat16 cpus_per_actor=1 torch_threads=2
    python -m benchmarks.data_scaling --target targets/smollm2 --store-regenerated runs-scaling/store-regen \\
        --store-shipped runs-scaling/store-shipped --tokens 25000,100000,400000,1600000 --peer 25000,100000 \\
        --precision bf16 --out benchmarks/results/data_scaling_smollm2_cpu.json \\
        --plot benchmarks/results/data_scaling_smollm2_cpu.png

Its duration is mostly training: about half the stored tokens carry a loss, trained at 420-680 loss tokens/s
(``hass``, ``beagle3``: this trainer in bf16 on 2 quiet cores) to 150-270 (the flow's), per mode, recipe and
epoch — ~7-19 h for the command above, ~2.5-6 h for ``--tokens 25000,50000,100000,400000`` (docs/development.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.host import write_result
from benchmarks.real_model import ROOT, settings_of, shared_settings, store_facts, target_facts, write_question_sets
from benchmarks.scaling_fit import describe, ngram_reference, series_fits, write_plot
from benchmarks.scaling_plan import Progress, keyed, prefixes, resume_key, served_point
from specdraft.limits import LoadSampler

PEER = "speculators"
MODES = ("regenerated", "shipped")


def default_questions() -> list[Path]:
    """MT-Bench, and HumanEval where the shared data folder holds it (``../shared/data``)."""
    humaneval = Path("../shared/data/humaneval.jsonl")
    return [ROOT / "configs" / "data" / "mt_bench.jsonl", *([humaneval] if humaneval.is_file() else [])]


def parse(argv: list[str] | None) -> argparse.Namespace:
    from benchmarks.peer_speculators import VENV
    from specdraft.configs.evaluation import EngineSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, type=Path, help="the target model directory")
    ap.add_argument("--store-regenerated", type=Path, help="a store of the target's own answers (aux_layers=eagle3)")
    ap.add_argument("--store-shipped", type=Path, help="a store of the answers as they ship (aux_layers=eagle3)")
    ap.add_argument("--tokens", default="25000,100000,400000,1600000",
                    help="training tokens per point, comma-separated")
    ap.add_argument("--recipes", default="beagle3,hass", help="our recipes, comma-separated")
    ap.add_argument("--peer", default="", help="sizes (of --tokens) the peer speculators trains at; none: no peer")
    ap.add_argument("--venv", type=Path, default=VENV, help="a virtual environment with speculators installed")
    ap.add_argument("--epochs", type=int, default=2, help="whole epochs over each prefix (>= a recipe's stages)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="padded tokens per batch")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the project's)")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--val-batches", type=int, default=8, help="held-out batches of each validation (sim_tau)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of training")
    ap.add_argument("--k", type=lambda s: tuple(int(x) for x in s.split(",")), default=EngineSettings().sweep_k,
                    help="the K every drafter is served at (default: engine.sweep_k)")
    ap.add_argument("--questions", type=Path, nargs="+", default=default_questions())
    ap.add_argument("--max-questions", type=int, default=4, help="questions per file")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--engine-max-len", type=int, default=2048, help="vLLM's context (prompt + answer)")
    ap.add_argument("--no-engine", action="store_true", help="train only (no vLLM: no acceptance, no fit)")
    ap.add_argument("--seed", type=int, default=0, help="the prefixes' order and training's seed")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-data-scaling"), help="drafts, exports, questions")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_scaling_cpu.json")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of the curves (matplotlib)")
    ap.add_argument("--fresh", action="store_true", help="start over: ignore what --out already holds")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    check(ap, args)
    return args


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad values: one line naming the option (argparse's exit 2)."""
    from specdraft.configs.recipes import RECIPES

    args.stores = {m: getattr(args, f"store_{m}") for m in MODES if getattr(args, f"store_{m}") is not None}
    if not args.stores:
        ap.error("give --store-regenerated, --store-shipped or both")
    for mode, store in args.stores.items():
        if not (store / "manifest.json").is_file():
            ap.error(f"--store-{mode} {store}: no feature store there (no manifest.json; `specdraft dump` writes one)")
    try:
        args.sizes = sorted({int(x) for x in args.tokens.split(",") if x.strip()})
        args.peer_sizes = sorted({int(x) for x in args.peer.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--tokens {args.tokens!r} / --peer {args.peer!r}: comma-separated whole numbers")
    if not args.sizes or args.sizes[0] < 1:
        ap.error(f"--tokens {args.tokens!r}: positive token counts")
    if extra := sorted(set(args.peer_sizes) - set(args.sizes)):
        ap.error(f"--peer {extra}: not among --tokens {args.sizes} (the peer is served beside our drafts of a size)")
    if args.peer_sizes and not (args.venv / "bin" / "python").is_file():
        ap.error(f"--venv {args.venv}: no bin/python (a virtual environment with speculators installed) for --peer")
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for recipe in args.recipes:
        if recipe not in RECIPES:
            ap.error(f"--recipes {recipe}: unknown; choose from {sorted(RECIPES)}")
        if args.epochs < len(RECIPES[recipe].stages):
            ap.error(f"--epochs {args.epochs}: fewer than {recipe}'s {len(RECIPES[recipe].stages)} stages")
    if not args.k or min(args.k) < 1:
        ap.error(f"--k {args.k}: positive chain lengths")
    args.steps = None  # whole epochs (real_model.shared_settings)


def train_point(args, mode: str, recipe: str, size: int, prefix: dict[str, Any], target: Path) -> dict[str, Any]:
    """Our ``recipe`` for ``--epochs`` over the prefix (a spawned process), its load sampled."""
    import shutil

    from benchmarks.recipe_training import train_in_fresh_process

    out = args.work.resolve() / "drafts" / mode / recipe / str(size)
    shutil.rmtree(out, ignore_errors=True)  # a point redone from the start (feature_plan reuses a draft_vocab.json)
    settings = {**shared_settings(args), "train_samples": prefix["samples"], "val_max_batches": args.val_batches}
    with LoadSampler() as load:
        r = train_in_fresh_process(settings, recipe, args.stores[mode].resolve(), target, out)
    keep = ("optimizer_steps", "batches_per_epoch", "train_sequences", "train_tokens", "train_s", "tokens_per_s",
            "cpu_s", "setup_s", "process_s", "sim_before", "sim_after", "draft_vocab_size", "epochs", "draft")
    return {**{k: r.get(k) for k in keep}, "load": load.summary()}


def peer_point(args, mode: str, size: int, prefix: dict[str, Any], target: Path, steps: int) -> dict[str, Any]:
    """The peer on the same prefix for ``steps`` optimizer steps over ``--epochs`` (its packed rows sized so an
    epoch holds at least ``steps // epochs`` batches: equal steps, about our real tokens a step)."""
    from benchmarks.peer_speculators import train_peer
    from specdraft.configs.train import DEFAULT_DRAFT_VOCAB

    per_epoch = max(1, steps // args.epochs)
    packed = max(prefix["longest"], prefix["tokens"] // per_epoch)
    peer = argparse.Namespace(venv=args.venv, steps=steps, epochs=args.epochs, max_tokens=packed,
                              precision="bf16" if args.precision == "bf16" else "fp32", threads=args.threads,
                              seed=args.seed, val_fraction=0.05, draft_vocab=DEFAULT_DRAFT_VOCAB, lr=None)
    with LoadSampler() as load:
        r = train_peer(peer, args.stores[mode].resolve(), target, args.work.resolve() / "peer" / mode / str(size),
                       prefix["samples"])
    keep = ("trainer", "optimizer_steps", "batches_per_epoch", "train_tokens", "train_s", "tokens_per_s", "draft")
    return {**{k: r.get(k) for k in keep}, "packed_tokens": packed, "steps_asked": steps,
            "steps_equal": r.get("optimizer_steps") == steps, "load": load.summary()}


def serve_size(args, size: int, labels: dict[str, dict[str, Any]], target: Path, files: list[Path]) -> dict[str, Any]:
    """Every draft of ``size`` (label -> its point) and vLLM's ngram in one vLLM process at every K; the sweep,
    its wall time and the load sampled during it."""
    from benchmarks.speculative import engine_sweep
    from specdraft.evaluation.engine_sweep import sweep_report

    ours = {label: Path(p["train"]["draft"]) for label, p in labels.items() if p["recipe"] != PEER}
    peer = {label: {"model": p["train"]["draft"], "method": "eagle3"} for label, p in labels.items()
            if p["recipe"] == PEER}  # speculators' own format, read by vLLM
    k = 3 if 3 in args.k else args.k[0]
    started = time.perf_counter()
    with LoadSampler() as load:
        run, ks, _ = engine_sweep(target, ours, files, args.work.resolve() / f"engine-{size}", args.k, k,
                                  args.max_new_tokens, args.engine_max_len, served=peer, tag="data_scaling")
        sweep = sweep_report(run, ks, greedy=True)
    return {"labels": sorted(labels), "prompts": len(run.prompts), "engine_s": round(time.perf_counter() - started, 1),
            "load": load.summary(), "ngram": served_point(sweep, "ngram"), "sweep": sweep}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target = args.target.resolve()
    state = load_state(args, target)
    started = time.perf_counter()

    def write(complete: bool) -> None:
        served = [p for p in state["points"].values() if p.get("engine")]
        ngram = ngram_reference({str(s): e for s, e in state["engines"].items()})
        state["fit"] = {"ngram": ngram, "series": series_fits([fit_row(p) for p in served], ngram)}
        session["total_s"], session["load"] = round(time.perf_counter() - started, 1), load.summary()
        write_result(args.out, {"benchmark": "data_scaling", "complete": complete, "note": args.note,
                                "settings": settings_of(args), "target": target_facts(target),
                                "stores": {m: store_facts(s.resolve()) for m, s in args.stores.items()}, **state},
                     load=load.summary(), torch_threads=args.threads)

    with LoadSampler() as load:
        session = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        state["sessions"].append(session)
        files = write_question_sets(args.questions, args.work.resolve() / "questions", args.max_questions)
        state["questions"] = {f.stem: sum(1 for x in f.read_text().splitlines() if x.strip()) for f in files}
        cut = {mode: prefixes(store.resolve(), args.sizes, args.seed) for mode, store in args.stores.items()}
        run_points(args, state, cut, target, files, write)
    write(True)
    print_table(state)
    if args.plot and state["fit"]["series"]:
        served = [fit_row(p) for p in state["points"].values() if p.get("engine")]
        print(write_plot(args.plot, served, state["fit"]["series"], state["fit"]["ngram"]))
    print(f"written: {args.out}")
    return 0


def run_points(args, state: dict[str, Any], cut: dict[str, dict[int, dict[str, Any]]], target: Path,
               files: list[Path], write) -> None:
    """Size by size: train every missing point of the size (each mode's recipes, then the peer), then serve the
    size unless every draft of it was served; the JSON written after each step, a progress line before it."""
    points, engines = state["points"], state["engines"]
    progress = Progress(args, cut, points, engines)
    for size in args.sizes:
        for mode, sizes in cut.items():
            prefix = sizes[size]
            for recipe in [*args.recipes, *([PEER] if size in args.peer_sizes else [])]:
                key = keyed(mode, recipe, size)
                if "skipped" in prefix:
                    points[key] = {"mode": mode, "recipe": recipe, "tokens_asked": size, "skipped": prefix["skipped"]}
                    continue
                if progress.trained(key):
                    continue
                progress.line(f"training {recipe} on {mode} data, {prefix['tokens']:,} tokens ({size:,} asked)")
                t0 = time.perf_counter()
                train = (peer_point(args, mode, size, prefix, target, our_steps(args, points, mode, size, prefix))
                         if recipe == PEER else train_point(args, mode, recipe, size, prefix, target))
                points[key] = {"mode": mode, "recipe": recipe, "tokens_asked": size, "data": public(prefix),
                               "train": train}
                if str(size) in engines:  # a draft trained again: its size is served again
                    engines[str(size)]["labels"] = [x for x in engines[str(size)]["labels"] if x != key]
                progress.done("train", key, time.perf_counter() - t0)
                write(False)
        labels = {key: p for key, p in points.items() if p["tokens_asked"] == size and "train" in p}
        if args.no_engine or not labels or set(engines.get(str(size), {}).get("labels", [])) >= set(labels):
            continue
        progress.line(f"serving the {len(labels)} drafts of {size:,} tokens and ngram at K={list(args.k)} in vLLM")
        t0 = time.perf_counter()
        engines[str(size)] = serve_size(args, size, labels, target, files)
        for key in labels:
            points[key]["engine"] = served_point(engines[str(size)]["sweep"], key)
            points[key]["ngram"] = engines[str(size)]["ngram"]
        progress.done("serve", str(size), time.perf_counter() - t0)
        write(False)


def our_steps(args: argparse.Namespace, points: dict[str, Any], mode: str, size: int, prefix: dict[str, Any]) -> int:
    """The optimizer steps our recipes trained at the point (the reader's plan when none of them did)."""
    from benchmarks.scaling_plan import planned_steps

    for recipe in args.recipes:
        train = (points.get(keyed(mode, recipe, size)) or {}).get("train")
        if train:
            return train["optimizer_steps"]
    return planned_steps(args.stores[mode].resolve(), prefix["samples"], args.max_tokens, args.seed, args.epochs)


def public(prefix: dict[str, Any]) -> dict[str, Any]:
    """A prefix as the JSON records it: its size, not its sample ids (their digest)."""
    return {k: v for k, v in prefix.items() if k != "samples"}


def fit_row(point: dict[str, Any]) -> dict[str, Any]:
    """A served point as ``scaling_fit`` reads it: its training tokens and its numbers at its best K."""
    e = point["engine"]
    return {"mode": point["mode"], "recipe": point["recipe"], "tokens": point["data"]["tokens"],
            "speedup": e["speedup"], "acceptance_length": e["acceptance_length"], "cost": e["cost"]}


def load_state(args: argparse.Namespace, target: Path) -> dict[str, Any]:
    """What ``--out`` already holds of this run (points, engines, sessions), or a fresh state; another run's JSON
    (other settings) stops here, one line naming the first setting that differs (exit 2)."""
    key = resume_key(args, target)
    fresh = {"resume_key": key, "points": {}, "engines": {}, "sessions": [], "fit": {}}
    if args.fresh or not args.out.is_file():
        return fresh
    try:
        old = json.loads(args.out.read_text())
    except json.JSONDecodeError as err:
        raise SystemExit(f"{args.out}: not JSON ({err}); --fresh to start over") from None
    if old.get("benchmark") != "data_scaling":
        print(f"{args.out}: holds another benchmark's result ({old.get('benchmark')!r}); another --out, or --fresh to "
              "replace it", file=sys.stderr)
        raise SystemExit(2)
    if (held := old.get("resume_key")) != key:
        diff = next((k for k in key if (held or {}).get(k) != key[k]), "resume_key")
        print(f"{args.out}: measured with {diff}={(held or {}).get(diff)!r}, this run has {key[diff]!r}; the same "
              "settings to resume, another --out, or --fresh to start over", file=sys.stderr)
        raise SystemExit(2)
    print(f"[data_scaling] resuming {args.out}: {len(old.get('points', {}))} points, {len(old.get('engines', {}))} "
          "sizes served", file=sys.stderr, flush=True)
    return {**fresh, **{k: old.get(k, fresh[k]) for k in ("points", "engines", "sessions")}}


def print_table(state: dict[str, Any]) -> None:
    """One line per point: data, training, vLLM at its best K beside ngram in the same process; then the fits."""
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    print(f"{'mode':12s} {'recipe':11s} {'asked':>9s} {'tokens':>9s} {'steps':>6s} {'train s':>8s} {'tok/s':>6s} | "
          f"{'K':>2s} {'AL':>5s} {'x':>5s} {'load':>5s} | ngram K {'AL':>5s} {'x':>5s}")
    for p in sorted(state["points"].values(), key=lambda p: (p["tokens_asked"], p["mode"], p["recipe"])):
        if "skipped" in p:
            print(f"{p['mode']:12s} {p['recipe']:11s} {p['tokens_asked']:9d} skipped: {p['skipped']}")
            continue
        t, e, n = p["train"], p.get("engine") or {}, p.get("ngram") or {}
        print(f"{p['mode']:12s} {p['recipe']:11s} {p['tokens_asked']:9d} {p['data']['tokens']:9d} "
              f"{f(t['optimizer_steps'], 'd'):>6s} {f(t['train_s'], '.0f'):>8s} {f(t['tokens_per_s'], '.0f'):>6s} | "
              f"{f(e.get('k'), 'd'):>2s} {f(e.get('acceptance_length')):>5s} {f(e.get('speedup')):>5s} "
              f"{f(e.get('load_1m')):>5s} | {f(n.get('k'), 'd'):>7s} {f(n.get('acceptance_length')):>5s} "
              f"{f(n.get('speedup')):>5s}")
    print("tokens: the prefix's stored tokens; tok/s: loss tokens trained a second; K: the fastest K in vLLM; AL: "
          "vLLM's acceptance length there; x: its speedup over no draft; ngram: vLLM's, the same process")
    for key, fits in (state.get("fit") or {}).get("series", {}).items():
        print(describe(key, fits))


if __name__ == "__main__":
    raise SystemExit(main())
